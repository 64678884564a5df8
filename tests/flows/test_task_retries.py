"""Stage tasks retry after a backoff schedule, never at once (tasks.retry_delay_seconds)."""

from __future__ import annotations

import pytest

from flows.config import load_run_config
from gpu_jobs.stages.config import ConfigError
from gpu_jobs.stages.sections import TaskConfig


def test_default_is_a_backoff_schedule_not_zero():
    cfg = TaskConfig()
    assert cfg.retries == 2
    assert cfg.retry_delay_seconds == [10.0, 40.0, 160.0]
    delays = cfg.retry_delay_seconds
    assert all(b == 4 * a for a, b in zip(delays, delays[1:]))  # x4 each time
    assert "storage.retry_budget_seconds" in TaskConfig.model_fields["retry_delay_seconds"].description


@pytest.mark.parametrize("value,expected", [("[5, 30]", [5.0, 30.0]), ("0", 0.0), ("12.5", 12.5)])
def test_overrides_accept_a_list_or_one_number(value, expected):
    cfg = load_run_config(None, [f"tasks.retry_delay_seconds={value}"])
    assert cfg.tasks.retry_delay_seconds == expected


@pytest.mark.parametrize("value,needle", [("[]", "at least one"), ("[5, -1]", ">= 0"), ("-3", ">= 0"),
                                          (str(list(range(51))), "at most 50")])
def test_bad_delays_are_refused_naming_the_key(value, needle):
    with pytest.raises(ConfigError, match=rf"tasks\.retry_delay_seconds.*{needle}"):
        load_run_config(None, [f"tasks.retry_delay_seconds={value}"])


def test_stage_tasks_carry_the_schedule_and_prefect_accepts_the_runs_own():
    from gpu_jobs.stages import STAGES
    from tasks.stages import stage_task

    for spec in STAGES.values():
        t = stage_task(spec)
        assert t.name == spec.name and t.retries == 2 and t.retry_delay_seconds == [10.0, 40.0, 160.0], t.name
    cfg = load_run_config(None, ["tasks.retries=3", "tasks.retry_delay_seconds=[1, 2]"])
    # What flows/training.py's PrefectCalls does with the run's settings.
    t = stage_task(STAGES["reward"]).with_options(retries=cfg.tasks.retries,
                                           retry_delay_seconds=cfg.tasks.retry_delay_seconds,
                                           timeout_seconds=cfg.tasks.timeout_seconds)
    assert t.retries == 3 and t.retry_delay_seconds == [1.0, 2.0]

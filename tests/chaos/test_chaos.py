"""The reduced chaos suite `make test` runs (the full one is `make chaos`).

    .venv/bin/python -m pytest -q tests/chaos

Each scenario is a real run with a real fault: SIGKILLs at exact points of three iterations and
at each moment after the last commit (the final validation, the report, the flow's return, after
Completed), a checkpoint file corrupted on disk, the S3 endpoint stopped for 40 s during a commit (one run,
no restart: storage's own backoff carries it), a reward function that raises/hangs/returns NaN or
a string, bad datasets and bad configs. A killed-and-resumed run must finish with weights bitwise
equal to an uninterrupted one. It runs as two halves (two classes), which `make test` runs side
by side on its two workers (`python -m benchmarks.chaos --quick` runs the whole set in one process).
"""

from __future__ import annotations

import pytest

import subprocess
import sys
from pathlib import Path

from benchmarks.chaos.__main__ import format_table
from benchmarks.chaos.failpoints import _stage_of, parse
from benchmarks.chaos.harness import Outcome
from benchmarks.chaos.scenarios import QUICK

REPO = Path(__file__).resolve().parents[2]


def test_failpoint_specs_parse_and_bad_ones_are_named():
    assert parse("after-commit:reward:2") == ("after-commit", "reward", 2)
    for bad in ("after-commit:reward", "sometime:reward:2", "after-commit:reward:x"):
        with pytest.raises(ValueError, match="not <kind>:<stage>:<iteration>"):
            parse(bad)


def test_stage_of_a_manifest_path():
    assert _stage_of("b/runs/r/iterations/3/reward/_MANIFEST.json") == ("reward", 3)
    assert _stage_of("/x/runs/r/iterations/12/advantages") == ("advantages", 12)
    assert _stage_of("/x/runs/r/checkpoints/2/policy/model.safetensors.index.json") is None


def test_table_shows_refused_input_as_dash_and_failures_as_no():
    table = format_table([Outcome("f1", "ok", True, 0, "= reference"), Outcome("f2", "refused", None, 0),
                          Outcome("f3", "broken", False, 2), Outcome("f4", "stopped early", False, 0, "-", 5),
                          Outcome("f5", "harness error", False, -1, "-", -1)])
    assert table.splitlines()[0] == "| fault | outcome | recovered | data lost | not finished | weights |"
    assert "| f1 | ok | yes | 0 | 0 | = reference |" in table
    assert "| f2 | refused | - | 0 | 0 | - |" in table
    assert "| f3 | broken | no | 2 | 0 | - |" in table
    assert "| f4 | stopped early | no | 0 | 5 | - |" in table  # unfinished is not lost
    assert "| f5 | harness error | no | ? | ? | - |" in table


def test_audit_keeps_data_lost_apart_from_not_finished(tmp_path):
    import pyarrow as pa

    from benchmarks.chaos.audit import audit, snapshot
    from storage import RunLayout, write_table

    lay = RunLayout(str(tmp_path), "r")
    for stage in ("rollout", "gate", "reward", "advantages", "update", "commit"):
        write_table(lay.stage(1, stage), pa.table({"uid": ["a", "b"]}))
    before = snapshot(lay)
    report = audit(lay, before, iterations=3)  # iteration 1 committed, 2 and 3 never produced
    assert report.data_lost == 0 and report.not_finished == 12
    (tmp_path / "runs/r/iterations/1/reward/_MANIFEST.json").unlink()  # committed, then gone
    report = audit(lay, before, iterations=1)
    assert report.data_lost == 1 and report.lost and report.not_finished == 1


def test_async_lineage_names_a_rollout_used_twice_or_made_with_other_weights(tmp_path):
    import pyarrow as pa

    from benchmarks.chaos.audit import audit, rollout_lineage
    from storage import RunLayout, write_table

    lay = RunLayout(str(tmp_path), "r")
    # s=1: rollouts 1 and 2 sample with the start model (version 0), rollout 3 with update 1's weights
    rollouts = {k: write_table(lay.stage(k, "rollout"), pa.table({"uid": [f"{k}-a"]}),
                               metrics={"async/weights_version": v}) for k, v in ((1, 0), (2, 0), (3, 1))}
    for k in (1, 2):
        write_table(lay.stage(k, "gate"), pa.table({"uid": [f"{k}-a"]}), inputs=[rollouts[k]])
    assert rollout_lineage(lay, 3, staleness_threshold=1) == []
    assert rollout_lineage(lay, 3, staleness_threshold=0) == ["rollout 2 sampled with the weights of update 0",
                                                              "rollout 3 sampled with the weights of update 1"]
    write_table(lay.stage(3, "gate"), pa.table({"uid": ["2-a"]}), inputs=[rollouts[2]])  # rollout 2 again
    problems = rollout_lineage(lay, 3, staleness_threshold=1)
    assert "gate 3 did not read rollout 3" in problems and any("used by iterations [2, 3]" in p for p in problems)
    assert audit(lay, {}, 3, staleness_threshold=1).data_lost == len(problems)


def test_in_flight_failpoint_parses():
    assert parse("in-flight:update:2") == ("in-flight", "update", 2)


def test_quick_set_has_the_40s_outage_and_every_scenario_is_kept():
    from benchmarks.chaos.scenarios import SCENARIOS

    assert {"s3-outage-long", "kill-after-last-commit"} <= set(QUICK) <= set(SCENARIOS)
    for name in ("s3-outage", "s3-outage-long", "s3-outage-3min", "stale-lock", "kill-leaves-nothing",
                 "sigkill-chain", "kill-mid-commit", "corrupt-checkpoint", "reward-faults", "bad-config",
                 "async-kill-in-flight", "async-kill-random", "ranks-kill-after-train"):
        assert name in SCENARIOS


# The quick set in two halves, each its own process and its own class: `make test` distributes by
# module and class (--dist loadscope), so two workers run them side by side (the 40 s S3 outage
# leaves a core idle); each half runs its own reference run.
HALVES = (("sigkill-chain", "kill-after-last-commit", "corrupt-checkpoint"),
          ("s3-outage-long", "reward-faults-mixed", "bad-dataset", "bad-config"))


def test_the_halves_are_the_quick_set():
    assert sorted(n for half in HALVES for n in half) == sorted(QUICK)


def _survives(names: tuple[str, ...]) -> None:
    # Its own process: the in-process S3 endpoint imports Flask, whose context proxies break
    # vLLM's kernel registration in any later test of the same process; the harness also pins
    # torch to one thread for the bitwise comparisons.
    from gpu_jobs.train.ranks.dist import child_env

    done = subprocess.run([sys.executable, "-m", "benchmarks.chaos", "--only", ",".join(names)], cwd=REPO,
                          env={**child_env(), "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=1800)
    table = [ln for ln in done.stdout.splitlines() if ln.startswith("| ") and not ln.startswith("| fault")]
    assert done.returncode == 0 and len(table) == len(names), done.stdout[-4000:]
    for row in table:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] in ("yes", "-") and cells[3] == "0" and cells[4] == "0" and cells[5] in ("= reference", "-"), row


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.deepspeed
class TestKillsAndCorruption:
    def test_every_run_survives_its_fault(self):
        _survives(HALVES[0])


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.deepspeed
class TestOutagesAndBadInput:
    def test_every_run_survives_its_fault(self):
        _survives(HALVES[1])

"""The reduced chaos suite `make test` runs (the full one is `make chaos`).

    .venv/bin/python -m pytest -q tests/chaos

Each scenario is a real run with a real fault: SIGKILLs at exact points of three iterations,
a checkpoint file corrupted on disk, the S3 endpoint stopped during a commit, a reward function
that raises/hangs/returns NaN or a string, bad datasets and bad configs. A killed-and-resumed
run must finish with weights bitwise equal to an uninterrupted one.
"""

from __future__ import annotations

import pytest

from benchmarks.chaos.__main__ import format_table
from benchmarks.chaos.failpoints import _stage_of, parse
from benchmarks.chaos.harness import Chaos, Outcome
from benchmarks.chaos.scenarios import QUICK, SCENARIOS


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
                          Outcome("f3", "broken", False, 2)])
    assert "| f1 | ok | yes | 0 | = reference |" in table
    assert "| f2 | refused | - | 0 | - |" in table
    assert "| f3 | broken | no | 2 | - |" in table


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # in-process runs are compared bitwise with the one-thread reference
    with Chaos.start(tmp_path_factory.mktemp("chaos")) as c:
        yield c
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.deepspeed
@pytest.mark.parametrize("name", QUICK)
def test_the_run_survives(chaos, name):
    fault, fn = SCENARIOS[name]
    row = fn(chaos)
    assert row.data_lost == 0, row
    assert row.recovered in (True, None), row  # None: bad input refused before any write
    assert row.weights in ("= reference", "-"), row

"""`rlmill verify [--repair]`: damaged committed data is found, and only what can be recomputed
is set aside (copied, then uncommitted); nothing is deleted."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from gpu_jobs.stages.verify import set_aside, verify_run
from storage import RunLayout, commit, committed, join, read_table, write_files, write_table


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def run(tmp_path):
    """Iteration 1 fully committed (its update too); iteration 2 in flight up to advantages."""
    layout = RunLayout(str(tmp_path / "root"), "r")
    table = pa.table({"uid": ["a", "b"], "x": [1.0, 2.0]})
    for k, stages in ((1, ("rollout", "advantages", "update", "commit")), (2, ("rollout", "advantages"))):
        for stage in stages:
            write_table(layout.stage(k, stage), table)
    return layout


def _shard(layout, k, stage):
    return next(Path(layout.stage(k, stage)).glob("part-*.parquet"))


def test_an_intact_run_has_nothing_to_report(run):
    assert verify_run(run) == []


def test_damage_in_flight_is_repairable_and_consumed_damage_is_not(run):
    _flip(_shard(run, 2, "advantages"))
    _flip(_shard(run, 1, "advantages"))
    found = {d.what: d for d in verify_run(run)}
    assert set(found) == {"iteration 1 advantages", "iteration 2 advantages"}
    assert found["iteration 2 advantages"].repairable and "sha256" in found["iteration 2 advantages"].error
    assert not found["iteration 1 advantages"].repairable
    with pytest.raises(ValueError, match="cannot be recomputed"):
        set_aside(run, found["iteration 1 advantages"])
    assert committed(run.stage(1, "advantages"))  # refused: nothing was touched


def test_set_aside_keeps_the_damaged_copy_and_uncommits_the_stage(run):
    victim = _shard(run, 2, "advantages")
    _flip(victim)
    (damage,) = verify_run(run)
    copy = set_aside(run, damage)
    assert committed(run.stage(2, "advantages")) is None  # the next run recomputes it
    assert ".damaged-" in copy and committed(copy)
    with pytest.raises(Exception, match="sha256"):
        read_table(copy)  # the copy is the damaged data, kept for inspection
    assert verify_run(run) == []  # a set-aside copy is not a stage of the run
    assert committed(run.stage(2, "rollout"))  # nothing else moved


def test_the_cli_exits_nonzero_until_repaired(run, capsys, tmp_path):
    from flows.cli import main

    _flip(_shard(run, 2, "advantages"))
    example = Path(__file__).resolve().parents[2] / "examples" / "grpo_arith.yaml"
    args = ["verify", "--config", str(example), f"root={run.root_url}", "run_id=r"]
    with pytest.raises(SystemExit, match="verify --repair"):
        main(args)
    main(["verify", "--repair", *args[1:]])
    assert "set aside as" in capsys.readouterr().out
    main(args)
    assert "intact" in capsys.readouterr().out


def test_a_damaged_trainer_or_critic_state_is_found_by_the_same_verifier(run):
    """Checkpoint states are commits of the same primitive (here written without DeepSpeed):
    a flipped byte in any listed file is named; nothing needs repairing (restore falls back)."""
    for url in (run.trainer(1), join(run.checkpoint(1), "critic")):
        files = write_files(url, {"attempt/zero/mp_rank_00_model_states.pt": b"weights" * 100}, run.storage)
        commit(url, files, kind="trainer", storage=run.storage)
    run.set_latest(1)
    assert verify_run(run) == []
    _flip(Path(run.trainer(1)) / "attempt" / "zero" / "mp_rank_00_model_states.pt")
    (damage,) = verify_run(run)
    assert damage.what == "checkpoint 1 trainer" and damage.url == run.trainer(1) and not damage.repairable
    assert "mp_rank_00_model_states.pt: sha256" in damage.error

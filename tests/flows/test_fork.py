"""`rlmill train --from RUN@K`: a new run whose starting state is another run's checkpoint K.

    .venv/bin/python -m pytest -q tests/flows/test_fork.py

One tiny parent run (3 iterations, checkpoints at 2 and 3) is trained through the CLI and the
rl-training flow; forks of its checkpoint 2 go on at iteration 3. A fork with the parent's config
ends bit for bit where the parent ended (the policy's shards and every committed metric but
timings); a fork with a lower lr records the change and ends elsewhere; `rlmill verify` checks a
fork with its parent out of reach; refused forks are one `rlmill:` line and write nothing.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from flows.cli import main
from tests.tiny import EXAMPLE, tiny_overrides

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

PARENT = ["trainer.total_iterations=3", "trainer.checkpoint_every=2"]


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    """(root, the CLI arguments that trained it): run `parent` under a Prefect API of this module's own."""
    from tests.servers import module_prefect_api

    root = str(tmp_path_factory.mktemp("fork") / "root")
    with module_prefect_api(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLMILL_LOCK_DIR", str(Path(root).parent / "locks"))
        main(["train", "--config", str(EXAMPLE), *tiny_overrides(root, *PARENT, "run_id=parent")])
        yield root


@pytest.fixture(scope="module")
def same(parent):
    """The first line `rlmill train --from parent@2` printed for run `same` (the parent's config)."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setenv("RLMILL_LOCK_DIR", str(Path(parent).parent / "locks"))
        _train(parent, "--from", "parent@2", "run_id=same")
    return out.getvalue().lstrip().splitlines()[0]


def _train(root: str, *argv: str) -> None:
    main(["train", "--config", str(EXAMPLE), *argv, *tiny_overrides(root, *PARENT)])


def _run(root: str, run_id: str) -> Path:
    return Path(root) / "runs" / run_id


def _weights_sha256(run: Path, k: int) -> dict[str, str]:
    index = json.loads((run / "checkpoints" / str(k) / "policy" / "model.safetensors.index.json").read_text())
    return {f["path"]: f["sha256"] for f in index["files"] if f["path"].endswith(".safetensors")}


def _metrics(run: Path, k: int, stage: str) -> dict:
    m = json.loads((run / "iterations" / str(k) / stage / "_MANIFEST.json").read_text())["metrics"]
    return {n: v for n, v in m.items() if not n.startswith(("timing_s/", "perf/"))}


def _files(root: str) -> set[str]:
    return {str(p) for p in Path(root).rglob("*")}


def test_a_fork_with_the_parents_config_ends_bitwise_equal_to_the_parent(parent, same, capsys):
    assert same == "rlmill: run same (new, forked from parent at iteration 2 (same config))", same
    a, b = _run(parent, "parent"), _run(parent, "same")
    assert _weights_sha256(b, 3) == _weights_sha256(a, 3)
    assert _metrics(b, 3, "commit") == _metrics(a, 3, "commit") and _metrics(a, 3, "commit")["actor/lr"] == 1e-4
    assert _metrics(b, 3, "validate") == _metrics(a, 3, "validate")
    # The child holds its own copy of checkpoint 2 and no iteration before 3.
    assert sorted(p.name for p in (b / "iterations").iterdir()) == ["2", "3"]  # 2: the validation it starts with
    assert not (b / "iterations" / "2" / "rollout").exists()
    frozen = json.loads((b / "run.json").read_text())
    assert frozen["forked_from"]["run"] == "parent" and frozen["forked_from"]["iteration"] == 2
    assert frozen["config_changes"] == {} and frozen["forked_from"]["fresh_optimizer"] is False
    for what, folder, name in (("policy", "policy", "model.safetensors.index.json"),
                               ("trainer", "trainer", "_MANIFEST.json")):
        copy = json.loads((b / "checkpoints" / "2" / folder / name).read_text())
        assert copy["inputs"] == [str(a / "checkpoints" / "2" / folder / name)]
        from storage import read_manifest

        assert read_manifest(str(b / "checkpoints" / "2" / folder), name=name).sha256 == \
            frozen["forked_from"]["manifests"][what]
    # `rlmill verify` checks the child on its own: the parent is out of reach meanwhile.
    away = a.with_name("parent.away")
    os.rename(a, away)
    try:
        main(["verify", "--config", str(EXAMPLE), f"root={parent}", "run_id=same"])
    finally:
        os.rename(away, a)
    assert "run same: every committed table and checkpoint is intact" in capsys.readouterr().out
    from gpu_jobs.stages.fork import lineage

    assert lineage(parent, "same") == ["parent@2"] and lineage(parent, "parent") == []


def test_a_fork_with_a_lower_lr_records_it_and_differs(parent, capsys, monkeypatch):
    monkeypatch.setenv("RLMILL_LOCK_DIR", str(Path(parent).parent / "locks"))
    _train(parent, "--from", "parent@2", "actor.lr=5e-5")
    first = capsys.readouterr().out.lstrip().splitlines()[0]
    run_id = first.split()[3].rstrip(",")
    assert first.startswith(f"rlmill: new run {run_id}, forked from parent at iteration 2 (actor.lr 0.0001 -> 5e-05)")
    a, b = _run(parent, "parent"), _run(parent, run_id)
    assert json.loads((b / "run.json").read_text())["config_changes"] == {"actor.lr": {"from": 1e-4, "to": 5e-5}}
    assert _metrics(b, 3, "commit")["actor/lr"] == 5e-5
    assert _weights_sha256(b, 3) != _weights_sha256(a, 3)
    # The same command again, naming the child, resumes it (nothing to do: it is complete).
    _train(parent, "--from", "parent@2", "actor.lr=5e-5", f"run_id={run_id}")
    assert "(resuming it where it stopped, forked from parent" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--from", "parent@1"], "run parent has no committed checkpoint at iteration 1; it has checkpoints at 2, 3: "
                             "give one of them"),
    (["--from", "parent"], "--from 'parent' is not RUN@K"),
    (["--from", "../x@2"], "invalid run id '../x'"),
    (["--from", "parent@0"], "iteration 0 is the start model"),
    (["--from", "nosuch@2"], "no run 'nosuch' under"),
    (["--from", "parent@2", "model.seed=1"], "model.seed=1 (the parent's: 0): a fork goes on from the parent's"),
    (["--from", "parent@3"], "trainer.total_iterations=3 leaves nothing to train after iteration 3"),
    (["--from", "parent@2", "run_id=parent"], "run parent already exists (not a fork): --from starts a new run"),
    (["--fresh-optimizer"], "--fresh-optimizer goes with --from RUN@K"),
    (["--config", str(EXAMPLE.with_name("sft_arith.yaml")), "--from", "parent@2"],
     "run parent trains with RL and this config with SFT: a fork goes on"),
], ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_a_fork_that_cannot_be_made_is_one_line_before_any_write(parent, argv, words, monkeypatch):
    monkeypatch.setenv("RLMILL_LOCK_DIR", str(Path(parent).parent / "locks"))
    before = _files(parent)
    with pytest.raises(SystemExit) as exit_:
        _train(parent, *argv)
    line = str(exit_.value.code)
    assert line.startswith("rlmill: ") and "\n" not in line and words in line, line
    assert _files(parent) == before


def test_fresh_optimizer_takes_the_weights_and_drops_the_moments(parent):
    """--fresh-optimizer: the child's trainer starts with the parent's checkpoint-2 weights and
    no Adam state; without it, the moments come along."""
    import torch

    from flows.config import load_run_config
    from gpu_jobs.stages import open_warm
    from gpu_jobs.stages.fork import materialize, parse_point, plan_fork
    from storage import RunLayout, load_state_dict

    expected = load_state_dict(RunLayout(parent, "parent").policy(2))
    for fresh in (True, False):
        cfg = load_run_config(EXAMPLE, tiny_overrides(parent, *PARENT, f"run_id=fresh-{fresh}"))
        materialize(plan_fork(cfg, parse_point("parent@2"), fresh_optimizer=fresh))
        run, roles = open_warm(cfg, probe=False)
        try:
            assert roles.version == 2 and roles.trainer.step == 2
            got = roles.trainer.gathered_state_dict()
            assert all(torch.equal(got[n], expected[n]) for n in expected if n in got)
            assert (len(roles.trainer.optimizer.state) == 0) is fresh
        finally:
            roles.close()


def test_a_model_version_copied_from_a_fork_names_its_parent(parent, same):
    from flows.cli_models import survey
    from storage import ModelLayout, RunLayout, copy_checkpoint

    layout = ModelLayout(parent, "forked")
    copy_checkpoint(RunLayout(parent, "same").policy(3), layout.version("v1"))
    (info,) = survey(layout).committed
    assert (info.run, info.iteration, info.forked_from) == ("same", 3, ("parent@2",))


def test_an_unfinished_fork_is_finished_by_the_same_fork_and_refused_to_another(parent):
    """A fork stopped before its run.json left copies no run owns: the same fork into that run id
    finishes them; a fork whose copy would differ (here: the other --fresh-optimizer) is refused."""
    from flows.config import load_run_config
    from gpu_jobs.stages.fork import ForkError, _copy, materialize, parse_point, plan_fork
    from storage import RunLayout

    cfg = load_run_config(EXAMPLE, tiny_overrides(parent, *PARENT, "run_id=unfinished"))
    first = plan_fork(cfg, parse_point("parent@2"), fresh_optimizer=True)
    _copy(first, *next(c for c in first.copies if c[0] == "trainer"))  # then the process died
    assert RunLayout(parent, "unfinished").read_run_json() is None
    with pytest.raises(ForkError, match="already holds another trainer"):
        materialize(plan_fork(cfg, parse_point("parent@2")))
    materialize(plan_fork(cfg, parse_point("parent@2"), fresh_optimizer=True))
    assert RunLayout(parent, "unfinished").read_run_json()["forked_from"]["fresh_optimizer"] is True


def test_an_async_fork_copies_the_weights_its_first_rollouts_sample_with(tmp_path):
    """With async_training.staleness_threshold=1 iteration 3 samples with the weights after update
    1: the fork of checkpoint 2 holds a copy of them and ends bitwise where the parent ends."""
    import torch

    from flows.config import load_run_config
    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
    from gpu_jobs.stages.fork import materialize, parse_point, plan_fork

    root = str(tmp_path / "root")
    config = lambda run_id: load_run_config(EXAMPLE, tiny_overrides(  # noqa: E731
        root, *PARENT, "async_training.staleness_threshold=1", "actor.recompute_old_logprobs=true",
        "trainer.val_before_train=false", f"run_id={run_id}"))
    weights = {}
    for run_id, ks in (("async-parent", (1, 2, 3)), ("async-fork", (3,))):
        if run_id == "async-fork":
            plan = plan_fork(config(run_id), parse_point("async-parent@2"))
            assert [what for what, *_ in plan.copies] == ["policy", "trainer", "policy 1"]
            materialize(plan)
        run, roles = open_warm(config(run_id), probe=False)
        try:
            for k in ks:
                run_iteration(DirectCalls(run, roles), run.cfg, k)
            weights[run_id] = {n: t.clone() for n, t in roles.trainer.gathered_state_dict().items()}
        finally:
            roles.close()
    a, b = weights["async-parent"], weights["async-fork"]
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

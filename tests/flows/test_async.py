"""Asynchronous RL: the staleness schedule, rollouts that record their weights version, rollout
correction in a real update, and exact resume when a stale rollout must be reproduced.

    .venv/bin/python -m pytest -q tests/flows/test_async.py
"""

from __future__ import annotations

import pytest
import torch

from gpu_jobs import stages
from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
from storage import committed, read_manifest, read_table

pytestmark = pytest.mark.deepspeed

ASYNC = ("async_training.staleness_threshold=1", "actor.recompute_old_logprobs=true",
         "algorithm.rollout_correction.rollout_is=token", "trainer.checkpoint_every=10")


def test_the_schedule_is_a_pure_function_of_the_threshold(tiny_config):
    versions = lambda s: [tiny_config(f"async_training.staleness_threshold={s}", "actor.recompute_old_logprobs=true")
                          .async_training.weights_version(k) for k in range(1, 6)]  # noqa: E731
    assert versions(0) == [0, 1, 2, 3, 4]
    assert versions(1) == [0, 0, 1, 2, 3]
    assert versions(2) == [0, 0, 0, 1, 2]


def test_async_needs_the_trainers_old_logprobs(tiny_config):
    from flows.config import ConfigError

    with pytest.raises(ConfigError, match="recompute_old_logprobs"):
        tiny_config("async_training.staleness_threshold=1", "actor.recompute_old_logprobs=false")


def _weights(roles):
    return {k: v.clone() for k, v in roles.trainer.gathered_state_dict().items()}


def test_one_step_off_rollouts_record_their_version_and_are_corrected(tiny_config):
    cfg = tiny_config(*ASYNC, "trainer.total_iterations=3")
    run, eng = open_warm(cfg)
    for k in (1, 2, 3):
        uris = run_iteration(DirectCalls(run, eng), cfg, k)
        rollout = read_manifest(uris["rollout"], run.storage)
        assert rollout.metrics["async/weights_version"] == max(0, k - 2)
        update = read_manifest(uris["update"], run.storage).metrics
        assert update["async/staleness_max"] == (0 if k == 1 else 1)
        adv = read_table(uris["advantages"], storage=run.storage)
        assert "rollout_is_weights" in adv.column_names
        commit = read_manifest(uris["commit"], run.storage).metrics
        assert "rollout_corr/is_weight_mean" in commit and "training/rollout_probs_diff_mean" in commit
    # iteration 1's own rollout and the one it ran ahead for iteration 2 both used the start model
    assert committed(run.layout.stage(2, "rollout"), run.storage)
    # every version a later rollout may need is published as a loadable HF folder
    from storage import exists
    from storage import INDEX_NAME, join

    for v in (1, 2):
        assert exists(join(run.layout.policy(v), INDEX_NAME), run.storage), v


def test_resume_reproduces_a_stale_rollout_bitwise(tiny_config, tmp_path):
    """A crash after update 3 committed but before rollout 4 (which needs the weights after
    update 2, not the trainer's): the resumed run loads the published version and ends with the
    weights of a run that never stopped."""
    extra = (*ASYNC, "trainer.total_iterations=4")
    straight = tiny_config(*extra, root=str(tmp_path / "straight"))
    run, eng = open_warm(straight)
    for k in range(1, 5):
        run_iteration(DirectCalls(run, eng), straight, k)
    expected = _weights(eng)

    crashed = tiny_config(*extra, root=str(tmp_path / "crashed"))
    run, eng = open_warm(crashed)
    for k in (1, 2):
        run_iteration(DirectCalls(run, eng), crashed, k)
    calls = DirectCalls(run, eng)
    batch = calls(stages.gate, 3, calls(stages.rollout, 3))
    adv = calls(stages.advantages, 3, batch, calls(stages.reward, 3, batch), calls(stages.logprobs, 3, batch))
    calls(stages.update, 3, adv)  # ...and the process dies before rollout 4
    assert committed(run.layout.stage(4, "rollout"), run.storage) is None
    del run, eng

    run, eng = open_warm(crashed)  # trainer replayed to update 3; rollout 4 needs update 2's weights
    assert eng.version == 3
    for k in (3, 4):
        run_iteration(DirectCalls(run, eng), crashed, k)
    got = _weights(eng)
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name
    a = read_table(committed(run.layout.stage(4, "rollout"), run.storage), storage=run.storage)
    b = read_table(str(tmp_path / "straight" / "runs" / straight.run_id / "iterations" / "4" / "rollout" /
                       "_MANIFEST.json"), storage=None)
    assert a.column("response_ids").to_pylist() == b.column("response_ids").to_pylist()

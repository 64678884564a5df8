"""A run whose update is a warm group of 2 DeepSpeed ranks (trainer.n_gpus_per_node=2).

    .venv/bin/python -m pytest -q tests/flows/test_ranks.py
"""

from __future__ import annotations

import pytest
import torch

from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
from tests.train.update_gap import REORDER_REL, update_gap

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]


def _weights(roles):
    return {k: v.clone() for k, v in roles.trainer.gathered_state_dict().items()}


def test_two_rank_run_keeps_one_warm_group_and_resumes_bitwise(tiny_config, tmp_path):
    extra = ("trainer.n_gpus_per_node=2", "trainer.total_iterations=3", "trainer.checkpoint_every=2",
             "actor.zero_stage=3")
    cfg = tiny_config(*extra, root=str(tmp_path / "a"))
    run, eng = open_warm(cfg)
    try:
        pids = None
        for k in (1, 2, 3):
            uris = run_iteration(DirectCalls(run, eng), cfg, k)
            assert eng.trainer.world_size == 2
            pids = pids or list(eng.trainer.pids)
            assert list(eng.trainer.pids) == pids  # the same rank processes serve every iteration
        assert eng.trainer.groups_started == 1
        assert uris["commit"]
        expected = _weights(eng)
    finally:
        eng.close()

    # The same run killed after iteration 2 (checkpoint 2) and resumed by a new process/group.
    cfg_b = tiny_config(*extra, root=str(tmp_path / "b"))
    run_b, eng_b = open_warm(cfg_b)
    try:
        for k in (1, 2):
            run_iteration(DirectCalls(run_b, eng_b), cfg_b, k)
    finally:
        eng_b.close()
    run_b, eng_b = open_warm(cfg_b)
    try:
        assert eng_b.version == 2
        run_iteration(DirectCalls(run_b, eng_b), cfg_b, 3)
        got = _weights(eng_b)
    finally:
        eng_b.close()
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name


def test_a_pipeline_parallel_run_trains_on_its_warm_group_like_one_rank(tiny_config, tmp_path):
    """actor.pipeline_parallel_size=2 on 2 ranks: the group's ranks run the DeepSpeed pipeline
    trainer (ZeRO 0), its weights reach the rollout engine (the agreement probe checks each
    update), and 2 iterations end where one rank in-process ends, to float rounding."""
    from storage import read_manifest

    common = ("trainer.total_iterations=2", "trainer.checkpoint_every=2")
    cfg = tiny_config(*common, "trainer.n_gpus_per_node=2", "actor.pipeline_parallel_size=2",
                      root=str(tmp_path / "pipe"))
    run, eng = open_warm(cfg)
    try:
        for k in (1, 2):
            uris = run_iteration(DirectCalls(run, eng), cfg, k)
            m = read_manifest(uris["update"], run.storage).metrics
            assert m["training/rollout_probs_diff_mean"] < 1e-4, m  # the synced weights are the trainer's
        assert eng.trainer.groups_started == 1 and eng.trainer.zero_stage == 0
        piped = _weights(eng)
    finally:
        eng.close()
    one_cfg = tiny_config(*common, "actor.use_remove_padding=false", root=str(tmp_path / "one"))  # pads, as the pipeline
    run, eng = open_warm(one_cfg)
    try:
        init = _weights(eng)  # both runs start from the same checkpoint
        for k in (1, 2):
            run_iteration(DirectCalls(run, eng), one_cfg, k)
        one = _weights(eng)
    finally:
        eng.close()
    # Same samples, same math; sums in another order (the layers on two stages, micro-batches as
    # the pipeline schedules them), so the two differ by float32 rounding, which depends on the
    # CPU's kernels: bitwise equal on an Intel Xeon, max |dw| 2.7e-4 on an AMD EPYC (AVX2) box, as
    # large as the 4 Adam steps of lr 1e-4 themselves, because Adam turns a gradient within rounding
    # of zero into a full step of either sign. So the bound is on the gap over all weights, as a
    # fraction of how far the update moved them (tests/train/update_gap.py says why 1e-2: rounding
    # 1e-6-7e-5 of the update here, a mis-scaled or dropped micro-batch 0.25-0.5 of it).
    gap = update_gap(piped, one, init)
    diff = max((piped[k] - one[k]).abs().max().item() for k in one)
    print(f"\npipeline (2 stages) vs one rank after 2 iterations: ||dw|| {gap:.2e} of the update's norm, "
          f"max |dw| {diff:.2e}")
    assert gap < REORDER_REL, (gap, diff)

"""A run whose update is a warm group of 2 DeepSpeed ranks (trainer.n_gpus_per_node=2).

    .venv/bin/python -m pytest -q tests/flows/test_ranks.py
"""

from __future__ import annotations

import pytest
import torch

from gpu_jobs.stages import DirectCalls, open_warm, run_iteration

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]


def _weights(engines):
    return {k: v.clone() for k, v in engines.trainer.gathered_state_dict().items()}


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

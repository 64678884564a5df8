"""The pure parts of benchmarks/bench_async.py: overlap from run intervals, the disaggregated
prediction, and the learning comparison's overrides.

    .venv/bin/python -m pytest -q tests/bench/test_bench_async.py
"""

from __future__ import annotations

import pytest

from benchmarks.bench_async import learning_overrides, overlap_per_iteration, predicted_gain


def test_overlap_reads_task_run_and_deployment_run_names():
    # update 1 ran 10..20 while rollout 2 ran 15..30: 5 s together; update 2 (40..50) and rollout 3
    # (45..47): 2 s; 2 iterations -> 3.5 s per iteration.
    tasks = {"update-abc": [10, 20], "update-def": [40, 50], "rollout-2 (weights of update 0)": [15, 30],
             "rollout-3 (weights of update 1)": [45, 47], "rollout-1 (weights of update 0)": [0, 9]}
    assert overlap_per_iteration(tasks, 1, 2) == pytest.approx(3.5)
    flows = {"update-0001": [10, 20], "update-0002": [40, 50], "rollout-0002": [15, 30], "rollout-0003": [45, 47]}
    assert overlap_per_iteration(flows, 1, 2) == pytest.approx(3.5)
    assert overlap_per_iteration(flows, 0, 2) == 0.0  # synchronous: nothing runs ahead
    # disjoint intervals overlap by nothing, not by a negative amount
    assert overlap_per_iteration({"update-0001": [0, 1], "rollout-0002": [5, 6]}, 1, 1) == 0.0


def test_predicted_gain_is_the_serial_over_the_overlapped_iteration():
    # t_gen 4, t_update 3 (2 + 1 old log-probs), rest 1: sync 8 s, async max(4, 3) + 1 = 5 s -> 1.6x.
    # The first iteration (warm-up) is left out of the medians.
    it = {"timing_s/gen": 4.0, "timing_s/update_actor": 2.0, "timing_s/old_log_prob": 1.0, "timing_s/step": 8.0}
    gen, update, rest, gain = predicted_gain([{"timing_s/gen": 99.0}, it, it])
    assert (gen, update, rest) == (4.0, 3.0, 1.0) and gain == pytest.approx(1.6)


def test_learning_runs_differ_only_in_what_async_needs():
    sync, stale = learning_overrides("/r", 0, 3, 20, 5), learning_overrides("/r", 1, 3, 20, 5)
    assert "data.seed=3" in sync and "trainer.total_iterations=20" in sync
    extra = set(stale) - set(sync)
    assert extra == {"run_id=learn-1-3", "async_training.staleness_threshold=1", "actor.recompute_old_logprobs=true",
                     "algorithm.rollout_correction.rollout_is=token"}

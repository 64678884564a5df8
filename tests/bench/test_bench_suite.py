"""The reasoning-gym suite bench (benchmarks/bench_suite.py) and its config
(examples/grpo_rg_smollm2.yaml): the stop rule and table on a made-up curve, the suite's families,
and the config as a tiny run on the built-in model (one iteration of a suite task through the
run's stages, then the bench's own start measurement on the same task)."""

from __future__ import annotations

import pytest

from benchmarks.bench_suite import (CANDIDATES, CONFIG, GAIN, SUITE, Curve, family, start_scores, table_lines,
                                    task_overrides)


def test_stop_rule_waits_for_the_goal_then_for_patience():
    curve = Curve(points=[(0, 60.0, 0.20), (5, 200.0, 0.25), (10, 340.0, 0.31)])
    assert curve.reached(GAIN) == (10, 340.0, 0.31) and not curve.should_stop(2)
    curve.points += [(15, 480.0, 0.30), (20, 620.0, 0.29)]
    assert curve.should_stop(2) and not curve.should_stop(3)
    flat = Curve(points=[(0, 60.0, 0.20), *((k, 60.0 + k, 0.20) for k in range(5, 40, 5))])
    assert flat.reached(GAIN) is None and not flat.should_stop(2)  # never stopped before the goal


def test_table_reads_the_curve_within_the_budget():
    row = {"task": "chain_sum", "family": "arithmetic", "points": [(0, 70, 0.1), (5, 500, 0.25), (10, 950, 0.4)],
           "iterations": 11, "gen_tps": 150.0, "s_iter": 40.0, "rss_peak": 7 * 2**30, "rc": 143, "log": "x"}
    line = table_lines([row], 15)[-1]
    assert "| 10.0 % | 25.0 % (it. 5) | 40.0 % | 8.3 |" in line and "7.0 GB" in line
    assert "no validation landed" in table_lines([{**row, "points": []}], 15)[-1]


def test_family_is_reasoning_gyms_package_and_every_suite_task_is_a_candidate():
    assert [family(t) for t in ("chain_sum", "syllogism", "spell_backward")] == ["arithmetic", "logic", "algorithmic"]
    assert set(SUITE) <= set(CANDIDATES)


@pytest.mark.slow  # a model, DeepSpeed and a rollout engine: ~30 CPU-seconds
def test_the_suite_config_runs_a_tiny_iteration_and_its_start(tmp_path):
    from flows.config import load_run_config
    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
    from storage import RunLayout

    tiny = ["model.path=builtin", "rollout.engine=hf", "data.train_size=16", "data.train_batch_size=2",
            "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2",
            "rollout.max_response_length=8", "trainer.tensorboard=false", "trainer.total_iterations=1",
            # the built-in model never writes an <answer> tag: every group would tie and dynamic
            # sampling would refill from the whole dataset
            "algorithm.filter_groups.enable=false"]
    cfg = load_run_config(CONFIG, task_overrides("chain_sum", str(tmp_path), 4, ["run_id=tiny", *tiny]))
    run, roles = open_warm(cfg, probe=False)
    try:
        run_iteration(DirectCalls(run, roles), cfg, 1)
    finally:
        roles.close()
    stages = {s for k, s, _ in RunLayout(str(tmp_path), "tiny").committed_stages() if k == 1}
    assert {"rollout", "reward", "update", "commit"} <= stages
    (row,) = start_scores(["chain_sum"], 4, tiny)
    assert row["n"] == 4 and row["family"] == "arithmetic" and 0.0 <= row["start"] <= 1.0

"""`make bench-scale`'s pure parts (grid, overrides, median reducer, table) and one tiny real run.

    .venv/bin/python -m pytest -q tests/bench/test_bench_scale.py
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import bench_scale as bs

torch.set_num_threads(1)  # 2 cores shared with other jobs


def test_sweep_grid_doubles_one_axis_and_forces_length_only_in_the_length_sweep():
    base = {"prompts": 16, "samples": 4, "length": 8}
    assert [p["prompts"] for p in bs.sweep_grid("prompts", 4, base)] == [16, 32, 64, 128]
    samples = bs.sweep_grid("samples", 3, base)
    assert [(p["prompts"], p["samples"], p["length"]) for p in samples] == [(16, 4, 8), (16, 8, 8), (16, 16, 8)]
    assert [p["length"] for p in bs.sweep_grid("length", 4, base)] == [8, 16, 32, 64]
    assert all(p["ignore_eos"] for p in bs.sweep_grid("length", 2, base))
    assert not any(p["ignore_eos"] for p in bs.sweep_grid("prompts", 2, base) + samples)
    with pytest.raises(ValueError, match="choose from"):
        bs.sweep_grid("width", 2, base)


def test_point_overrides_make_a_valid_config_with_four_optimizer_steps(tmp_path):
    from flows.config import load_run_config

    point = {"prompts": 32, "samples": 8, "length": 16, "ignore_eos": True}
    cfg = load_run_config(bs.EXAMPLE, bs.point_overrides(point, str(tmp_path), "r", iterations=3))
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.rollout.max_response_length) == (32, 8, 16)
    assert cfg.actor.ppo_mini_batch_size == 8  # 32 prompts / 8 per step = 4 steps
    assert cfg.rollout.sampling(0).ignore_eos and not cfg.rollout.greedy().ignore_eos
    # No checkpoint inside the measured iterations (iteration 3 is not the run's last).
    assert cfg.trainer.checkpoint_every > 3 and cfg.trainer.total_iterations > 3


def test_median_metrics_skips_warmup_and_drops_partial_metrics():
    per_it = [{"wall_s": 100.0, "a": 1.0, "b": 9.0},  # warm-up: ignored
              {"wall_s": 3.0, "a": 2.0, "b": 1.0, "tag": "x"},
              {"wall_s": 1.0, "a": 4.0, "b": 2.0, "tag": "y"},
              {"wall_s": 2.0, "a": 6.0}]
    # b is missing from one kept iteration and tag is not numeric: both left out.
    assert bs.median_metrics(per_it) == {"a": 4.0, "wall_s": 2.0}
    with pytest.raises(ValueError, match="more than 1"):
        bs.median_metrics(per_it[:1])


def _med(wall: float, gen: float, tokens: float) -> dict:
    return bs.with_other({"wall_s": wall, "timing_s/gen": gen, "timing_s/update_actor": 0.5,
                          "timing_s/step": 9.0, "response_length/mean": tokens})


def test_other_is_wall_minus_the_split_per_iteration():
    # timing_s/step (a sum of the stage timers) and non-timers are not part of the split.
    assert _med(2.0, 1.0, 3.0)[bs.OTHER] == pytest.approx(0.5)
    # The median of "other" per iteration: wall minus the parts' medians would be 1 - 1 - 1 = -1 here.
    its = [bs.with_other({"wall_s": w, "timing_s/gen": g, "timing_s/update_actor": u})
           for w, g, u in [(9.0, 1.0, 1.0), (1.0, 1.0, 0.0), (1.0, 0.0, 1.0), (2.0, 1.0, 1.0)]]
    assert bs.median_metrics(its)[bs.OTHER] == 0.0


def test_table_rows_and_format():
    grid = bs.sweep_grid("samples", 2, {"prompts": 4, "samples": 2, "length": 8})
    rows = bs.table_rows("samples", grid, [_med(2.0, 1.0, 3.0), _med(3.0, 1.5, 3.5)])
    assert [r["axis"] for r in rows] == [2, 4] and [r["samples"] for r in rows] == [8, 16]
    # other = wall - (gen + update) = 2 - 1.5; tok/s = 8 samples x 3 tokens / 2 s; ratio 3 / 2.
    assert rows[0]["other"] == pytest.approx(0.5) and rows[0]["tok_s"] == pytest.approx(12.0)
    assert rows[0]["ratio"] is None and rows[1]["ratio"] == pytest.approx(1.5)
    assert rows[0]["gate"] is None  # a stage whose metric is absent shows as '-'
    lines = bs.format_table("samples", rows).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| samples | samples/it | resp tok | wall s | gen |")
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert cells[:4] == ["4", "16", "3.5", "3.000"] and cells[-1] == "1.50x" and "-" in cells


@pytest.mark.slow
@pytest.mark.deepspeed
def test_tiny_length_sweep_end_to_end(tmp_path):
    """Real stage iterations: 2 points of the length sweep, 2 iterations each, 4 prompts x 2."""
    base = {"prompts": 4, "samples": 2, "length": 4}
    tables = bs.run_sweeps(["length"], points=2, iterations=2, base=base, workdir=str(tmp_path), log=lambda s: None)
    rows = tables["length"]
    assert [r["axis"] for r in rows] == [4, 8] and [r["samples"] for r in rows] == [8, 8]
    # ignore_eos reaches the engine through the rollout stage: every response is full length.
    assert [r["resp_tokens"] for r in rows] == [4.0, 8.0]
    for r in rows:
        assert r["wall"] > 0 and r["gen"] > 0 and r["update"] > 0 and r["commit"] > 0 and r["tok_s"] > 0
        assert r["wall"] >= r["gen"] + r["update"]
    assert rows[0]["ratio"] is None and rows[1]["ratio"] > 0
    assert len(bs.format_table("length", rows).splitlines()) == 4


def test_rank_threads_split_the_budget():
    assert [bs.rank_threads(2, r) for r in (1, 2)] == [2, 1]
    assert [bs.rank_threads(1, r) for r in (1, 2)] == [1, 1]  # never 0 threads


def test_proc_parsers():
    # /proc/<pid>/task/<tid>/schedstat: ns on a CPU, ns waiting on the run queue, timeslices.
    assert bs.parse_schedstat("2500000000 500000000 1234\n") == (2.5, 0.5)
    status = "Name:\tpython\nVmPeak:\t  900 kB\nVmHWM:\t  123456 kB\nVmRSS:\t  100000 kB\n"
    assert (bs.status_kib(status, "VmHWM"), bs.status_kib(status, "VmRSS")) == (123456, 100000)
    with pytest.raises(KeyError, match="VmSwap"):
        bs.status_kib(status, "VmSwap")
    # This process's own files parse.
    sum(range(10 ** 6))  # some CPU time on this thread
    assert bs.rank_schedstat([os.getpid()])[0][0] > 0 and bs.rank_memory_kib([os.getpid()], "VmHWM")[0] > 0


def test_time_shares():
    assert bs.time_shares(1.0, 0.5, 2.0) == pytest.approx({"cpu": 0.5, "runq": 0.25, "blocked": 0.25})
    # Counters a little ahead of the wall clock never make "blocked" negative.
    assert bs.time_shares(1.5, 0.6, 2.0)["blocked"] == 0.0
    with pytest.raises(ValueError):
        bs.time_shares(1.0, 0.0, 0.0)


def _result(ranks, zero, wall, sched, partition, optim):
    info = [{"rank": r, "zero_stage": zero, "partition_numel": partition, "full_numel": 1_000_000,
             "materialized_numel": partition, "optimizer_numel": optim, "threads": 1} for r in range(ranks)]
    return {"ranks": ranks, "zero_stage": zero, "updates": 2, "wall_s": wall, "tokens": 1000.0, "sched_s": sched,
            "threads": [1] * ranks, "info": info, "peak_kib": [2048] * ranks, "rss_kib": [1024] * ranks}


def test_update_rows_subtract_the_one_rank_blocked_time():
    rows = bs.update_rows([_result(1, 0, 4.0, [(3.0, 0.6)], 10, 10),
                           _result(2, 3, 2.0, [(1.0, 0.2), (0.8, 0.2)], 5, 5)])
    # 1 rank: 75% on CPU, 15% run queue, 10% blocked; 2 ranks: cpu mean(50%, 40%) = 45%, run queue
    # 10%, blocked mean(40%, 50%) = 45%; comm = 45% - the 1-rank 10% = 35%.
    assert rows[0]["blocked"] == pytest.approx(0.10) and rows[0]["comm"] is None
    assert (rows[1]["cpu"], rows[1]["runq"]) == (pytest.approx(0.45), pytest.approx(0.10))
    assert rows[1]["blocked"] == pytest.approx(0.45) and rows[1]["comm"] == pytest.approx(0.35)
    assert rows[1]["s_update"] == pytest.approx(1.0) and rows[1]["tok_s"] == pytest.approx(500.0)
    assert bs.update_rows([_result(2, 0, 2.0, [(1.0, 0.0)] * 2, 5, 5)])[0]["comm"] is None  # no 1-rank baseline
    assert "| 2 | 3 | 1 | 1.000 | 500 | 45% | 10% | 45% | 35% |" in bs.markdown(bs.UPDATE_COLS, rows)


def test_memory_rows_one_per_rank():
    rows = bs.memory_rows([_result(2, 3, 2.0, [(1.0, 0.0)] * 2, 500_000, 500_000)])
    assert [r["rank"] for r in rows] == [0, 1]
    # 4 bytes x (0.5M weights + 2 x 0.5M Adam moments) = 6 MB.
    assert rows[0]["state_mib"] == pytest.approx(6e6 / 2 ** 20) and rows[0]["peak_mib"] == 2.0
    lines = bs.markdown(bs.MEMORY_COLS, rows).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| ranks | zero | rank | params held (M) |")


def test_iteration_rows_split_the_group_time():
    meds = [{"wall_s": 1.0, "response_length/mean": 4.0, "timing_s/update_actor": 0.5},
            {"wall_s": 2.0, "response_length/mean": 4.0, "timing_s/update_actor": 1.0, "timing_s/weight_sync": 0.25,
             "timing_s/agreement": 0.25, "ranks/cpu_s": 0.75, "ranks/runq_s": 0.15}]
    one, two = bs.iteration_rows([1, 2], meds, samples=8)
    assert one["blocked"] is None and one["tok_s"] == pytest.approx(32.0) and one["ratio"] == 1.0
    # group = 1.0 + 0.25 + 0.25 s: 50% on CPU, 10% run queue, 40% blocked.
    assert two["group"] == pytest.approx(1.5) and two["ratio"] == 2.0
    assert (two["cpu"], two["runq"], two["blocked"]) == (pytest.approx(0.5), pytest.approx(0.1), pytest.approx(0.4))
    assert "| 2 | 2.000 |" in bs.markdown(bs.ITERATION_COLS, [one, two])

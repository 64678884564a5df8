"""`benchmarks/bench_update.py`'s argument handling, variants, table rows and process-state probe;
one tiny real update run with and without vLLM (e2e).

    .venv/bin/python -m pytest -q tests/bench/test_bench_update.py
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import bench_update as bu

torch.set_num_threads(1)  # 2 cores shared with other jobs


def test_variants_put_the_base_first_and_cross_dtype_with_vllm():
    assert bu.variants({}, False, False, False) == [({}, False)]
    assert bu.variants({}, False, False, True) == [({}, True)]
    assert bu.variants({"lr": 1e-6}, True, False, False) == [({"lr": 1e-6}, False), ({"lr": 1e-6}, True)]
    assert bu.variants({}, True, True, False) == [({"dtype": "fp32"}, False), ({"dtype": "fp32"}, True),
                                                  ({"dtype": "bf16"}, False), ({"dtype": "bf16"}, True)]
    assert bu.variants({}, True, False, False, unfixed=True) == [({}, False), ({}, True), ({}, "unfixed")]
    assert bu.variant_name({}, False) == "base"
    assert bu.variant_name({}, "unfixed") == "+vllm unfixed"
    assert bu.variant_name({"dtype": "bf16"}, True) == "dtype=bf16 +vllm"


def test_arguments():
    args = bu.parse_args(["--model", "smollm2", "--ranks", "1", "--threads", "2", "--compare-vllm",
                          "--set", "dtype=bf16"])
    assert (args.model, args.ranks_list, args.threads, args.compare_vllm) == ("smollm2", [1], 2, True)
    assert args.overrides_dict == {"dtype": "bf16"}
    assert bu.parse_args(["--with-vllm-unfixed"]).with_vllm_unfixed
    for argv in (["--threads", "0"], ["--prompts", "0"], ["--ranks", "one"], ["--compare-dtype", "--set", "dtype=bf16"],
                 ["--model", "7b"]):
        with pytest.raises(SystemExit):
            bu.parse_args(argv)


def _result(update_s: float, **extra) -> dict:
    return {"world_size": 1, "zero_stage": 0, "timing_s/update_actor": update_s, "timing_s/old_log_prob": 0.0,
            "perf/total_num_tokens": 1000.0, "timing_s/update_actor/forward": 0.25,
            "timing_s/update_actor/backward": 0.5, "timing_s/update_actor/optimizer": 0.01,
            "timing_s/gather": 0.002, **extra}


def test_row_reports_seconds_and_the_ratio_to_the_base_row():
    assert bu.HEADER.splitlines()[0].count("|") == bu.HEADER.splitlines()[1].count("|")
    base = _result(1.0, all_s=[1.5, 0.5])
    row = bu._row("SmolLM2-135M", 134_515_008, _result(2.0, all_s=[3.0, 1.0]), "+vllm", base=base)
    assert row == ("| SmolLM2-135M | 134.52M | +vllm | 1 | 0 | 500 | 500 | 2.00 | 2.00x | 1.00 | 2.00x | 0.00 | 0.25 "
                   "| 0.50 | 0.010 | 2 |")
    assert bu._row("m", 1e6, base).split(" | ")[8:11] == ["1.00x", "0.50", "1.00x"]
    assert row.count("|") == bu.HEADER.splitlines()[0].count("|")


def test_process_state_reports_threads_affinity_and_memory_policy():
    state = bu.process_state()
    assert state["torch_threads"] == torch.get_num_threads()
    assert state["os_threads"] >= 1
    assert ",".join(map(str, sorted(os.sched_getaffinity(0)))) in state["thread_affinities"]
    assert state["mempolicy"] in (-1, 0, 1, 2, 3, 4, 5)
    assert state["set_num_threads"] != "?"


@pytest.mark.e2e
def test_tiny_update_runs_with_and_without_vllm(tmp_path):
    pytest.importorskip("vllm")
    model_dir = str(tmp_path / "m")
    bu._build(model_dir, bu.MODELS["builtin-size (h128 x2)"])
    rows = [bu._launch(model_dir, 1, 1, str(tmp_path / f"r{v}.json"), {}, 1, v) for v in (False, True)]
    assert [r["with_vllm"] for r in rows] == [False, True]
    assert rows[1]["vllm_start_s"] > 0 and rows[0]["vllm_start_s"] == 0
    for r in rows:
        assert r["timing_s/update_actor"] > 0 and r["process_state"]["torch_threads"] == 1


def test_op_shares_sums_self_time_by_kind_and_reports_the_matmul_rate():
    ops = [("aten::mm", 6.0), ("aten::addmm", 1.0), ("aten::_scaled_dot_product_flash_attention_for_cpu", 0.5),
           ("aten::_foreach_addcdiv_", 0.25), ("aten::mul", 2.0), ("aten::copy_", 0.25)]
    shares = bu.op_shares(ops, top=2)
    assert shares["kinds"] == {"matmul": 7.0, "attention": 0.5, "optimizer": 0.25, "other": 2.25}
    assert shares["total_s"] == 10.0 and shares["top"] == [("aten::mm", 6.0), ("aten::mul", 2.0)]
    lines = bu.profile_lines({"profile": shares, "perf/total_num_tokens": 1000.0}, params=1_000_000)
    assert lines[1].split() == ["matmul", "7.00", "s", "70.0", "%"]
    assert "run at 1 GFLOP/s" in lines[-2]  # 6 x 1e6 x 1000 / 7.0 s / 1e9 = 0.86
    assert bu.parse_args(["--profile"]).profile

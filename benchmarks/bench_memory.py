"""Resident memory of the policy update: before, peak during and at rest after each phase.

    python -m benchmarks.bench_memory --model builtin                      # seconds: the tiny model
    python -m benchmarks.bench_memory --model smollm2 --prompts 8 --tokens 128 --updates 5
    python -m benchmarks.bench_memory --model smollm2 --prompts 16 --tokens 128 --updates 20 --sync
    make bench-memory ARGS="--model smollm2 --prompts 16 --updates 20"

Builds what the update stage uses (gpu_jobs.stages.roles.Roles.load_trainers): a PolicyTrainer
with the actor settings of examples/grpo_gsm_smollm2.yaml (lr 1e-6, one mini-batch of all
prompts, token-budget micro-batches of 8192 packed tokens, old log-probs from the rollout,
temperature 0.8), and with ``--kl`` a RefModel whose log-prob pass runs before each update
(kl_loss on). It feeds it synthetic rollout batches: ``--prompts`` x ``--samples`` rows,
prompts of 50-150% of ``--prompt-tokens`` tokens, responses of exactly ``--tokens`` tokens
(TRL's forced length), GRPO-like advantages; ``--sync`` also copies the weights into an hf
rollout engine after each update, as the run does. ``--set KEY=VALUE`` overrides an ActorConfig
field (YAML value).

Memory is the process's resident set (VmRSS). "peak" is VmHWM after resetting it through
/proc/self/clear_refs ("5") when the phase starts: the kernel's own high-water mark, so no
sampling interval can miss a spike. "rest" is VmRSS after the iteration, once Python's garbage
is collected. Run one configuration per process: what an allocator keeps is the point, so the
numbers of a process that ran something else first are not comparable. Allocator settings go on
the command line (MALLOC_ARENA_MAX=2, LD_PRELOAD=...libtcmalloc_minimal.so.4).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

MB = 1 << 20
LOG: list[dict] = []  # one entry per finished phase; printed by the guard if it stops the run


def rss_bytes(field: str = "VmRSS") -> int:
    """``field`` of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Make VmHWM start again from the current VmRSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Phase:
    """``with Phase(name, log, iteration): ...`` appends {phase, iteration, before, peak, after,
    seconds} (bytes) to ``log``."""

    current = "start"

    def __init__(self, name: str, log: list[dict], iteration: int | None = None):
        self.name, self.log, self.iteration = name, log, iteration

    def __enter__(self) -> "Phase":
        Phase.current = f"{self.name} (iteration {self.iteration})" if self.iteration else self.name
        self.before = rss_bytes()
        reset_peak()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        entry = {} if self.iteration is None else {"iteration": self.iteration}
        self.log.append({**entry, "phase": self.name, "before": self.before, "peak": rss_bytes("VmHWM"),
                         "after": rss_bytes(), "seconds": time.perf_counter() - self.t0})


def guard(limit_bytes: int, every_s: float = 0.01) -> None:
    """Exit the process (status 3) as soon as VmRSS passes ``limit_bytes``: on a machine without
    swap the kernel's OOM killer would otherwise pick a victim, maybe another user's process."""
    import threading

    def watch() -> None:
        while True:
            rss = rss_bytes()
            if rss > limit_bytes:
                done = "".join(f"\n  {p.get('iteration', '')} {p['phase']}: peak {p['peak'] / MB:.0f} MB, "
                               f"rest {p.get('rest', p['after']) / MB:.0f} MB" for p in LOG)
                print(f"bench_memory: resident memory {rss / MB:.0f} MB passed --max-rss-gb in phase "
                      f"{Phase.current}; stopping. Phases done:{done}", file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(every_s)

    threading.Thread(target=watch, daemon=True).start()


def synthetic_batch(vocab: int, prompts: int, samples: int, tokens: int, prompt_tokens: int, seed: int = 0):
    """A rollout table: ``prompts`` x ``samples`` rows (group_id, prompt_ids, response_ids of
    exactly ``tokens``, per-token advantages with zero mean per group, rollout_logprobs)."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    rows = []
    for g in range(prompts):
        plen = int(rng.integers(max(1, prompt_tokens // 2), prompt_tokens * 3 // 2 + 1))
        prompt = rng.integers(3, vocab, plen).tolist()
        scores = rng.normal(size=samples)
        adv = (scores - scores.mean()) / (scores.std() + 1e-6)
        for s in range(samples):
            rows.append({"uid": f"{g}-{s}", "group_id": str(g), "prompt_ids": prompt,
                         "response_ids": rng.integers(3, vocab, tokens).tolist(),
                         "advantages": [float(adv[s])] * tokens,
                         # -log(vocab) is a uniform guess: ratios far from 1, clipped; the memory the
                         # loss needs does not depend on them. Replaced by real ones below.
                         "rollout_logprobs": [-float(np.log(vocab))] * tokens})
    return pa.Table.from_pylist(rows)


def _with_column(table, name: str, values):
    import pyarrow as pa

    col = pa.array([v.tolist() for v in values], type=pa.list_(pa.float32()))
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, col)
    return table.append_column(name, col)


def actor_config(args, overrides: dict):
    from gpu_jobs.train import ActorConfig

    fields = {"lr": 1e-6, "ppo_mini_batch_size": args.prompts, "use_dynamic_bsz": True,
              "ppo_max_token_len_per_gpu": 8192, "recompute_old_logprobs": False, "temperature": 0.8}
    if args.kl:
        fields["kl_loss"] = {"use_kl_loss": True}
    return ActorConfig(**{**fields, **overrides})


def run(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    log = LOG
    if args.no_trim:  # the trainer before it gave freed pages back (gpu_jobs/train/memory.py)
        import gpu_jobs.train.memory as memory

        memory._glibc = lambda: None
    with Phase("import+build", log):
        from gpu_jobs.train import PolicyTrainer, RefModel

        cfg = actor_config(args, args.overrides)
        trainer = PolicyTrainer(args.model, cfg)
        ref = RefModel(args.model, cfg) if args.kl else None
        rollout = None
        if args.sync:
            from gpu_jobs.rollout.data_parallel import build_rollout_engine

            rollout = build_rollout_engine("hf", trainer.model_path)
    batch = synthetic_batch(trainer.model_config.vocab_size, args.prompts, args.samples, args.tokens,
                            args.prompt_tokens, seed=args.seed)
    with Phase("rollout_logprobs", log):  # what the rollout engine would have recorded
        batch = _with_column(batch, "rollout_logprobs", trainer.compute_log_probs(batch))
    gc.collect()
    log[-1]["rest"] = rss_bytes()
    params = sum(p.numel() for p in trainer.engine.module.parameters())
    for it in range(1, args.updates + 1):
        if ref is not None:
            with Phase("ref_logprobs", log, it):
                batch = _with_column(batch, "ref_logprobs", ref.compute_log_probs(batch))
        with Phase("update", log, it):
            metrics = trainer.update(batch)
        if rollout is not None:
            with Phase("sync", log, it):
                from gpu_jobs.train.weights import stream_weights_into_rollout

                stream_weights_into_rollout(rollout, trainer)
        gc.collect()
        log[-1]["rest"] = rss_bytes()
        log[-1]["pg_loss"] = metrics.get("actor/pg_loss")
    return {"args": {k: v for k, v in vars(args).items()}, "params": params, "phases": log,
            "resolved_zero_stage": trainer.zero_stage,
            "env": {k: os.environ[k] for k in ("MALLOC_ARENA_MAX", "LD_PRELOAD", "MALLOC_TRIM_THRESHOLD_")
                    if k in os.environ}}


def table(result: dict) -> str:
    a = result["args"]
    lines = [f"model={a['model']} ({result['params'] / 1e6:.1f}M params, ZeRO-{result['resolved_zero_stage']}) "
             f"batch={a['prompts']}x{a['samples']}x{a['tokens']} (prompts ~{a['prompt_tokens']} tokens) "
             f"overrides={a['overrides']} env={result['env']}",
             f"{'iter':>4} {'phase':<16} {'before MB':>10} {'peak MB':>9} {'after MB':>9} {'rest MB':>9} {'s':>7}"]
    for p in result["phases"]:
        rest = f"{p['rest'] / MB:9.0f}" if "rest" in p else f"{'':9}"
        lines.append(f"{p.get('iteration', ''):>4} {p['phase']:<16} {p['before'] / MB:10.0f} {p['peak'] / MB:9.0f} "
                     f"{p['after'] / MB:9.0f} {rest} {p['seconds']:7.1f}")
    iters = [p for p in result["phases"] if "iteration" in p]
    rests = [p["rest"] for p in iters if "rest" in p]
    peak = max(p["peak"] for p in result["phases"])
    lines.append(f"max peak {peak / MB:.0f} MB; at rest after iteration 1: {rests[0] / MB:.0f} MB, "
                 f"2: {rests[min(1, len(rests) - 1)] / MB:.0f} MB, last: {rests[-1] / MB:.0f} MB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import yaml

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin", help="builtin, smollm2 or a model folder")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="response tokens per row (forced length)")
    ap.add_argument("--prompt-tokens", type=int, default=100, help="mean prompt length (SmolLM2 gsm prompts: ~100)")
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--kl", action="store_true", help="a reference model and the KL loss")
    ap.add_argument("--sync", action="store_true", help="copy the weights into an hf rollout engine after each update")
    ap.add_argument("--no-trim", action="store_true", help="never malloc_trim (how the trainer was before)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an ActorConfig field")
    ap.add_argument("--max-rss-gb", type=float, default=0, help="stop the run past this resident size (0: never)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    if args.max_rss_gb:
        guard(int(args.max_rss_gb * (1 << 30)))
    args.overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    result = run(args)
    print(table(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

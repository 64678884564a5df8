"""Rollout throughput: generated tokens/s of the hf and vllm backends vs `model.generate`.

    python -m benchmarks.bench_rollout                 # full table (a few minutes on 2 cores)
    python -m benchmarks.bench_rollout --repeats 1 --prompts 16 --tokens 32   # quick look
    python -m benchmarks.bench_rollout --model smollm2 --grid 8x4,16x4,32x4 --tokens 32,64,128

Workload per measurement: `--grid` prompts x samples (default 64x4, `--prompts`/`--samples`)
times `--tokens` (one or more lengths, default 128), temperature 1, EOS ignored (`ignore_eos`
in the roles, `min_new_tokens` for generate) so every backend generates the same number of
tokens. Models (`--model`, comma-separated): `builtin` (the tiny ~0.5M model), `16m` (a
random-init ~16M Qwen2 over the same tokenizer), `smollm2` (SmolLM2-135M-Instruct, converted by
`make smollm2`); default builtin,16m. Prompts: arithmetic questions in the model's own
tokenizer (through its chat template when it has one). Each (model, backend) runs in its own
subprocess (one vLLM engine per process; no state leaks between backends), does one small untimed
warm-up call, then measures every grid cell: the median of `--repeats` timed calls. Columns:
tokens/s per backend and the ratios hf/generate, vllm/generate and vllm/hf, all from the same
run. Results go to stdout and bench-results/rollout.json.
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

BACKENDS = ("generate", "hf", "vllm")
MODELS = ("builtin", "16m", "smollm2")


def make_16m_model(folder: str) -> str:
    """Save a random-init ~16M-parameter Qwen2 (hidden 512, 4 layers) with the char tokenizer."""
    from gpu_jobs.models import build_tiny_model

    if not (Path(folder) / "config.json").exists():
        model, tok = build_tiny_model(seed=0, hidden_size=512, num_layers=4, num_heads=8,
                                      num_kv_heads=2, intermediate_size=2048)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


def parse_grid(grid: str | None, prompts: int, samples: int) -> list[tuple[int, int]]:
    """'8x4,16x4' -> [(8, 4), (16, 4)]; None -> [(prompts, samples)]."""
    if not grid:
        return [(prompts, samples)]
    cells = []
    for item in grid.split(","):
        try:
            p, s = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"--grid cell {item!r} is not PROMPTSxSAMPLES (e.g. 16x4)") from None
        if p < 1 or s < 1:
            raise ValueError(f"--grid cell {item!r} needs positive counts")
        cells.append((p, s))
    return cells


def parse_lengths(tokens: str) -> list[int]:
    """'32,64' -> [32, 64]."""
    lengths = [int(x) for x in str(tokens).split(",")]
    if any(n < 1 for n in lengths):
        raise ValueError(f"--tokens {tokens!r}: lengths must be >= 1")
    return lengths


def _prompts(n: int, tok=None):
    """n arithmetic questions as token ids in `tok` (the built-in character tokenizer when None),
    through its chat template when it has one, as rlmill renders prompts."""
    from gpu_jobs.models import arith_problems, build_tokenizer

    problems = [p for p, _ in arith_problems(n, seed=1)]
    if tok is None or not getattr(tok, "chat_template", None):
        tok = tok or build_tokenizer()
        return [tok(p, add_special_tokens=False)["input_ids"] for p in problems]
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                    tokenize=True, return_dict=True)["input_ids"] for p in problems]


def _runner(backend: str, path: str, dtype: str = "float32"):
    """(a function (prompts, samples, tokens) -> number of generated tokens, the model's tokenizer)."""
    import torch

    from gpu_jobs.rollout import HFRolloutEngine, RolloutEngineConfig, SamplingConfig, get_rollout_engine

    def sampling(tokens):
        return SamplingConfig(temperature=1.0, max_response_length=tokens, seed=0, ignore_eos=True)

    if backend == "vllm":
        from transformers import AutoTokenizer

        engine = get_rollout_engine("vllm", path, RolloutEngineConfig(dtype=dtype))
        tok = AutoTokenizer.from_pretrained(path)
    else:
        from gpu_jobs.models import load_model

        model, tok = load_model(path, dtype=dtype)
    if backend == "hf":
        engine = HFRolloutEngine(model, tok, RolloutEngineConfig(max_batch_size=4096, dtype=dtype))  # one batch, like generate
    if backend in ("vllm", "hf"):
        return (lambda prompts, samples, tokens:
                sum(len(r["response_ids"]) for r in engine.generate(prompts, samples, sampling(tokens)))), tok

    def generate(prompts, samples, tokens):
        width = max(map(len, prompts))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, num_return_sequences=samples, max_new_tokens=tokens,
                                 min_new_tokens=tokens, pad_token_id=pad)
        return (out.shape[1] - width) * out.shape[0]

    return generate, tok


def measure_all(backend: str, path: str, cells: list[tuple[int, int, int]], repeats: int,
                dtype: str = "float32") -> list[dict]:
    """Median tokens/s of `repeats` timed calls per (prompts, samples, tokens) cell, after one
    small warm-up call; one model load for all cells."""
    run, tok = _runner(backend, path, dtype)
    prompts = _prompts(max(c[0] for c in cells), tok)
    run(prompts[:2], 2, 8)
    out = []
    for n_prompts, samples, tokens in cells:
        rates, counts = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            n = run(prompts[:n_prompts], samples, tokens)
            rates.append(n / (time.perf_counter() - t0))
            counts.append(n)
        out.append({"prompts": n_prompts, "samples": samples, "max_tokens": tokens,
                    "tokens_per_s": statistics.median(rates), "best_tokens_per_s": max(rates),
                    "tokens": counts[0], "all": rates})
    return out


def _cells_arg(cells) -> str:
    return ",".join(f"{p}x{s}x{t}" for p, s, t in cells)


def _parse_cells_arg(s: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in c.split("x")) for c in s.split(",")]


def _cell(backend: str, path: str, cells, args, dtype: str = "float32") -> list[dict] | dict:
    """Run one backend on one model in a fresh interpreter and parse its JSON line."""
    cmd = [sys.executable, "-m", "benchmarks.bench_rollout", "--cell", backend, path,
           "--cells", _cells_arg(cells), "--repeats", str(args.repeats), "--dtype", dtype]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout)[-400:]}
    return json.loads(lines[-1][len("RESULT "):])


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def table(results: dict, stat: str = "median") -> str:
    """Markdown table, one row per (model, grid cell): tokens/s per backend and the ratios
    hf/generate, vllm/generate, vllm/hf (all measured in the same run). `stat`: "median" of the
    repeats, or "best" (the fastest: on shared cores, other work only slows a call down)."""
    field = {"median": "tokens_per_s", "best": "best_tokens_per_s"}[stat]
    out = [f"| model | prompts x samples | max tokens | generate tok/s ({stat}) | hf tok/s | vllm tok/s | hf/generate "
           "| vllm/generate | vllm/hf |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model, per_backend in results.items():
        keys, by = [], {}
        for backend in BACKENDS:
            cells = per_backend.get(backend)
            if isinstance(cells, dict):  # the subprocess failed
                out.append(f"| {model} | {backend} failed: {cells.get('error', '?')[-80:]!r} | | | | | | | |")
                continue
            for c in cells or []:
                key = (c["prompts"], c["samples"], c["max_tokens"])
                if key not in by:
                    keys.append(key)
                by.setdefault(key, {})[backend] = c.get(field, c["tokens_per_s"])
        for key in keys:
            r = by[key]
            g, h, v = r.get("generate"), r.get("hf"), r.get("vllm")
            fmt = lambda x: f"{x:.0f}" if x else "-"  # noqa: E731
            out.append(f"| {model} | {key[0]}x{key[1]} | {key[2]} | {fmt(g)} | {fmt(h)} | {fmt(v)} | "
                       f"{_ratio(h, g)} | {_ratio(v, g)} | {_ratio(v, h)} |")
    return "\n".join(out)


def model_path(name: str) -> str:
    if name == "builtin":
        from gpu_jobs.models import ensure_builtin_model

        return ensure_builtin_model()
    if name == "16m":
        return make_16m_model(os.path.join(tempfile.gettempdir(), "rlmill-bench-16m"))
    if name == "smollm2":
        from gpu_jobs.models import ensure_smollm2

        return ensure_smollm2()
    raise ValueError(f"unknown --model {name!r}; choose from {', '.join(MODELS)}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin,16m", help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--grid", default=None, help="comma-separated PROMPTSxSAMPLES cells (default: --prompts x --samples)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tokens", default="128", help="generated tokens per sample; comma-separated for several")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset of " + ",".join(BACKENDS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stat", choices=("median", "best"), default="median",
                   help="the table's figure per cell: median of the repeats, or the fastest (shared cores)")
    p.add_argument("--dtype", default="float32",
                   help="float32, bfloat16 or both comma-separated (rows per dtype; vs-generate ratios within one dtype)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--cell", nargs=2, metavar=("BACKEND", "MODEL_PATH"), help=argparse.SUPPRESS)
    p.add_argument("--cells", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.cell:
        for name in args.model.split(","):
            if name not in MODELS:
                p.error(f"unknown --model {name!r}; choose from {', '.join(MODELS)}")
        bad_dtypes = set(args.dtype.split(",")) - {"float32", "bfloat16"}
        if bad_dtypes:
            p.error(f"unknown --dtype {sorted(bad_dtypes)}; choose from float32, bfloat16")
        bad = set(args.backends.split(",")) - set(BACKENDS)
        if bad:
            p.error(f"unknown --backends {sorted(bad)}; choose from {', '.join(BACKENDS)}")
        try:
            args.cells_list = [(pp, s, t) for t in parse_lengths(args.tokens)
                               for pp, s in parse_grid(args.grid, args.prompts, args.samples)]
        except ValueError as e:
            p.error(str(e))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.cell:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        res = measure_all(args.cell[0], args.cell[1], _parse_cells_arg(args.cells), args.repeats, args.dtype)
        print("RESULT " + json.dumps(res), flush=True)
        return
    results: dict = {}
    t0 = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load0 = os.getloadavg()
    dtypes = args.dtype.split(",")
    for name in args.model.split(","):
        path = model_path(name)
        for dtype in dtypes:
            key = name if dtypes == ["float32"] else f"{name} {dtype}"
            for backend in args.backends.split(","):
                results.setdefault(key, {})[backend] = _cell(backend, path, args.cells_list, args, dtype)
                print(f"{key:10s} {backend:9s} {results[key][backend]}", file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    print(f"\nstarted {t0}; load average {load0[0]:.2f} at start, {load1[0]:.2f} at end; "
          f"{args.stat} of {args.repeats}; temperature 1, EOS ignored\n")
    print(table(results, args.stat))
    Path("bench-results").mkdir(exist_ok=True)
    Path("bench-results/rollout.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items() if k != "cells_list"}, "started": t0,
         "loadavg": [load0, load1], "results": results}, indent=2))


if __name__ == "__main__":
    main()

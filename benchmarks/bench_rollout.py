"""Rollout throughput: generated tokens/s of the hf and vllm backends vs `model.generate`.

    python -m benchmarks.bench_rollout                 # full table (a few minutes on 2 cores)
    python -m benchmarks.bench_rollout --repeats 1 --prompts 16 --tokens 32   # quick look

Workload per measurement: 64 prompts x 4 samples x 128 tokens, temperature 1, EOS ignored
(`ignore_eos` in the roles, `min_new_tokens` for generate) so every backend generates the
same number of tokens. Models: the built-in tiny model (~0.5M) and a random-init ~16M Qwen2
over the same tokenizer. Each (model, backend) cell runs in its own subprocess (one vLLM engine
per process; no state leaks between cells), does one small untimed warm-up call, then reports
the median of `--repeats` timed calls. Results go to stdout and bench-results/rollout.json.
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


def make_16m_model(folder: str) -> str:
    """Save a random-init ~16M-parameter Qwen2 (hidden 512, 4 layers) with the char tokenizer."""
    from gpu_jobs.models import build_tiny_model

    if not (Path(folder) / "config.json").exists():
        model, tok = build_tiny_model(seed=0, hidden_size=512, num_layers=4, num_heads=8,
                                      num_kv_heads=2, intermediate_size=2048)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


def _prompts(n: int):
    from gpu_jobs.models import arith_problems, build_tokenizer

    tok = build_tokenizer()
    return [tok(p, add_special_tokens=False)["input_ids"] for p, _ in arith_problems(n, seed=1)]


def _runner(backend: str, path: str, samples: int, tokens: int):
    """A function prompts -> number of generated tokens, for one backend on one model."""
    import torch

    from gpu_jobs.rollout import HFRolloutEngine, RolloutEngineConfig, SamplingConfig, get_rollout_engine

    sampling = SamplingConfig(temperature=1.0, max_response_length=tokens, seed=0, ignore_eos=True)
    if backend == "vllm":
        engine = get_rollout_engine("vllm", path, RolloutEngineConfig())
        return lambda prompts: sum(len(r["response_ids"]) for r in engine.generate(prompts, samples, sampling))
    from gpu_jobs.models import load_model

    model, tok = load_model(path)
    if backend == "hf":
        engine = HFRolloutEngine(model, tok, RolloutEngineConfig(max_batch_size=4096))  # one batch, like generate
        return lambda prompts: sum(len(r["response_ids"]) for r in engine.generate(prompts, samples, sampling))

    def generate(prompts):
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = (ids != tok.pad_token_id).long()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, num_return_sequences=samples, max_new_tokens=tokens,
                                 min_new_tokens=tokens, pad_token_id=tok.pad_token_id)
        return (out.shape[1] - width) * out.shape[0]

    return generate


def measure(backend: str, path: str, n_prompts: int, samples: int, tokens: int, repeats: int) -> dict:
    """Median tokens/s of `repeats` timed calls (after one small warm-up call)."""
    run = _runner(backend, path, samples, tokens)
    prompts = _prompts(n_prompts)
    run(prompts[:4])
    rates, counts = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = run(prompts)
        rates.append(n / (time.perf_counter() - t0))
        counts.append(n)
    return {"tokens_per_s": statistics.median(rates), "tokens": counts[0], "all": rates}


def _cell(backend: str, path: str, args) -> dict:
    """Run one measurement in a fresh interpreter and parse its JSON line."""
    cmd = [sys.executable, "-m", "benchmarks.bench_rollout", "--cell", backend, path,
           "--prompts", str(args.prompts), "--samples", str(args.samples),
           "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout)[-400:]}
    return json.loads(lines[-1][len("RESULT "):])


def table(results: dict) -> str:
    """Markdown table: tokens/s per backend and ratios vs model.generate."""
    out = ["| model | backend | tokens/s (median) | vs generate |", "|---|---|---:|---:|"]
    for model, cells in results.items():
        base = cells.get("generate", {}).get("tokens_per_s")
        for backend in BACKENDS:
            c = cells.get(backend, {})
            if "tokens_per_s" not in c:
                out.append(f"| {model} | {backend} | failed: {c.get('error', '?')[-80:]!r} | |")
                continue
            ratio = f"{c['tokens_per_s'] / base:.2f}x" if base else "n/a"
            out.append(f"| {model} | {backend} | {c['tokens_per_s']:.0f} | {ratio} |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--cell", nargs=2, metavar=("BACKEND", "MODEL_PATH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cell:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        res = measure(args.cell[0], args.cell[1], args.prompts, args.samples, args.tokens, args.repeats)
        print("RESULT " + json.dumps(res), flush=True)
        return
    from gpu_jobs.models import ensure_builtin_model

    models = {"builtin (0.5M)": ensure_builtin_model(),
              "qwen2-16M (random)": make_16m_model(os.path.join(tempfile.gettempdir(), "rlmill-bench-16m"))}
    results: dict = {}
    for name, path in models.items():
        for backend in BACKENDS:
            results.setdefault(name, {})[backend] = _cell(backend, path, args)
            print(f"{name:20s} {backend:9s} {results[name][backend]}", flush=True)
    print(f"\n{args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, "
          f"median of {args.repeats}\n")
    print(table(results))
    Path("bench-results").mkdir(exist_ok=True)
    Path("bench-results/rollout.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()

"""bench_e2e's shared held-out evaluation on plain vLLM: each saved policy's greedy answers to the
held-out prompts, scored by the task's rule, by neither side's generation code.

    .venv/bin/python -m benchmarks.heldout_eval SPEC.json      # what `evaluate_folders` runs

It gives the score of `bench_e2e_report.greedy_accuracy` (transformers `generate`; greedy vLLM
answers equal transformers' on the same weights, tests/bench/test_bench_e2e.py checks it) in a
third of the time on SmolLM2 (200 prompts, <= 64 tokens, 2 cores: 30 s against 92 s, engine
start included), which is what makes a per-step curve over seeds affordable (--eval-every).

A fresh interpreter per call: vLLM runs in-process (one engine per folder, each started from the
folder itself, so a checkpoint written without its tied output head still loads whole), and the
bench's worker process keeps its own engine and memory.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ENGINES = ("vllm", "hf")  # --eval-engine: plain vLLM (this module) or transformers `generate`


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def evaluate_folders(folders: dict, problems, max_new_tokens: int, task: str, tokenizer: str,
                     threads: int = 2) -> dict:
    """{key: greedy score of folders[key] on `problems` ((prompt text, truth) pairs)} with the
    scoring rule of bench task `task`, computed in a fresh interpreter. `tokenizer`: the folder of
    the tokenizer all of them share (a policy saved mid-run may be weights and config only)."""
    if not folders:
        return {}
    with tempfile.TemporaryDirectory(prefix="heldout-eval-") as tmp:
        spec, result = Path(tmp, "spec.json"), Path(tmp, "result.json")
        keys = list(folders)
        spec.write_text(json.dumps({"folders": [str(folders[k]) for k in keys], "problems": [list(p) for p in problems],
                                    "max_new_tokens": max_new_tokens, "task": task, "tokenizer": tokenizer, "threads": threads,
                                    "result": str(result)}))
        repo = Path(__file__).resolve().parent.parent
        done = subprocess.run([sys.executable, "-m", "benchmarks.heldout_eval", str(spec)], cwd=repo,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the held-out evaluation failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        scores = json.loads(result.read_text())
    return dict(zip(keys, scores))


def greedy_scores(folders: list[str], tokenizer: str, problems, max_new_tokens: int, score) -> list[float]:
    """The mean `score`(greedy answer, truth) of each folder, one in-process vLLM engine at a time;
    `tokenizer` is the folder of their shared tokenizer."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from gpu_jobs.rollout.vllm_engine import cpu_engine_options

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, detokenize=False)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    # The prompt text is already the chat template's output: no special tokens added, as in greedy_accuracy.
    prompts = [TokensPrompt(prompt_token_ids=tok(p, add_special_tokens=False)["input_ids"]) for p, _ in problems]
    scores = []
    for folder in folders:
        llm = LLM(model=folder, tokenizer=tokenizer, dtype="float32", seed=0, enforce_eager=True,
                  gpu_memory_utilization=0.5, kv_cache_memory_bytes=1 << 30, **cpu_engine_options())
        outs = llm.generate(prompts, params, use_tqdm=False)
        texts = [tok.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs]
        scores.append(sum(score(t, truth) for t, (_, truth) in zip(texts, problems)) / len(problems))
        del llm, outs
        gc.collect()
    return scores


def main(spec_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: seconds to start, not tens
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    from benchmarks.bench_e2e_long import task_score

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    problems = [tuple(p) for p in spec["problems"]]
    scores = greedy_scores(spec["folders"], spec["tokenizer"], problems, spec["max_new_tokens"], task_score(spec["task"]))
    Path(spec["result"]).write_text(json.dumps(scores))


if __name__ == "__main__":
    main(sys.argv[1])

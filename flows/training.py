"""The RL run as Prefect flows: `rl_training` (one run) with one `rl_iteration` subflow per iteration.

    python -m flows.cli train --config examples/grpo_arith.yaml rollout.n=8
    prefect deployment run 'rl-training/manual' -p iterations=3

A run can be killed at any point and started again with the same run_id: stages that committed
are not recomputed, the trainer is restored from the last checkpoint plus the committed updates
after it, and the final weights equal those of an uninterrupted run.
"""

from __future__ import annotations

import logging
import time
import warnings
from contextlib import contextmanager
from typing import Any

from prefect import flow, get_run_logger, tags

from flows.config import RunConfig, frozen_config, load_run_config
from flows.reporting import (MetricLoggers, Progress, curves_png, final_artifact, iteration_artifacts,
                             local_tb_dir)
from flows.remote import run_remote
from flows.run_lock import RunLock
from gpu_jobs.stages import RunContext, last_committed
from gpu_jobs.stages.iteration import optional_stages, probe_agreement
from storage import committed, join, read_manifest, read_table
from tasks import stages as T
from tasks.context import attach, context_for, detach

log = logging.getLogger("rlmill")
# DeepSpeed calls torch.distributed APIs that torch 2.13 deprecates, once per parameter per step.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")


def _with_task_options(cfg: RunConfig) -> dict[str, Any]:
    return {"retries": cfg.tasks.retries, "retry_delay_seconds": cfg.tasks.retry_delay_seconds,
            "timeout_seconds": cfg.tasks.timeout_seconds}


def _run_iteration(key: str, k: int) -> dict[str, Any]:
    """The iteration's subflow run, without its own heartbeat thread.

    Prefect joins a flow run's heartbeat thread on exit, and that thread sleeps in 1-second steps:
    ~0.9 s per subflow of pure waiting (1.2 s -> 0.33 s per subflow run measured here). The parent
    rl-training run keeps its heartbeat, which is what detects a crashed process; a subflow lives
    only inside it.
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        return rl_iteration.with_options(flow_run_name=f"iter-{k:04d}")(key, k)


def _samples(ctx: RunContext, batch_uri: str, reward_uri: str, n: int) -> list[dict]:
    """The first response to each of the first `n` prompts, for the iteration's markdown artifact."""
    if n <= 0:
        return []
    batch = read_table(batch_uri, columns=["uid", "sample_index", "prompt_ids", "ground_truth"],
                       storage=ctx.storage).to_pylist()
    rewards = {r["uid"]: r for r in read_table(reward_uri, columns=["uid", "response_text", "score"],
                                               storage=ctx.storage).to_pylist()}
    firsts = [row for row in batch if row["sample_index"] == 0][:n]
    return [{"prompt": ctx.tokenizer.decode(row["prompt_ids"], skip_special_tokens=True),
             "response": rewards[row["uid"]]["response_text"], "truth": row["ground_truth"],
             "score": rewards[row["uid"]]["score"]} for row in firsts]


@flow(name="rl-iteration", log_prints=True)
def rl_iteration(key: str, k: int) -> dict[str, Any]:
    """One RL iteration: rollout -> gate -> {reward, log-probs, values} -> advantages -> update
    -> weight sync -> commit. Returns the iteration's merged metrics."""
    with _untagged_tasks():
        return _iteration(key, k)


@contextmanager
def _untagged_tasks():
    """Task runs created inside carry no tags. Prefect acquires a concurrency slot per tag of a
    task run (an API round trip each, ~40 ms); the flow runs keep the `rlmill`/`run:<id>` tags,
    which is what the UI filters on."""
    from prefect.context import TagsContext

    with TagsContext(current_tags=set()):
        yield


def _iteration(key: str, k: int) -> dict[str, Any]:
    ctx = context_for(key)
    opts = _with_task_options(ctx.cfg)
    t = {name: task.with_options(**opts) for name, task in T.STAGE_TASKS.items()}
    remote = ctx.cfg.trainer.placement == "remote"
    rollout_uri = run_remote(ctx, k, "rollout") if remote else t["rollout"](key, k)
    need = optional_stages(ctx.cfg)  # a task run costs ~25 ms of API calls even when it does nothing
    baseline_uri = t["baseline"](key, k, rollout_uri) if need["baseline"] else None  # ReMax only
    batch_uri = t["gate"](key, k, rollout_uri)
    # Scoring and log-prob/value passes are independent: run them concurrently.
    futures = {name: t[name].submit(key, k, batch_uri) for name in ("logprobs", "values") if need[name]}
    reward_uri = t["reward"](key, k, batch_uri)
    logprobs_uri, values_uri = (futures[n].result() if n in futures else None for n in ("logprobs", "values"))
    adv_uri = t["advantages"](key, k, batch_uri, reward_uri, logprobs_uri, values_uri, baseline_uri)
    if remote:  # the next rollout loads checkpoint k, which the remote update committed
        update_uri, sync_s = run_remote(ctx, k, "update", [adv_uri]), 0.0
    else:
        update_uri = t["update"](key, k, adv_uri)
        sync_s = t["weight-sync"](key, k)
    uris = {"rollout": rollout_uri, "baseline": baseline_uri, "gate": batch_uri, "reward": reward_uri,
            "logprobs": logprobs_uri, "values": values_uri, "advantages": adv_uri, "update": update_uri}
    commit_uri = t["commit"](key, k, uris, {"timing_s/weight_sync": sync_s})
    metrics = read_manifest(commit_uri, ctx.storage).metrics
    iteration_artifacts(ctx.cfg.run_id, k, metrics,
                        _samples(ctx, batch_uri, reward_uri, ctx.cfg.trainer.samples_in_artifact))
    return metrics


def _validate(ctx: RunContext, key: str, k: int) -> float:
    if ctx.cfg.trainer.placement == "remote":
        uri = run_remote(ctx, k, "validate")
    else:
        ref = ctx.layout.stage(k, "update") if k else ctx.model_path
        with _untagged_tasks():
            uri = T.validate.with_options(**_with_task_options(ctx.cfg))(key, k, ref)
    return float(read_manifest(uri, ctx.storage).metrics["val/acc"])


def _val_due(cfg: RunConfig, k: int) -> bool:
    every = cfg.trainer.val_every
    return k == cfg.trainer.total_iterations or (every > 0 and k % every == 0)


def _history(ctx: RunContext, upto: int) -> tuple[list, list]:
    hist, val = [], []
    for k in range(0, upto + 1):
        if k and (uri := committed(ctx.layout.stage(k, "commit"), ctx.storage)):
            hist.append((k, read_manifest(uri, ctx.storage).metrics))
        if uri := committed(ctx.layout.stage(k, "validate"), ctx.storage):
            val.append((k, read_manifest(uri, ctx.storage).metrics["val/acc"]))
    return hist, val


@flow(name="rl-training", log_prints=True)
def rl_training(config: str | None = None, overrides: list[str] | None = None,
                iterations: int | None = None, run_id: str | None = None) -> dict[str, Any]:
    """A whole RL run. `config` is a YAML file, `overrides` verl-style `key=value` strings;
    `iterations` and `run_id` are shortcuts for trainer.total_iterations and run_id."""
    extra = list(overrides or [])
    extra += [f"trainer.total_iterations={iterations}"] if iterations else []
    extra += [f"run_id={run_id}"] if run_id else []
    cfg = load_run_config(config, extra)
    logger = get_run_logger()
    with RunLock(cfg.root, cfg.run_id), tags("rlmill", f"run:{cfg.run_id}"):
        return _train(cfg, logger)


def _train(cfg: RunConfig, logger) -> dict[str, Any]:
    t_setup = time.perf_counter()
    ctx = RunContext.open(cfg)
    if cfg.trainer.placement == "colocated":  # remote: this process never loads a model
        ctx.warm()
        ctx.restore()
        probe = probe_agreement(ctx, f"run start (weights after iteration {ctx.trainer_k})")
        logger.info("trainer/rollout agreement at start: mean |dp| %.2g, max |dlogp| %.2g nats",
                    probe.get("training/rollout_probs_diff_mean", 0.0), probe.get("training/rollout_logprobs_diff_max", 0.0))
    key = attach(ctx)
    total = cfg.trainer.total_iterations
    done = last_committed(ctx.layout, "commit", total)
    logger.info("run %s: %d/%d iterations committed; model %s; setup %.1fs", cfg.run_id, done, total,
                ctx.model_path, time.perf_counter() - t_setup)
    tb = MetricLoggers(cfg.run_id, local_tb_dir(cfg.root, cfg.run_id) if cfg.trainer.tensorboard else None,
                       cfg.trainer.loggers, frozen_config(cfg))
    try:
        acc_before = _validate(ctx, key, 0)
        progress = Progress(cfg.run_id, total, done)
        t_train, val_s, val_curve = time.perf_counter(), 0.0, [(0, 0.0, acc_before)]
        for k in range(done + 1, total + 1):
            metrics = _run_iteration(key, k)
            if _val_due(cfg, k):
                # Training time excludes validation itself: it is what a user waits for per gain.
                t_val = time.perf_counter()
                elapsed = t_val - t_train - val_s
                metrics["val/acc"] = _validate(ctx, key, k)
                val_s += time.perf_counter() - t_val
                val_curve.append((k, round(elapsed, 1), metrics["val/acc"]))
            tb.log(k, metrics)
            progress.update(k, metrics)
        train_s = time.perf_counter() - t_train - val_s
        acc_after = _validate(ctx, key, total)
        hist, val = _history(ctx, total)
        png_url = join(ctx.layout.root, "report", "curves.png")
        _write_bytes(png_url, curves_png(hist, val), ctx)
        summary = {"run_id": cfg.run_id, "iterations": total, "val/acc before": acc_before,
                   "val/acc after": acc_after, "train seconds (this process)": round(train_s, 1),
                   "resumed from iteration": done}
        final_artifact(cfg.run_id, summary, png_url)
        return {**summary, "curves": png_url, "root": cfg.root, "val_curve": val_curve}
    finally:
        tb.close()
        detach(key)


def _write_bytes(url: str, data: bytes, ctx: RunContext) -> None:
    from storage import url_to_fs

    fs, path = url_to_fs(url, ctx.storage)
    fs.makedirs(fs._parent(path), exist_ok=True)
    fs.pipe_file(path, data)

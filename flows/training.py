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

from prefect import flow, get_run_logger, tags, task
from prefect.cache_policies import NO_CACHE

from flows.config import RunConfig, frozen_config, load_run_config
from flows.reporting import (MetricLoggers, Progress, curves_png, final_artifact, iteration_artifacts,
                             local_tb_dir)
from flows.remote import run_remote
from flows.run_lock import RunLock
from gpu_jobs.reward import decode_ground_truth
from gpu_jobs.stages import Engines, Run, last_committed, open_warm, run_iteration
from storage import committed, join, read_manifest, read_table
from tasks.stages import STAGE_TASKS

log = logging.getLogger("rlmill")
# DeepSpeed calls torch.distributed APIs that torch 2.13 deprecates, once per parameter per step.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")


class PrefectCalls:
    """How the flow runs a stage (see gpu_jobs.stages.graph): a Prefect task in this process with
    the run's warm engines, or with placement=remote a run of the stage deployment for the GPU
    stages (rollout, update, validate), whose weights travel through checkpoints."""

    REMOTE = ("rollout", "update", "validate")

    def __init__(self, run: Run, engines: Engines | None):
        cfg = run.cfg
        self.run, self.engines = run, engines
        self.remote = cfg.trainer.placement == "remote"
        opts = {"retries": cfg.tasks.retries, "retry_delay_seconds": cfg.tasks.retry_delay_seconds,
                "timeout_seconds": cfg.tasks.timeout_seconds}
        self.tasks = {name: t.with_options(**opts) for name, t in STAGE_TASKS.items()}

    def __call__(self, stage: str, k: int, *inputs: Any) -> Any:
        if self.remote and stage in self.REMOTE:
            return run_remote(self.run, k, stage, list(inputs))
        if self.remote and stage == "weight-sync":
            return 0.0  # the next remote rollout loads the weights the remote update published
        with _untagged_tasks():
            return self._task(stage, k)(self.run, self.engines, k, *inputs)

    def start(self, stage: str, k: int, *inputs: Any):
        """Start a stage on Prefect's task runner (a thread here) and return its `.result`."""
        with _untagged_tasks():
            if self.remote and stage in self.REMOTE:
                return _remote_stage.submit(self.run, k, stage, list(inputs)).result
            return self._task(stage, k).submit(self.run, self.engines, k, *inputs).result

    def _task(self, stage: str, k: int):
        task = self.tasks[stage]
        if stage == "rollout":  # async: the UI says which weights sampled it (maybe another iteration's run)
            version = self.run.cfg.async_training.weights_version(k)
            task = task.with_options(task_run_name=f"rollout-{k} (weights of update {version})")
        return task


@task(name="remote-stage", cache_policy=NO_CACHE)  # the stage itself is idempotent; a Run cannot be hashed
def _remote_stage(run: Run, k: int, stage: str, inputs: list[str]) -> str:
    """A run of the stage deployment, started from a task so Prefect's task runner can overlap
    it with another (async: a rollout on one pool while the update runs on another)."""
    return run_remote(run, k, stage, inputs)


def _run_iteration(calls: PrefectCalls, k: int) -> dict[str, Any]:
    """The iteration's subflow run, without its own heartbeat thread.

    Prefect joins a flow run's heartbeat thread on exit, and that thread sleeps in 1-second steps:
    ~0.9 s per subflow of pure waiting (1.2 s -> 0.33 s per subflow run measured here). The parent
    rl-training run keeps its heartbeat, which is what detects a crashed process; a subflow lives
    only inside it.
    """
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        return rl_iteration(calls).with_options(flow_run_name=f"iter-{k:04d}")(calls.run.cfg.run_id, k)


def _samples(run: Run, batch_uri: str, reward_uri: str, n: int) -> list[dict]:
    """The first response to each of the first `n` prompts, for the iteration's markdown artifact."""
    if n <= 0:
        return []
    batch = read_table(batch_uri, columns=["uid", "sample_index", "prompt_ids", "ground_truth"],
                       storage=run.storage).to_pylist()
    rewards = {r["uid"]: r for r in read_table(reward_uri, columns=["uid", "response_text", "score"],
                                               storage=run.storage).to_pylist()}
    firsts = [row for row in batch if row["sample_index"] == 0][:n]
    return [{"prompt": run.tokenizer.decode(row["prompt_ids"], skip_special_tokens=True),
             "response": rewards[row["uid"]]["response_text"], "truth": decode_ground_truth(row["ground_truth"]),
             "score": rewards[row["uid"]]["score"]} for row in firsts]


def rl_iteration(calls: PrefectCalls):
    """The rl-iteration flow for this run: one RL iteration (gpu_jobs.stages.graph.run_iteration)
    with its stages as Prefect tasks; returns the iteration's merged metrics.

    Built per run around `calls` because Prefect stores a flow run's parameters in its API: the
    run's warm engines reach the stages through this closure, and the UI shows (run_id, k).
    """
    @flow(name="rl-iteration", log_prints=True)
    def rl_iteration(run_id: str, k: int) -> dict[str, Any]:
        run = calls.run
        uris = run_iteration(calls, run.cfg, k)
        metrics = read_manifest(uris["commit"], run.storage).metrics
        iteration_artifacts(run_id, k, metrics,
                            _samples(run, uris["gate"], uris["reward"], run.cfg.trainer.samples_in_artifact))
        return metrics

    return rl_iteration


@contextmanager
def _untagged_tasks():
    """Task runs created inside carry no tags. Prefect acquires a concurrency slot per tag of a
    task run (an API round trip each, ~40 ms); the flow runs keep the `rlmill`/`run:<id>` tags,
    which is what the UI filters on."""
    from prefect.context import TagsContext

    with TagsContext(current_tags=set()):
        yield


def _validate(calls: PrefectCalls, k: int) -> float:
    return float(read_manifest(calls("validate", k), calls.run.storage).metrics["val/acc"])


def _val_due(cfg: RunConfig, k: int) -> bool:
    every = cfg.trainer.val_every
    return k == cfg.trainer.total_iterations or (every > 0 and k % every == 0)


def _history(run: Run, upto: int) -> tuple[list, list]:
    hist, val = [], []
    for k in range(0, upto + 1):
        if k and (uri := committed(run.layout.stage(k, "commit"), run.storage)):
            hist.append((k, read_manifest(uri, run.storage).metrics))
        if uri := committed(run.layout.stage(k, "validate"), run.storage):
            val.append((k, read_manifest(uri, run.storage).metrics["val/acc"]))
    return hist, val


@flow(name="rl-training", log_prints=True)
def rl_training(config: str | None = None, overrides: list[str] | None = None,
                iterations: int | None = None, run_id: str | None = None) -> dict[str, Any]:
    """A whole RL run. `config` is a YAML file, `overrides` verl-style `key=value` strings;
    `iterations` and `run_id` are shortcuts for trainer.total_iterations and run_id.

    Run ids: when neither the config, the overrides nor `run_id` names one, the run gets a fresh
    `<config file>-<YYYYmmdd-HHMMSS>` id, logged first; naming an id resumes that run.

    Failures: a user's mistake (an invalid config, a run id reused with another config, a run
    another process holds, a missing data file, prompts that are too long or fail the data gate)
    ends the flow run in a Failed state whose message is one line naming it and its fix (also
    logged, so `prefect deployment run --watch` and the UI show it); called in-process, the
    original exception is raised. Anything else is a bug: one summary line is logged, then the
    exception propagates and Prefect logs its traceback once.
    """
    from prefect.context import FlowRunContext
    from prefect.states import Failed

    from flows.overrides import with_run_id
    from flows.reporting import check_startable, one_traceback_per_error, run_id_taken, user_error_line

    in_run = FlowRunContext.get() is not None  # False for rl_training.fn(...): plain exceptions
    logger = get_run_logger() if in_run else log
    one_traceback_per_error()
    cfg = None
    try:
        extra = list(overrides or [])
        extra += [f"trainer.total_iterations={iterations}"] if iterations else []
        extra += [f"run_id={run_id}"] if run_id else []
        extra, fresh = with_run_id(config, extra, taken=run_id_taken(config, extra))
        cfg = load_run_config(config, extra)
        logger.info("run %s (%s)", cfg.run_id, f"new; to resume it, start again with run_id={fresh}" if fresh
                    else "named by run_id: resumed where it stopped if it exists")
        check_startable(cfg)
        with RunLock(cfg.root, cfg.run_id), tags("rlmill", f"run:{cfg.run_id}"):
            return _train(cfg, logger)
    except Exception as exc:
        if not in_run:
            raise
        line = user_error_line(exc, cfg)
        if line is None:
            what = " ".join(f"{type(exc).__name__}: {exc}".split())
            logger.error("rlmill: run %s failed: %s (unexpected: the traceback follows)",
                         cfg.run_id if cfg else "?", what)
            try:
                exc.rlmill_reported = True  # the CLI then does not print the traceback a second time
            except AttributeError:
                pass
            raise
        logger.error("rlmill: %s", line)
        try:
            exc.rlmill_line = line  # what `rlmill train` prints when this exception reaches it
        except AttributeError:
            pass
        return Failed(message=line, data=exc)


def _train(cfg: RunConfig, logger) -> dict[str, Any]:
    t_setup = time.perf_counter()
    if cfg.trainer.placement == "colocated":
        run, engines = open_warm(cfg)
    else:  # remote: this process never loads a model
        run, engines = Run.open(cfg), None
    calls = PrefectCalls(run, engines)
    total = cfg.trainer.total_iterations
    done = last_committed(run.layout, "commit", total)
    logger.info("run %s: %d/%d iterations committed; model %s; setup %.1fs", cfg.run_id, done, total,
                run.model_path, time.perf_counter() - t_setup)
    tb = MetricLoggers(cfg.run_id, local_tb_dir(cfg.root, cfg.run_id) if cfg.trainer.tensorboard else None,
                       cfg.trainer.loggers, frozen_config(cfg))
    try:
        acc_before = _validate(calls, 0)
        progress = Progress(cfg.run_id, total, done)
        t_train, val_s, val_curve = time.perf_counter(), 0.0, [(0, 0.0, acc_before)]
        for k in range(done + 1, total + 1):
            metrics = _run_iteration(calls, k)
            if _val_due(cfg, k):
                # Training time excludes validation itself: it is what a user waits for per gain.
                t_val = time.perf_counter()
                elapsed = t_val - t_train - val_s
                metrics["val/acc"] = _validate(calls, k)
                val_s += time.perf_counter() - t_val
                val_curve.append((k, round(elapsed, 1), metrics["val/acc"]))
            tb.log(k, metrics)
            progress.update(k, metrics)
        train_s = time.perf_counter() - t_train - val_s
        acc_after = _validate(calls, total)
        hist, val = _history(run, total)
        png_url = join(run.layout.root, "report", "curves.png")
        _write_bytes(png_url, curves_png(hist, val), run)
        summary = {"run_id": cfg.run_id, "iterations": total, "val/acc before": acc_before,
                   "val/acc after": acc_after, "train seconds (this process)": round(train_s, 1),
                   "resumed from iteration": done}
        final_artifact(cfg.run_id, summary, png_url)
        return {**summary, "curves": png_url, "root": cfg.root, "val_curve": val_curve}
    finally:
        tb.close()
        if engines is not None:
            engines.close()


def _write_bytes(url: str, data: bytes, run: Run) -> None:
    from storage import url_to_fs

    fs, path = url_to_fs(url, run.storage)
    fs.makedirs(fs._parent(path), exist_ok=True)
    fs.pipe_file(path, data)

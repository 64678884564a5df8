"""The RL run as Prefect flows: `rl_training` (one run) with one `rl_iteration` subflow per iteration.

    python -m flows.cli train --config examples/grpo_arith.yaml rollout.n=8
    prefect deployment run 'rl-training/manual' -p iterations=3

A run can be killed at any point and started again with the same run_id: stages that committed
are not recomputed, the trainer is restored from the last checkpoint plus the committed updates
after it, and the final weights equal those of an uninterrupted run.

The Prefect API may go away too (a server restart): the run waits for it, with backoff, up to
tasks.api_outage_budget_seconds, then runs the interrupted iteration again in this process, where
committed stages are not recomputed (OutageGuard). A deployment run that fails or dies anyway is
started again with the same run_id by the automations of deployments/resume.py.

SIGINT (Ctrl-C) and SIGTERM stop the run within seconds, and Prefect's Cancel ends it Cancelled
(flows/stopping.py): a signal is never taken for an outage.
"""

from __future__ import annotations

import logging
import time
import warnings
from contextlib import contextmanager
from typing import Any

from prefect import flow, get_run_logger, tags, task
from prefect.cache_policies import NO_CACHE

from flows.config import RunConfig, flow_run_config, frozen_config
from flows.failpoints import reach
from flows.reporting import (MetricLoggers, Progress, curves_png, final_artifact, iteration_artifacts,
                             local_tb_dir, validation_artifact)
from flows.remote import REMOTE_POOLS, run_remote
from flows import stopping
from flows.run_lock import RunLock
from flows.stopping import RunStopped, stop_signals
from gpu_jobs import stages
from gpu_jobs.stages import Roles, Run, StageSpec, artifact_samples, last_committed, open_warm, run_iteration
from storage import committed, join, overwrite, read_manifest
from tasks.stages import stage_task

log = logging.getLogger("rlmill")
INPUT_ERROR_TAG = "input-error"  # the run failed because of its input: deployments/resume.py leaves it
# DeepSpeed calls torch.distributed APIs that torch 2.13 deprecates, once per parameter per step.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")


class PrefectCalls:
    """How the flow runs a stage (see gpu_jobs.stages.graph): its Prefect task in this process with
    the run's warm roles, or with placement=remote a deployment run for the stages whose
    declaration says they run on a pool (`where="trainer"` on trainer.stage_deployment,
    `where="rollout"` on trainer.rollout_deployment; flows/remote.py), whose weights travel through
    checkpoints."""

    def __init__(self, run: Run, roles: Roles | None):
        cfg = run.cfg
        self.run, self.roles = run, roles
        self.remote = cfg.trainer.placement == "remote"
        self.task_options = {"retries": cfg.tasks.retries, "retry_delay_seconds": cfg.tasks.retry_delay_seconds,
                             "timeout_seconds": cfg.tasks.timeout_seconds}
        self.tasks: dict[StageSpec, Any] = {}
        self.iteration_flow = iteration_flow_for(self)
        self.subflow_settings = SubflowSettings()

    def __call__(self, stage: StageSpec, k: int, *inputs: Any) -> Any:
        if self.remote and stage.where in REMOTE_POOLS:
            with _untagged_tasks():
                return self._remote_task(stage)(self.run, k, stage, list(inputs))
        if self.remote and stage.where == "colocated":
            return 0.0  # seconds of hand-off: the next remote stage loads the weights the remote update published
        with _untagged_tasks():
            return self._task(stage, k)(self.run, self.roles, k, *inputs)

    def start(self, stage: StageSpec, k: int, *inputs: Any):
        """Start a stage on Prefect's task runner (a thread here) and return its `.result`."""
        with _untagged_tasks():
            if self.remote and stage.where in REMOTE_POOLS:
                return self._remote_task(stage).submit(self.run, k, stage, list(inputs)).result
            return self._task(stage, k).submit(self.run, self.roles, k, *inputs).result

    def _remote_task(self, stage: StageSpec):
        """A remote stage's task, retried like a colocated stage's (each retry a new deployment run)."""
        return _remote_stage.with_options(name=f"{stage.name}-remote", **self.task_options)

    def _task(self, stage: StageSpec, k: int):
        if stage not in self.tasks:
            self.tasks[stage] = stage_task(stage).with_options(**self.task_options)
        task = self.tasks[stage]
        if stage is stages.rollout:  # async: the UI says which weights sampled it (maybe another iteration's run)
            version = self.run.cfg.async_training.weights_version(k)
            task = task.with_options(task_run_name=f"rollout-{k} (weights of update {version})")
        return task


class SubflowSettings:
    """Prefect's settings for the iteration subflows: no heartbeat thread of their own.

        with subflow_settings():      # a SettingsContext: the current settings, heartbeat off
            calls.iteration_flow(...)

    Prefect joins a flow run's heartbeat thread on exit, and that thread sleeps in 1-second
    steps: ~0.9 s per subflow of pure waiting. The parent rl-training run keeps its heartbeat,
    which is what detects a crashed process; a subflow lives only inside it. The settings object
    is built once: rebuilding Prefect's settings model (what `temporary_settings` does) reads the
    environment and profile again, ~0.1 s per iteration on 2 cores.
    """

    def __init__(self) -> None:
        self._settings = None

    def __call__(self):
        from prefect.context import SettingsContext, get_settings_context
        from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY

        current = get_settings_context()
        if self._settings is None:
            self._settings = current.settings.copy_with_update(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})
        return SettingsContext(profile=current.profile, settings=self._settings)


@task(name="remote-stage", cache_policy=NO_CACHE)  # the stage itself is idempotent; a Run cannot be hashed
def _remote_stage(run: Run, k: int, stage: StageSpec, inputs: list[str]) -> str:
    """A deployment run of a remote stage, from a task: retried, and overlapped with another by
    Prefect's task runner (async: a rollout on the rollout pool while the update runs)."""
    return run_remote(run, k, stage, inputs)


def _iteration_subflow(calls: PrefectCalls, k: int) -> dict[str, Any]:
    """Iteration k as a subflow run (one flow run per iteration in the UI, its stages as task runs)."""
    with calls.subflow_settings():
        return calls.iteration_flow.with_options(flow_run_name=f"iter-{k:04d}")(calls.run.cfg.run_id, k)


def iteration_flow_for(calls: PrefectCalls):
    """The rl-iteration flow of this run: one RL iteration (gpu_jobs.stages.graph.run_iteration)
    with its stages as Prefect tasks; it returns the iteration's merged metrics.

    Built per run around `calls` because Prefect stores a flow run's parameters in its API: the
    run's warm roles reach the stages through this closure, and the UI shows (run_id, k).
    """
    @flow(name="rl-iteration", log_prints=True)
    def rl_iteration(run_id: str, k: int) -> dict[str, Any]:
        run = calls.run
        uris = run_iteration(calls, run.cfg, k)
        metrics = read_manifest(uris["commit"], run.storage).metrics
        iteration_artifacts(run_id, k, metrics,
                            artifact_samples(run, uris["gate"], uris["reward"], run.cfg.trainer.samples_in_artifact))
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


def _validation_metrics(calls: PrefectCalls, k: int) -> dict[str, Any]:
    """The validation after update k (its stage's metrics: val/acc and verl's val-core/val-aux),
    also shown as a markdown artifact."""
    metrics = read_manifest(calls(stages.validate, k), calls.run.storage).metrics
    validation_artifact(calls.run.cfg.run_id, k, metrics)
    return metrics


_VAL_PREFIXES = ("val/", "val-core/", "val-aux/")


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


def _completed(flow, flow_run, state) -> None:
    """After the API stored the run's Completed state (Prefect runs completion hooks then)."""
    reach("run:completed")


@flow(name="rl-training", log_prints=True, on_completion=[_completed])
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
    original exception is raised. Anything else is a bug: one summary line is logged with its
    traceback, once, and the exception propagates.
    """
    from prefect.context import FlowRunContext

    from flows.reporting import one_traceback_per_error
    from flows.user_errors import check_startable, run_start_words

    in_run = FlowRunContext.get() is not None  # False for rl_training.fn(...): plain exceptions
    logger = get_run_logger() if in_run else log
    one_traceback_per_error()
    cfg = None
    try:
        cfg, fresh, checked = flow_run_config(config, overrides, iterations, run_id)  # once (prepared_run: the CLI's)
        logger.info("run %s (%s)", cfg.run_id, run_start_words(cfg, fresh))
        if not checked:  # the CLI checked it before Prefect started (a data gate reads every file)
            check_startable(cfg)
        with RunLock(cfg.root, cfg.run_id), tags("rlmill", f"run:{cfg.run_id}"), \
                stop_signals(cfg.tasks.stop_grace_seconds):
            own_line = stopping.set_default_line(lambda signum: _deployment_stop_line(cfg, signum))
            if in_run:
                _tag_flow_run(f"run:{cfg.run_id}")
            try:
                return _train(cfg, logger)
            except RunStopped as stop:
                if own_line:  # a deployment run: the line goes to its log (the CLI prints its own)
                    stopping.say_once(stop.signum, emit=logger.warning)
                raise
            finally:
                if own_line:
                    stopping.set_line(None)  # the next run in this process (tests) says its own
    except Exception as exc:
        failed = _failed_run(exc, cfg, logger) if in_run else None
        if failed is None:
            raise
        return failed


def _deployment_stop_line(cfg: RunConfig, signum: int) -> str:
    """The stop line of a run outside the CLI (a deployment run): how to start it again."""
    from prefect.runtime import deployment

    name = deployment.name
    resume = (f"prefect deployment run 'rl-training/{name}' -p run_id={cfg.run_id} (a Crashed deployment run is "
              "also resumed automatically)" if name else f"rlmill train run_id={cfg.run_id} with its config")
    return stopping.stop_line(cfg.run_id, signum, committed_iterations(cfg), resume)


def committed_iterations(cfg: RunConfig) -> int:
    """How many iterations of the run have committed (its last `commit` stage)."""
    from storage import RunLayout

    return last_committed(RunLayout(cfg.root, cfg.run_id, cfg.storage), "commit", cfg.trainer.total_iterations)


def _failed_run(exc: Exception, cfg: RunConfig | None, logger):
    """The rl-training flow run's end after `exc`: a Failed state with one line for a user's
    mistake (tagged input-error: an automatic resume would fail the same way), or None for
    anything else (a bug), after logging one summary line with its traceback: the caller raises."""
    from prefect.context import FlowRunContext
    from prefect.states import Failed

    from flows.reporting import deliver_logged_line
    from flows.user_errors import user_error_line

    flow_run_id = FlowRunContext.get().flow_run.id
    line = user_error_line(exc, cfg)
    if line is None:
        what = " ".join(f"{type(exc).__name__}: {exc}".split())
        summary = f"rlmill: run {cfg.run_id if cfg else '?'} failed: {what} (unexpected: the traceback follows)"
        # The traceback rides on the summary's own record, delivered before the run turns
        # Failed: `--watch` stops 3 s after the final state, and the engine's own copy
        # ("Encountered exception during execution") is logged after it and could miss it.
        logger.error("%s", summary, exc_info=exc)
        deliver_logged_line(flow_run_id, summary)
        _mark(exc, "rlmill_reported", True)  # nor the CLI nor Prefect's engine (reporting._OneTraceback) repeats it
        return None
    logger.error("rlmill: %s", line)
    deliver_logged_line(flow_run_id, f"rlmill: {line}")
    _tag_flow_run(INPUT_ERROR_TAG, quiet=True)
    _mark(exc, "rlmill_line", line)  # what `rlmill train` prints when this exception reaches it
    return Failed(message=line, data=exc)


def _mark(exc: Exception, attribute: str, value: Any) -> None:
    try:
        setattr(exc, attribute, value)
    except AttributeError:  # an exception type with __slots__
        pass


def _train(cfg: RunConfig, logger) -> dict[str, Any]:
    t_setup = time.perf_counter()
    if cfg.trainer.placement == "colocated":
        run, roles = open_warm(cfg)
    else:  # remote: this process never loads a model
        run, roles = Run.open(cfg), None
    calls = PrefectCalls(run, roles)
    guard = OutageGuard(cfg.tasks.api_outage_budget_seconds, logger, cfg.run_id)
    total = cfg.trainer.total_iterations
    done = last_committed(run.layout, "commit", total)
    logger.info("run %s: %d/%d iterations committed; model %s; setup %.1fs", cfg.run_id, done, total,
                run.model_path, time.perf_counter() - t_setup)
    tb = MetricLoggers(cfg.run_id, local_tb_dir(cfg.root, cfg.run_id) if cfg.trainer.tensorboard else None,
                       cfg.trainer.loggers, frozen_config(cfg))
    try:
        reach("run:setup")
        start = run.layout.fork_base()  # 0; a forked run starts at its fork point (gpu_jobs/stages/fork.py)
        acc_before = (float(guard("validation before training", _validation_metrics, calls, start)["val/acc"])
                      if cfg.trainer.val_before_train else None)  # None: trainer.val_before_train=false
        progress = guard("the progress artifact", Progress, cfg.run_id, total, done)
        t_train, val_s, val_curve = time.perf_counter(), 0.0, [] if acc_before is None else [(start, 0.0, acc_before)]
        if 0 < done < total and _val_due(cfg, done) and not committed(run.layout.stage(done, "validate"), run.storage):
            guard(f"validation after iteration {done}", _validation_metrics, calls, done)  # stopped before it
        for k in range(done + 1, total + 1):
            metrics = guard(f"iteration {k}", _iteration_subflow, calls, k)
            if _val_due(cfg, k):
                # Training time excludes validation itself: it is what a user waits for per gain.
                t_val = time.perf_counter()
                elapsed = t_val - t_train - val_s
                val = guard(f"validation after iteration {k}", _validation_metrics, calls, k)
                metrics.update({m: v for m, v in val.items() if m.startswith(_VAL_PREFIXES)})
                val_s += time.perf_counter() - t_val
                val_curve.append((k, round(elapsed, 1), metrics["val/acc"]))
            tb.log(k, metrics)
            guard(f"the progress artifact of iteration {k}", progress.update, k, metrics)
        train_s = time.perf_counter() - t_train - val_s
        reach("run:final-validation")
        last_val = guard("the final validation", _validation_metrics, calls, total)
        acc_after = float(last_val["val/acc"])
        reach("run:report")
        hist, val = _history(run, total)
        png_url, png = join(run.layout.root, "report", "curves.png"), curves_png(hist, val)
        if png is None:  # matplotlib not installed (warned)
            png_url = None
        else:
            overwrite(png_url, png, run.storage)
        summary = {"run_id": cfg.run_id, "iterations": total, "val/acc before": acc_before,
                   "val/acc after": acc_after, "train seconds (this process)": round(train_s, 1),
                   "resumed from iteration": done}
        guard("the final artifact", final_artifact, cfg.run_id, summary, png_url, last_val)
        reach("run:return")
        return {**summary, "curves": png_url, "root": cfg.root, "val_curve": val_curve}
    finally:
        tb.close()
        if roles is not None:
            roles.close()


# ------------------------------------------------------------------ the Prefect API going away
def _tag_flow_run(tag: str, quiet: bool = False) -> None:
    """Add `tag` to this rl-training flow run itself. `run:<id>` (its children already carry it)
    lets the UI filter a run's flow runs by one tag and tells an automatic resume
    (deployments/resume.py) which run_id a run started without one trained; `input-error` tells
    it not to resume. quiet: a failure to tag is logged, not raised (the run is failing anyway)."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or tag in (ctx.flow_run.tags or []):
        return
    try:
        with get_client(sync_client=True) as client:
            current = client.read_flow_run(ctx.flow_run.id).tags or []
            client.update_flow_run(ctx.flow_run.id, tags=[*current, tag])
    except Exception as exc:
        if not quiet:
            raise
        log.warning("rlmill: could not tag flow run %s with %r: %s", ctx.flow_run.name, tag, exc)


def api_fault(exc: BaseException, api_url: str | None) -> bool:
    """Whether `exc`, or an exception it chains or groups, is a call to the Prefect API at
    `api_url` that did not get through (connection refused or dropped, a timeout) or was answered
    502/503/504: an outage of the orchestrator, not a failure of the run."""
    import httpx

    if not api_url:
        return False
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (httpx.TransportError, httpx.HTTPStatusError)):
            try:
                url = str(e.request.url)
            except RuntimeError:  # an httpx error raised without its request
                url = ""
            status = e.response.status_code if isinstance(e, httpx.HTTPStatusError) else None
            if url.startswith(api_url.rstrip("/")) and status in (None, 502, 503, 504):
                return True
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return False


def api_answers(api_url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{api_url.rstrip('/')}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for_api(api_url: str, budget_s: float, max_delay_s: float = 10.0) -> float:
    """Probe `api_url` until it answers, backing off 1 s doubling to `max_delay_s` with +-20%
    jitter (many runs waiting on one server must not all knock at once); returns the seconds
    waited. Raises TimeoutError once `budget_s` is spent."""
    import random

    t0, delay = time.monotonic(), 1.0
    while not api_answers(api_url):
        waited = time.monotonic() - t0
        if waited >= budget_s:
            raise TimeoutError(f"the Prefect API at {api_url} did not answer for {waited:.0f} s")
        time.sleep(min(delay * random.uniform(0.8, 1.2), budget_s - waited))
        delay = min(2 * delay, max_delay_s)
    return time.monotonic() - t0


class OutageGuard:
    """Runs one step of the training loop; when it fails because the Prefect API went away, waits
    for the API (up to `budget_s`, tasks.api_outage_budget_seconds) and runs the step again.

    Prefect 3.7 does not ride out an outage: the first task or subflow state it cannot report
    raises (httpx.ConnectError). Running the step again in this process is cheap and safe: the
    roles stay warm, and every stage that committed before the outage returns its manifest
    without computing anything (the stage contract). The subflow run the outage cut off is left
    Running by Prefect; it is marked Crashed once the API is back, so the UI tells the truth.
    """

    MAX_REPEATS = 5  # the API answers /health but the step keeps failing on it: not an outage

    def __init__(self, budget_s: float, logger, run_id: str):
        from prefect.settings import PREFECT_API_URL

        self.budget_s, self.logger, self.run_id = budget_s, logger, run_id
        self.api_url = PREFECT_API_URL.value()

    def __call__(self, what: str, fn, *args):
        repeats = 0
        while True:
            try:
                return fn(*args)
            except Exception as exc:
                # A run told to stop (SIGINT, SIGTERM) never waits: whatever failed, it is ending.
                if stopping.requested() is not None or self.budget_s <= 0 or not self.api_url or (
                        repeats >= self.MAX_REPEATS) or not (api_fault(exc, self.api_url) or not api_answers(self.api_url)):
                    raise
                repeats += 1
                self._wait(what, exc)

    def _wait(self, what: str, exc: Exception) -> None:
        self.logger.warning("rlmill: the Prefect API at %s failed during %s (%s); waiting for it to come back "
                            "(up to %.0f s, tasks.api_outage_budget_seconds)", self.api_url, what,
                            type(exc).__name__, self.budget_s)
        try:
            waited = wait_for_api(self.api_url, self.budget_s)
        except TimeoutError as timeout:
            raise RuntimeError(f"{timeout} (tasks.api_outage_budget_seconds={self.budget_s:.0f}); run "
                               f"{self.run_id} stopped during {what}: start it again with run_id={self.run_id} "
                               "(a deployment run is resumed automatically) and it goes on from its commits") from exc
        self.logger.warning("rlmill: the Prefect API answers again after %.0f s; running %s again (stages it "
                            "committed are not recomputed)", waited, what)
        try:
            _crash_cut_off_subflows(self.run_id)
        except Exception as exc:  # cosmetic (the UI); the run goes on regardless
            self.logger.warning("rlmill: could not mark the cut-off subflow run Crashed: %s", exc)


def _crash_cut_off_subflows(run_id: str) -> None:
    """Mark Crashed the rl-iteration runs of this rl-training run that an outage left Running."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas import filters as F
    from prefect.client.schemas.objects import StateType
    from prefect.context import FlowRunContext
    from prefect.states import Crashed

    ctx = FlowRunContext.get()
    if ctx is None:
        return
    with get_client(sync_client=True) as client:
        stuck = client.read_flow_runs(flow_run_filter=F.FlowRunFilter(
            parent_flow_run_id=F.FlowRunFilterParentFlowRunId(any_=[ctx.flow_run.id]),
            state=F.FlowRunFilterState(type=F.FlowRunFilterStateType(
                any_=[StateType.RUNNING, StateType.PENDING, StateType.SCHEDULED]))))
        for fr in stuck:
            client.set_flow_run_state(fr.id, Crashed(
                message=f"the Prefect API went away while this ran; run {run_id} ran it again as a new flow run"),
                force=True)

"""Automatic resume: a deployment run of rl-training, rl-nightly or rl-retrain that failed, crashed or went
silent is started again with the same run_id, after a delay, a bounded number of times.

`make deploy` ships the `rl-resume/auto` deployment with two automations (deployments/prefect.yaml):
  - a deployment run of rl-training, rl-nightly or rl-retrain enters Failed, TimedOut or Crashed (the worker
    reports Crashed when the run's process dies);
  - a running one sends no heartbeat for 90 s (its process died with its worker or its machine:
    nobody is left to report it). Unless one arrives in the next 45 s (heartbeats also go unheard
    while the API itself is down), it is marked Crashed first.
Each starts `rl-resume/auto` for that flow run, which decides (`decide`, a plain function) and
creates the next run of the same deployment, Scheduled `tasks.auto_resume_delay_seconds` ahead,
with the same parameters plus the run_id the failed run trained, so it goes on from its commits.
The UI shows each resume as `<first run's name> (auto-resume 2/3)`, tagged `auto-resume`,
`resume-of:<first flow run id>` (the count, read back from the API, survives any crash) and
`resumes:<flow run id>` (one resume per failed run, however many automations fire for it).
Not resumed: a failure caused by the input (tagged `input-error` by rl-training: it would fail
the same way), subflow runs, runs that completed or were cancelled, and runs past
`tasks.auto_resumes`.

    prefect deployment run 'rl-resume/auto' -p flow_run=<flow run id>     # the same decision, by hand
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from typing import Any, Literal
from uuid import UUID

from prefect import flow, get_run_logger

RESUMABLE_FLOWS = ("rl-training", "rl-nightly", "rl-retrain")
INPUT_ERROR_TAG = "input-error"  # rl-training tags a run that failed because of its config or data
_SUFFIX = re.compile(r" \(auto-resume \d+/\d+\)$")
SILENT_RECHECK_S = 45.0  # 1.5 heartbeat periods (PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30 in prefect.yaml)


@dataclass
class Decision:
    """What to do about one ended (or silent) flow run; `resume` False says why not in `reason`."""

    resume: bool
    reason: str
    attempt: int = 0
    name: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    delay_s: float = 0.0
    over_limit: bool = False


def tag_value(tags: list[str], prefix: str) -> str | None:
    """'run:abc' -> 'abc' for prefix 'run:' (the first such tag), None when there is none."""
    return next((t[len(prefix):] for t in tags if t.startswith(prefix)), None)


def decide(*, flow_name: str, run_name: str, run_id_: str, state_type: str, tags: list[str],
           parameters: dict[str, Any], has_deployment: bool, resumes_so_far: int, already_resumed: bool,
           limit: int, delay_s: float) -> Decision:
    """The resume decision for flow run `run_id_` (pure: everything it needs is an argument).
    `resumes_so_far` counts the runs already created for its chain (see the module docstring)."""
    if flow_name not in RESUMABLE_FLOWS or not has_deployment:
        return Decision(False, f"{flow_name} run {run_name} is not a deployment run of {RESUMABLE_FLOWS}")
    if state_type not in ("FAILED", "CRASHED"):
        return Decision(False, f"run {run_name} is {state_type}, not Failed or Crashed")
    if INPUT_ERROR_TAG in tags:
        return Decision(False, f"run {run_name} failed because of its input (see its state message): "
                               "a resume would fail the same way")
    if already_resumed:
        return Decision(False, f"run {run_name} was already resumed")
    attempt = resumes_so_far + 1
    if attempt > limit:
        return Decision(False, f"run {run_name} is not resumed: {resumes_so_far}/{limit} automatic resumes "
                               "used (tasks.auto_resumes); start it again by hand", over_limit=True)
    root = tag_value(tags, "resume-of:") or run_id_
    params = dict(parameters)
    if flow_name == "rl-training" and (trained := tag_value(tags, "run:")):
        params["run_id"] = trained  # a run started without one got a fresh id: resume that one
    name = f"{_SUFFIX.sub('', run_name)} (auto-resume {attempt}/{limit})"
    keep = [t for t in tags if not t.startswith(("resume-of:", "resumes:", "run:")) and t != "auto-resume"]
    new_tags = [*keep, "auto-resume", f"resume-of:{root}", f"resumes:{run_id_}"]
    new_tags += [f"run:{params['run_id']}"] if params.get("run_id") else []
    return Decision(True, f"resuming run {run_name} as {name!r} in {delay_s:.0f} s", attempt, name, params,
                    new_tags, delay_s)


def resume_settings(parameters: dict[str, Any], run_id: str | None) -> tuple[int, float]:
    """(tasks.auto_resumes, tasks.auto_resume_delay_seconds) of the run's own config and overrides."""
    from flows.config import load_run_config

    overrides = list(parameters.get("overrides") or []) + ([f"run_id={run_id}"] if run_id else [])
    tasks = load_run_config(parameters.get("config"), overrides).tasks
    return tasks.auto_resumes, tasks.auto_resume_delay_seconds


def _flow_run_id(flow_run: str) -> UUID:
    """A flow run id, or an event resource id 'prefect.flow-run.<id>' (what the automations pass)."""
    return UUID(flow_run.rsplit(".", 1)[-1])


def _count(client, tag: str) -> int:
    from prefect.client.schemas import filters as F

    return len(client.read_flow_runs(flow_run_filter=F.FlowRunFilter(tags=F.FlowRunFilterTags(all_=[tag]))))


def _heard_from(client, fr, wait_s: float) -> bool:
    """Whether the silent run `fr` shows it is alive within `wait_s`: a heartbeat newer than now, or
    a state other than Running. Heartbeats also go unheard while the API itself was down (the
    automation then fires for runs that are fine), so one more heartbeat period is waited."""
    import time

    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter
    from prefect.types._datetime import now

    since, deadline = now("UTC"), time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(5)
        page = client.read_events(filter=EventFilter(
            occurred=EventOccurredFilter(since=since), event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
            resource=EventResourceFilter(id=[f"prefect.flow-run.{fr.id}"])), limit=1)
        if page.events or client.read_flow_run(fr.id).state_name != "Running":
            return True
    return False


def _mark_silent_crashed(client, fr, logger) -> Any:
    """A run still Running whose heartbeats stopped: its process is gone. Say so in its state."""
    from prefect.states import Crashed

    logger.warning("flow run %s sends no heartbeats: its process is gone (its worker or machine died); "
                   "marking it Crashed", fr.name)
    client.set_flow_run_state(fr.id, Crashed(
        message=f"no heartbeat for 90 s, nor in {SILENT_RECHECK_S:.0f} s more: the process running this flow run "
                "is gone (worker or machine died)"), force=True)
    return client.read_flow_run(fr.id)


@flow(name="rl-resume", log_prints=True)
def rl_resume(flow_run: str, why: Literal["ended", "silent"] = "ended") -> dict[str, Any]:
    """Decide whether the rl-training/rl-nightly flow run `flow_run` (an id, or 'prefect.flow-run.<id>')
    is resumed, and if so create its next run. `why`: 'ended' (it entered Failed/Crashed) or
    'silent' (its heartbeats stopped while Running)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.states import Failed

    logger = get_run_logger()
    with get_client(sync_client=True) as client:
        fr = client.read_flow_run(_flow_run_id(flow_run))
        if why == "silent" and fr.state_type == StateType.RUNNING:
            if _heard_from(client, fr, SILENT_RECHECK_S):
                logger.info("flow run %s is alive (a heartbeat or a new state): not resumed", fr.name)
                return {"resumed": False, "reason": f"{fr.name} is alive"}
            fr = _mark_silent_crashed(client, fr, logger)
        flow_name = client.read_flow(fr.flow_id).name
        tags = list(fr.tags or [])
        root = tag_value(tags, "resume-of:") or str(fr.id)
        limit, delay = (0, 0.0)
        if flow_name in RESUMABLE_FLOWS and fr.deployment_id is not None:
            try:
                limit, delay = resume_settings(fr.parameters, tag_value(tags, "run:"))
            except Exception as exc:  # the input itself is wrong: rl-training failed on it too
                logger.warning("not resuming %s: its config does not load (%s)", fr.name, exc)
                return {"resumed": False, "reason": f"config does not load: {exc}"}
        decision = decide(flow_name=flow_name, run_name=fr.name, run_id_=str(fr.id),
                          state_type=fr.state_type.value if fr.state_type else "UNKNOWN", tags=tags,
                          parameters=fr.parameters, has_deployment=fr.deployment_id is not None,
                          resumes_so_far=_count(client, f"resume-of:{root}"),
                          already_resumed=_count(client, f"resumes:{fr.id}") > 0, limit=limit, delay_s=delay)
    logger.info("%s", decision.reason)
    if not decision.resume:
        if decision.over_limit:
            return Failed(message=decision.reason)  # red in the UI: the run needs a person now
        return {"resumed": False, "reason": decision.reason}
    new = run_deployment(name=fr.deployment_id, parameters=decision.parameters, flow_run_name=decision.name,
                         scheduled_time=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=decision.delay_s),
                         tags=decision.tags, timeout=0, as_subflow=False,
                         # two automations (or an action's retry) may start rl-resume twice for one
                         # run at once: the server returns the first resume for the second
                         idempotency_key=f"rlmill-resume-{fr.id}")
    logger.info("created flow run %s (%s), scheduled in %.0f s", new.name, new.id, decision.delay_s)
    return {"resumed": True, "reason": decision.reason, "flow_run_id": str(new.id), "name": new.name}

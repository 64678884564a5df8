"""The feedback consumer as a Prefect flow: `rl-feedback`, one flow run per bounded drain of the
event stream into storage, with its counts, lag and segments as artifacts and one Prefect event
per committed segment.

    prefect deployment run 'rl-feedback/consume' -p root=s3://bucket/rl -p redis_url=redis://host:6379/0
    python -m flows.online.feedback schedule on        # start the deployment's every-minute schedule (off: pause it)
    rlmill feedback consume --root ROOT          # the same consumer as a plain command, no Prefect

Why one flow run per drain (a deployment on a 60 s interval schedule, deployment concurrency 1)
rather than one long-running flow with a task run per segment:
- The UI: every minute is one row in the runs list with its own artifacts -- what it read and
  committed, what it quarantined and why, what still waits (lag) -- and the keyed artifacts
  (rlmill-feedback-counts, -segments, -summary) keep a history across runs on the Artifacts page.
  A long-running run stays "Running" for days with thousands of task runs under it, and its
  artifacts say nothing until someone opens it.
- A crash costs one drain, and nothing restarts it by hand: when the worker or its machine dies,
  the next scheduled run, under the same consumer name (`consumer`), reads that consumer's
  pending entries first, and the committed-ids index skips every event already committed
  (gpu_jobs.online.consumer): each event lands once. A long-running flow that crashes stays down
  until an automation or a person starts it again.
- Cost: a run is one process start on the worker (a few CPU seconds), once a minute. A run reads
  for `window_s` (default 40 s): it commits what waits, then keeps committing events as they
  arrive (XREADGROUP blocks, no polling), so feedback lands within seconds while a run is up and
  within the gap to the next run otherwise. The window is smaller than the interval and the
  deployment's concurrency limit is 1 (collision strategy CANCEL_NEW), so runs never overlap: a
  run that would start while one still reads is cancelled, and the next one reads everything.

Events: each committed segment emits `rlmill.feedback.segment.committed` (answers and feedback of
one model and hour), each quarantine segment `rlmill.feedback.segment.quarantined`, after the
segment's manifest is committed and before the batch is acknowledged. What an automation (issue
26's retraining trigger) matches on:
  match:    {"prefect.resource.id": "rlmill.model.<name>"}   (or "rlmill.model.*" with
            for_each: [prefect.resource.id] to count each model on its own)
  expect:   ["rlmill.feedback.segment.committed"]
  posture Reactive, threshold N, within T seconds: N segments in T seconds.
Prefect counts events, not rows: the payload carries `answers` and `feedback` (rows committed),
`segment` (the manifest URI) and `root`, so the triggered run reads exactly the manifests it was
told about, or sums the rows of its window to decide. The event id is derived from the segment's
URI, so an event sent again for the same segment is stored and evaluated once by the server. The
run's related resources (flow run, flow, deployment) are attached by Prefect.

Readiness: since Prefect counts events, not rows, the rows are counted here. After each drain,
for every model under <root>/feedback/, the run evaluates issue 26's rule (gpu_jobs.online.windows.readiness
via flows.online.retrain.window_readiness): at least `ready_rows` feedback rows that no finished retraining
run trained on, or the oldest of them waiting `ready_after_s` seconds, whichever first. When it holds
it emits `rlmill.feedback.window.ready` (resource rlmill.model.<name>; payload model, root, rows,
oldest_age_s, reason), which starts 'rl-retrain/on-feedback' (its trigger in deployments/prefect.yaml).
The rule is evaluated on every drain, with or without new segments, so the age half fires within a
drain interval, and rows a crashed retraining owes keep it true until a run resumes that window.
`ready_rows=0` turns the announcement off.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from prefect import flow, get_run_logger, tags, task
from prefect.cache_policies import NONE as NO_CACHE

from flows.reporting import artifact_key
from storage.fs import redact_url
from gpu_jobs.online.broker import DEFAULT_REDIS, GROUP, STREAM, BrokerUnreachable, connect, url_password_problem
from gpu_jobs.online.consumer import (FEEDBACK_DIR, QUARANTINE_DIR, QUARANTINE_KIND, ConsumeResult, GroupLag, Segment,
                                      consume, group_lag)

__all__ = ["DEPLOYMENT", "QUARANTINE_EVENT", "READY_EVENT", "SEGMENT_EVENT", "counts_table", "ready_event", "rl_feedback", "segment_event",
           "segments_table", "summary_markdown"]

SEGMENT_EVENT = "rlmill.feedback.segment.committed"
QUARANTINE_EVENT = "rlmill.feedback.segment.quarantined"
READY_EVENT = "rlmill.feedback.window.ready"
DEPLOYMENT = "rl-feedback/consume"
CONSUMER = "rl-feedback"  # one name for every run: a crashed run's pending batch is the next run's first read
# A namespace for event ids: uuid5(namespace, segment URI) is the same for the same segment.
_EVENT_NS = uuid.UUID("5b0c6f2e-6a55-4d0a-9a7c-2f1d2f6b1e0a")


# ------------------------------------------------------------------------------------ events
def segment_event(segment: Segment, root: str) -> dict[str, Any]:
    """The keyword arguments of `prefect.events.emit_event` for one committed segment.

    >>> from gpu_jobs.online.consumer import SEGMENT_KIND
    >>> e = segment_event(Segment("/r/feedback/arith/2026-12-02-10/segment-evt-1/_MANIFEST.json",
    ...                           SEGMENT_KIND, "arith", "2026-12-02-10", answers=3, feedback=2), "/r")
    >>> e["event"], e["resource"]["prefect.resource.id"], e["payload"]["feedback"]
    ('rlmill.feedback.segment.committed', 'rlmill.model.arith', 2)
    """
    if segment.kind == QUARANTINE_KIND:
        name, resource = QUARANTINE_EVENT, {"prefect.resource.id": "rlmill.feedback.quarantine",
                                            "prefect.resource.name": "quarantined feedback events"}
    else:
        name, resource = SEGMENT_EVENT, {"prefect.resource.id": f"rlmill.model.{segment.model}",
                                         "prefect.resource.name": str(segment.model)}
    resource.update({"rlmill.root": root, "rlmill.segment": segment.uri, "rlmill.hour": segment.hour})
    payload = {"segment": segment.uri, "root": root, "model": segment.model, "hour": segment.hour,
               "answers": segment.answers, "feedback": segment.feedback, "quarantined": segment.quarantined,
               "reasons": dict(segment.reasons)}
    return {"event": name, "resource": resource, "payload": payload, "id": uuid.uuid5(_EVENT_NS, segment.uri)}


def _emit(segment: Segment, root: str) -> None:
    from prefect.events import emit_event

    emit_event(**segment_event(segment, root))


def ready_event(model: str, root: str, readiness: Any) -> dict[str, Any]:
    """The keyword arguments of `prefect.events.emit_event` announcing that `model`'s feedback
    window is ready (`readiness`: a gpu_jobs.online.windows.Readiness that holds).

    >>> from gpu_jobs.online.windows import readiness
    >>> e = ready_event("arith", "/r", readiness(300, 12.5, 256, 300.0))
    >>> e["event"], e["resource"]["prefect.resource.id"], e["payload"]["model"], e["payload"]["rows"]
    ('rlmill.feedback.window.ready', 'rlmill.model.arith', 'arith', 300)
    """
    return {"event": READY_EVENT,
            "resource": {"prefect.resource.id": f"rlmill.model.{model}", "prefect.resource.name": model,
                         "rlmill.root": root},
            "payload": {"model": model, "root": root, "rows": readiness.rows,
                        "oldest_age_s": readiness.oldest_age_s, "reason": readiness.reason}}


def feedback_models(root: str) -> list[str]:
    """The model folders under <root>/feedback/ (the quarantine folder is no model name)."""
    from storage import check_name, join, url_to_fs
    from storage.errors import InvalidNameError

    fs, path = url_to_fs(join(root, FEEDBACK_DIR))
    if not fs.exists(path):
        return []
    out = []
    for p in fs.ls(path, detail=False):
        try:
            out.append(check_name(p.rstrip("/").rsplit("/", 1)[-1], "model name"))
        except InvalidNameError:
            continue
    return sorted(out)


# ------------------------------------------------------------------------------------ artifacts
def _age(seconds: float | None) -> str:
    return "nothing waits" if seconds is None else f"{seconds:.1f} s"


def counts_table(result: ConsumeResult, before: GroupLag, after: GroupLag, quarantine_dir: str) -> list[dict]:
    """The drain's numbers as `what | value` rows (the rlmill-feedback-counts table artifact)."""
    rows = [("events read", result.read), ("answers committed", result.answers),
            ("feedback committed", result.feedback), ("duplicates skipped", result.duplicates),
            ("feedback stored with its answer's version (it named another)", result.versions_corrected),
            ("quarantined", result.quarantined),
            *((f"quarantined: {why}", n) for why, n in sorted(result.reasons.items())),
            ("segments committed", len(result.segments)),
            ("waiting before the drain (lag + pending)", _n(before.waiting)),
            ("waiting after the drain (lag + pending)", _n(after.waiting)),
            ("lag after: entries not yet delivered", _n(after.lag)),
            ("pending after: delivered, not acknowledged", after.pending),
            ("oldest pending entry's age", _age(after.oldest_pending_age_s)),
            ("oldest waiting entry's age", _age(after.oldest_waiting_age_s)),
            ("stream length", after.length), ("quarantine folder", quarantine_dir)]
    return [{"what": what, "value": value} for what, value in rows]


def _n(value: int | None) -> int | str:
    return "unknown (entries were deleted from the stream)" if value is None else value


def segments_table(segments: list[Segment]) -> list[dict]:
    """One row per committed segment (the rlmill-feedback-segments table artifact)."""
    return [{"kind": "quarantine" if s.kind == QUARANTINE_KIND else "data", "model": s.model or "",
             "hour": s.hour, "answers": s.answers, "feedback": s.feedback, "quarantined": s.quarantined,
             "reasons": "; ".join(f"{n} {why}" for why, n in sorted(s.reasons.items())), "manifest": s.uri}
            for s in segments]


def summary_markdown(result: ConsumeResult, after: GroupLag, segments: list[Segment], quarantine_dir: str) -> str:
    """A few lines a person reads first (the rlmill-feedback-summary markdown artifact)."""
    lines = [f"## Feedback drain: {result.read} event(s) read, {result.answers} answer(s) and {result.feedback} "
             f"feedback committed in {sum(s.kind != QUARANTINE_KIND for s in segments)} segment(s)", ""]
    if result.quarantined:
        lines += [f"**{result.quarantined} event(s) quarantined** under `{quarantine_dir}`:"]
        lines += [f"- {n} {why}" for why, n in sorted(result.reasons.items())] + [""]
    else:
        lines += [f"Nothing quarantined (quarantine folder: `{quarantine_dir}`).", ""]
    if result.duplicates:
        lines += [f"{result.duplicates} duplicate(s) skipped: redelivered or re-published events already committed.", ""]
    lines += [f"**Still waiting** for consumer group `{after.group}` of `{after.stream}`: {_n(after.waiting)} "
              f"(lag {_n(after.lag)}, pending {after.pending}); oldest waiting entry: "
              f"{_age(after.oldest_waiting_age_s)}."]
    if result.stopped_early:
        lines += ["", "The read window ended the run; the next scheduled run goes on from there."]
    lines += [f"- `{s.uri}`" for s in segments[:50]]
    return "\n".join(lines) + "\n"


def _artifacts(result: ConsumeResult, before: GroupLag, after: GroupLag, segments: list[Segment],
               quarantine_dir: str) -> None:
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    create_table_artifact(key=artifact_key(after.group, "counts"), table=counts_table(result, before, after,
                                                                                       quarantine_dir),
                          description="Feedback drain: events read, committed, skipped, quarantined; lag")
    create_table_artifact(key=artifact_key(after.group, "segments"), table=segments_table(segments),
                          description="Feedback segments committed by this run (manifest URIs)")
    create_markdown_artifact(key=artifact_key(after.group, "summary"),
                             markdown=summary_markdown(result, after, segments, quarantine_dir),
                             description="Feedback drain: summary")


# ------------------------------------------------------------------------------------ tasks
# Re-running a drain is harmless (pending entries first, committed ids skipped): retries cover a
# broker or storage blip. NO_CACHE: a drain must never be answered from a cached result.
@task(name="read-lag", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def read_lag(redis_url: str, stream: str, group: str) -> GroupLag:
    return group_lag(redis_url, stream=stream, group=group)


# Reading is harmless to repeat; an announcement sent twice starts at most one run (the retrain
# deployment's concurrency limit, and a run that finds nothing new ends at once).
@task(name="announce-ready", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def announce_ready(root: str, ready_rows: int, ready_after_s: float) -> dict[str, str]:
    """Emit READY_EVENT for every model whose feedback window is ready; returns model -> reason."""
    from prefect.events import emit_event

    from flows.online.retrain import window_readiness

    ready = {}
    for model in feedback_models(root):
        r = window_readiness(root, model, ready_rows, ready_after_s)
        if r.ready:
            emit_event(**ready_event(model, root, r))
            ready[model] = r.reason
    return ready


@task(name="drain", retries=2, retry_delay_seconds=5, cache_policy=NO_CACHE)
def drain(root: str, redis_url: str, stream: str, group: str, consumer: str,
          window_s: float) -> tuple[ConsumeResult, list[Segment]]:
    """consume() for at most `window_s` (0: until nothing waits); each committed segment is
    announced as a Prefect event as soon as it is committed, and returned."""
    segments: list[Segment] = []

    def committed(segment: Segment) -> None:
        segments.append(segment)
        _emit(segment, root)

    result = consume(root, redis_url, stream=stream, group=group, consumer=consumer, follow=window_s > 0,
                     max_s=window_s or None, on_segment=committed)
    return result, segments


# ------------------------------------------------------------------------------------ the flow
def check_inputs(root: Any, redis_url: Any, window_s: Any, consumer: Any, ready_rows: Any = 256,
                 ready_after_s: Any = 300.0) -> str | None:
    """What is wrong with the parameters, as one line with the fix; None when nothing is.

    >>> check_inputs(".rlmill", "redis://127.0.0.1:6379/0", -1, "rl-feedback")
    'window_s=-1: give the seconds a run keeps reading (>= 0; 0 reads what waits and ends)'
    """
    from storage.errors import InvalidNameError
    from storage.layout import check_root

    try:
        check_root(root)
    except InvalidNameError as exc:
        return f"{exc} (the root parameter)"
    if not isinstance(redis_url, str) or not redis_url.startswith(("redis://", "rediss://", "unix://")):
        shown = redact_url(redis_url) if isinstance(redis_url, str) else redis_url
        return f"redis_url={shown!r}: give the broker's URL, e.g. {DEFAULT_REDIS}"
    if (problem := url_password_problem(redis_url, "redis_url")) is not None:  # parameters show in the UI
        return problem
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not math.isfinite(window_s) \
            or window_s < 0:
        return f"window_s={window_s!r}: give the seconds a run keeps reading (>= 0; 0 reads what waits and ends)"
    if not isinstance(consumer, str) or not consumer.strip():
        return f"consumer={consumer!r}: give a name (keep it the same for every run, e.g. {CONSUMER!r})"
    if isinstance(ready_rows, bool) or not isinstance(ready_rows, int) or ready_rows < 0:
        return f"ready_rows={ready_rows!r}: give the feedback rows that start a retraining (an int >= 0; 0: never)"
    if isinstance(ready_after_s, bool) or not isinstance(ready_after_s, (int, float)) \
            or not math.isfinite(ready_after_s) or ready_after_s < 0:
        return f"ready_after_s={ready_after_s!r}: give the seconds the oldest untrained feedback may wait (>= 0)"
    return None


def _key_problem() -> str | None:
    """Why the worker's event key cannot be used (one line), or None; no key at all is one warning
    line. The drain reads the key from the worker's environment itself: a key passed as a
    parameter would show in the UI."""
    from gpu_jobs.online.signing import UNSIGNED_WARNING, SigningKeyError, event_key

    try:
        if event_key() is None:
            get_run_logger().warning("rlmill: %s", UNSIGNED_WARNING)
    except SigningKeyError as exc:
        return f"{exc} (in the worker's environment)"
    return None


def _unreachable(exc: BrokerUnreachable) -> str:
    return f"{exc}; in a deployment run: -p redis_url=<its URL>"


def _failed(line: str):
    from prefect.states import Failed

    get_run_logger().error("rlmill: %s", line)
    return Failed(message=line)


@flow(name="rl-feedback", log_prints=True)
def rl_feedback(root: str = ".rlmill", redis_url: str = DEFAULT_REDIS, window_s: float = 40.0,
                consumer: str = CONSUMER, stream: str = STREAM, group: str = GROUP, ready_rows: int = 256,
                ready_after_s: float = 300.0) -> dict[str, Any]:
    """Commit the answer and feedback events waiting on the stream as Parquet segments under
    <root>/feedback/ (see the module docstring for why one run per drain).

    root: storage root (folder or s3://); redis_url: the broker `rlmill serve` publishes to,
    without a password (set RLMILL_REDIS_PASSWORD in the worker's environment; events are checked
    with the worker's RLMILL_EVENT_KEY_FILE or RLMILL_EVENT_KEY, as serve signs them);
    window_s: how long the run keeps reading (it commits what waits, then events as they arrive;
    0 = read what waits and end); consumer: this consumer's name in the group -- keep it the same
    for every run, so a run reads what a crashed one left pending; stream, group: Redis names;
    ready_rows, ready_after_s: the retraining rule (module docstring): emit
    rlmill.feedback.window.ready for a model with at least ready_rows untrained feedback rows, or
    whose oldest waited ready_after_s seconds (ready_rows=0: never). A wrong parameter or an unreachable broker ends the run Failed with one line and the fix.
    """
    if (line := check_inputs(root, redis_url, window_s, consumer, ready_rows, ready_after_s)) is not None:
        return _failed(line)
    if (line := _key_problem()) is not None:
        return _failed(line)
    try:  # a broker that is not there at all is said at once; the tasks' retries are for blips
        connect(redis_url)
    except BrokerUnreachable as exc:
        return _failed(_unreachable(exc))
    from storage import join

    quarantine_dir = join(root, FEEDBACK_DIR, QUARANTINE_DIR)
    with tags("rlmill", "feedback"):
        try:
            before = read_lag(redis_url, stream, group)
            result, segments = drain(root, redis_url, stream, group, consumer, float(window_s))
            after = read_lag(redis_url, stream, group)
        except BrokerUnreachable as exc:
            return _failed(_unreachable(exc))
        _artifacts(result, before, after, segments, quarantine_dir)
        ready = announce_ready(root, ready_rows, float(ready_after_s)) if ready_rows else {}
    get_run_logger().info("%d event(s) read: %d answers and %d feedback committed in %d segment(s), %d duplicate(s) "
                          "skipped, %d quarantined; %s still waiting", result.read, result.answers, result.feedback,
                          sum(s.kind != QUARANTINE_KIND for s in segments), result.duplicates, result.quarantined,
                          _n(after.waiting))
    for model, why in ready.items():
        get_run_logger().info("feedback window of %s ready (%s): announced %s", model, why, READY_EVENT)
    return {"ready": ready, "read": result.read, "answers": result.answers, "feedback": result.feedback,
            "duplicates": result.duplicates, "versions_corrected": result.versions_corrected,
            "quarantined": result.quarantined, "reasons": dict(result.reasons),
            "segments": [s.uri for s in segments], "waiting": after.waiting, "lag": after.lag,
            "pending": after.pending, "oldest_waiting_age_s": after.oldest_waiting_age_s}


# ------------------------------------------------------------------------------------ the schedule
def set_schedule(active: bool, deployment: str = DEPLOYMENT) -> int:
    """Resume (active) or pause every schedule of `deployment` on the current Prefect API;
    returns how many. Deploying leaves rl-feedback's schedule paused (deployments/prefect.yaml)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    async def go() -> int:
        async with get_client() as client:
            try:
                d = await client.read_deployment_by_name(deployment)
            except ObjectNotFound:
                raise SystemExit(f"rlmill: no deployment {deployment!r} on this Prefect API: run `make deploy` "
                                 "first (or set PREFECT_API_URL to the server that has it)") from None
            for s in d.schedules:
                await client.update_deployment_schedule(d.id, s.id, active=active)
            return len(d.schedules)

    import httpx

    from prefect.settings import PREFECT_API_URL

    try:
        return asyncio.run(go())
    except httpx.HTTPError as exc:
        raise SystemExit(f"rlmill: the Prefect API at {PREFECT_API_URL.value()} does not answer "
                         f"({' '.join(str(exc).split())}): start it (make server) or set PREFECT_API_URL") from None


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m flows.online.feedback",
                                description="turn the rl-feedback deployment's schedule on or off")
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    sched = sub.add_parser("schedule", help="resume (on) or pause (off) the every-minute drain of rl-feedback/consume")
    sched.add_argument("state", choices=("on", "off"))
    sched.add_argument("--deployment", default=DEPLOYMENT, help=f"<flow>/<deployment> (default {DEPLOYMENT})")
    a = p.parse_args(argv)
    n = set_schedule(a.state == "on", a.deployment)
    print(f"rlmill: {n} schedule(s) of {a.deployment} {'resumed' if a.state == 'on' else 'paused'}", flush=True)


if __name__ == "__main__":
    main()

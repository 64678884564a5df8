"""The rl-feedback flow (flows/online/feedback.py) on a real redis-server and the test session's Prefect
server: what a drain commits, the artifacts (counts, quarantine, lag, segments) and the Prefect
events it emits, read back through the API; and consume()'s bound, callback and lag reading.

    .venv/bin/python -m pytest -q tests/serve/test_feedback_flow.py
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from gpu_jobs.online.answers import new_answer_id
from gpu_jobs.online.broker import GROUP, STREAM
from gpu_jobs.online.consumer import QUARANTINE_KIND, SEGMENT_KIND, consume, group_lag
from gpu_jobs.online.events import answer_event, encode, feedback_event


def _answer(model: str = "arith") -> dict:
    return answer_event(new_answer_id("chatcmpl"), endpoint="chat.completions", model=model, version="v1",
                        created=time.time(), latency_s=0.01, prompt=[{"role": "user", "content": "1+1="}],
                        prompt_ids=[5, 6], choices=[{"index": 0, "text": "2", "token_ids": [7], "logprobs": [-0.5],
                                                     "finish_reason": "stop"}], sampling={"temperature": 1.0})


def _xadd(client, *events: dict) -> list[str]:
    return [client.xadd(STREAM, encode(e)).decode() for e in events]


class Crash(Exception):
    """Raised between a batch's commit and its XACK: a consumer that died there."""


def _crash(result) -> None:
    raise Crash(result.segments)


def test_bounded_drain_reports_segments_and_lag(redis_url, tmp_path):
    import redis

    from gpu_jobs.online.consumer import id_time_of_stream

    r = redis.Redis.from_url(redis_url)
    a = _answer()
    ids = _xadd(r, a, feedback_event(a["answer_id"], model="arith", version="v1", thumbs="up"),
                {**feedback_event(a["answer_id"], model="arith", version="v1"), "thumbs": "sideways"})
    t0 = id_time_of_stream(ids[0])
    before = group_lag(redis_url, now=t0 + 7.0)  # no group yet: everything waits
    assert (before.group_exists, before.length, before.waiting, before.pending) == (False, 3, 3, 0)
    assert before.oldest_waiting_age_s == pytest.approx(7.0, abs=1e-3)

    seen = []
    with pytest.raises(Crash):  # committed, not acknowledged
        consume(str(tmp_path), redis_url, consumer="c1", on_segment=seen.append, after_commit=_crash)
    assert [(s.kind, s.model, s.answers, s.feedback, s.quarantined) for s in seen] == \
        [(SEGMENT_KIND, "arith", 1, 1, 0), (QUARANTINE_KIND, None, 0, 0, 1)]
    assert seen[1].reasons == {"thumbs 'sideways' is not 'up' or 'down'": 1}
    crashed = group_lag(redis_url, now=t0 + 9.0)
    assert (crashed.lag, crashed.pending, crashed.waiting, crashed.consumers) == (0, 3, 3, {"c1": 3})
    assert crashed.oldest_pending_age_s == pytest.approx(9.0, abs=1e-3)

    # Redelivered to the same consumer under a bound: each event skipped, no segment announced again;
    # a bound far smaller than one read still drains what waits (the check comes after a read).
    again = consume(str(tmp_path), redis_url, consumer="c1", follow=True, max_s=1e-6, on_segment=seen.append)
    assert again.stopped_early and (again.read, again.duplicates, again.segments) == (3, 3, [])
    assert len(seen) == 2
    after = group_lag(redis_url)
    assert (after.lag, after.pending, after.waiting, after.oldest_waiting_age_s) == (0, 0, 0, None)
    with pytest.raises(ValueError, match="max_s=0"):
        consume(str(tmp_path), redis_url, max_s=0)


# ------------------------------------------------------------------------------------ the flow
def _api(fn):
    """fn(client) with a client of the current Prefect API (the session's server)."""
    from prefect.client.orchestration import get_client

    async def go():
        async with get_client() as client:
            return await fn(client)

    return asyncio.run(go())


def _artifacts(flow_run_id) -> dict:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    arts = _api(lambda c: c.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))))
    # A table artifact's data comes back as the JSON text of its rows.
    return {a.key: json.loads(a.data) if a.type == "table" else a.data for a in arts}


def _events(flow_run_id, expected: int, timeout_s: float = 60.0) -> list:
    """The rlmill.feedback.* events related to the flow run, once the server stored `expected`."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()  # sent from this process: out of its queue before we look
    flt = EventFilter(event=EventNameFilter(prefix=["rlmill.feedback."]),
                      related=EventRelatedFilter(id=[f"prefect.flow-run.{flow_run_id}"]))
    deadline = time.monotonic() + timeout_s
    while True:
        found = _api(lambda c: c.read_events(filter=flt, limit=50)).events
        if len(found) >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.mark.prefect
def test_flow_run_artifacts_and_events(redis_url, tmp_path):
    import redis

    from flows.online.feedback import CONSUMER, QUARANTINE_EVENT, SEGMENT_EVENT, rl_feedback

    r = redis.Redis.from_url(redis_url)
    root = str(tmp_path / "store")
    first = _answer()
    _xadd(r, first, feedback_event(first["answer_id"], model="arith", version="v1", score=0.75))
    with pytest.raises(Crash):  # an earlier run of the flow died between commit and XACK
        consume(root, redis_url, consumer=CONSUMER, after_commit=_crash)
    second = _answer()
    _xadd(r, second, feedback_event(second["answer_id"], model="arith", version="v1", thumbs="down"),
          second,  # published twice (a publisher retry whose first reply was lost)
          {**feedback_event(second["answer_id"], model="arith", version="v1"), "score": 2.0})

    state = rl_feedback(root=root, redis_url=redis_url, window_s=0, return_state=True)
    assert state.is_completed(), state
    out = state.result()
    assert (out["read"], out["answers"], out["feedback"], out["duplicates"], out["quarantined"]) == (6, 1, 1, 3, 1)
    assert (out["waiting"], out["pending"]) == (0, 0)

    run_id = state.state_details.flow_run_id
    arts = _artifacts(run_id)
    assert set(arts) == {f"{GROUP}-counts", f"{GROUP}-segments", f"{GROUP}-summary"}
    counts = {row["what"]: row["value"] for row in arts[f"{GROUP}-counts"]}
    assert counts["events read"] == 6 and counts["answers committed"] == 1 and counts["feedback committed"] == 1
    assert counts["duplicates skipped"] == 3 and counts["quarantined"] == 1
    assert counts["quarantined: score 2.0 is outside [0, 1]"] == 1
    assert counts["waiting before the drain (lag + pending)"] == 6  # 2 pending (the crash) + 4 new
    assert counts["waiting after the drain (lag + pending)"] == 0 and counts["pending after: delivered, not acknowledged"] == 0
    quarantine_dir = f"{root}/feedback/_quarantine"
    assert counts["quarantine folder"] == quarantine_dir
    segments = arts[f"{GROUP}-segments"]
    assert [(s["kind"], s["model"], s["answers"], s["feedback"], s["quarantined"]) for s in segments] == \
        [("data", "arith", 1, 1, 0), ("quarantine", "", 0, 0, 1)]
    assert segments[1]["manifest"].startswith(quarantine_dir) and "outside [0, 1]" in segments[1]["reasons"]
    assert out["segments"] == [s["manifest"] for s in segments]
    summary = arts[f"{GROUP}-summary"]
    assert "1 event(s) quarantined" in summary and quarantine_dir in summary and "score 2.0" in summary

    events = _events(run_id, expected=2)
    by_name = {e.event: e for e in events}
    assert sorted(by_name) == sorted([QUARANTINE_EVENT, SEGMENT_EVENT]) and len(events) == 2, [e.event for e in events]
    committed = by_name[SEGMENT_EVENT]
    assert committed.resource.id == "rlmill.model.arith" and committed.resource["rlmill.root"] == root
    assert (committed.payload["answers"], committed.payload["feedback"]) == (1, 1)
    assert committed.payload["segment"] == segments[0]["manifest"]
    assert committed.id == uuid.uuid5(uuid.UUID("5b0c6f2e-6a55-4d0a-9a7c-2f1d2f6b1e0a"), segments[0]["manifest"])
    assert by_name[QUARANTINE_EVENT].payload["reasons"] == {"score 2.0 is outside [0, 1]": 1}


@pytest.mark.prefect
def test_flow_input_errors_are_one_line(tmp_path):
    from flows.online.feedback import rl_feedback
    from tests.servers import free_port

    dead = f"redis://127.0.0.1:{free_port()}/0"
    state = rl_feedback(root=str(tmp_path), redis_url=dead, window_s=0, return_state=True)
    assert state.is_failed() and "\n" not in state.message
    assert f"the event broker at {dead} does not answer" in state.message and "-p redis_url=" in state.message
    state = rl_feedback(root=str(tmp_path), redis_url="localhost:6379", return_state=True)
    assert state.is_failed() and state.message.startswith("redis_url='localhost:6379': give the broker's URL")


@pytest.mark.prefect
def test_schedule_on_and_off(capsys):
    import datetime as dt

    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import IntervalSchedule

    from flows.online.feedback import main, rl_feedback

    name = f"schedule-test-{uuid.uuid4().hex[:8]}"  # on the session's server, which no worker polls

    async def create(c):
        flow_id = await c.create_flow_from_name(rl_feedback.name)
        return await c.create_deployment(flow_id, name, entrypoint="flows/online/feedback.py:rl_feedback", schedules=[
            DeploymentScheduleCreate(schedule=IntervalSchedule(interval=dt.timedelta(seconds=60)), active=False)])

    deployment_id = _api(create)
    full = f"{rl_feedback.name}/{name}"
    try:
        for state, active in (("on", True), ("off", False)):
            main(["schedule", state, "--deployment", full])
            (sched,) = _api(lambda c: c.read_deployment(deployment_id)).schedules
            assert sched.active is active
        assert "1 schedule(s) of rl-feedback/schedule-test-" in capsys.readouterr().out
        with pytest.raises(SystemExit, match="rlmill: no deployment 'rl-feedback/nope'.*make deploy"):
            main(["schedule", "on", "--deployment", "rl-feedback/nope"])
    finally:
        _api(lambda c: c.delete_deployment(deployment_id))


def test_a_following_consumer_waits_out_a_broker_restart(tmp_path, caplog):
    """`consume(follow=True)` (rlmill feedback consume --follow) outlives its broker: SIGKILLed after
    the first segment committed and started again on the same port and data (appendfsync always),
    the consumer says so, retries, and commits what arrives after it once, nothing twice."""
    import shutil
    import subprocess
    import threading

    import redis

    from tests.servers import free_port, stop_process

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed: bash scripts/ensure_test_tools.sh installs it")
    port, data = free_port(), tmp_path / "redis"
    data.mkdir()
    url = f"redis://127.0.0.1:{port}/0"

    def start() -> subprocess.Popen:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
                                 "--appendfsync", "always", "--dir", str(data)], stdout=subprocess.DEVNULL)
        client, deadline = redis.Redis.from_url(url), time.monotonic() + 30
        while True:
            try:
                client.ping()
                return proc
            except redis.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start in 30 s"
                time.sleep(0.05)

    broker = start()
    first_segment, done, root, results = threading.Event(), threading.Event(), str(tmp_path / "root"), []
    follower = threading.Thread(target=lambda: results.append(consume(
        root, url, follow=True, block_ms=100, on_segment=lambda s: first_segment.set(), stop=done)), daemon=True)
    try:
        before = [_answer() for _ in range(3)]
        _xadd(redis.Redis.from_url(url), *before)
        with caplog.at_level("WARNING", logger="rlmill.feedback"):
            follower.start()
            assert first_segment.wait(60), "the consumer committed no segment in 60 s"
            broker.kill()
            broker.wait()
            deadline = time.monotonic() + 30
            while not any("went away" in r.getMessage() for r in caplog.records):  # it noticed, and waits
                assert time.monotonic() < deadline, "the consumer never said the broker went away"
                time.sleep(0.05)
            broker = start()
            after = [_answer() for _ in range(2)]
            _xadd(redis.Redis.from_url(url), *after)
            from gpu_jobs.online.consumer import FEEDBACK_DIR, segment_manifests

            wanted, deadline = {e["event_id"] for e in before + after}, time.monotonic() + 60
            while True:
                ids = [i for m in segment_manifests(f"{root}/{FEEDBACK_DIR}/arith") for i in m.extra["event_ids"]]
                if set(ids) >= wanted:
                    break
                assert time.monotonic() < deadline, f"committed {len(ids)} of {len(wanted)} events in 60 s"
                time.sleep(0.1)
            assert sorted(ids) == sorted(wanted)  # each once
            while not any("is back after" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the consumer never said the broker was back"
                time.sleep(0.05)
    finally:
        done.set()
        follower.join(30)
        stop_process(broker)
    assert results and results[0].answers == 5 and results[0].stopped_early


def test_the_stream_gate_is_great_expectations_over_each_check():
    """One batch with good and bad events: the gate (storage.quality.run_gate) refuses exactly the
    bad ones, each with its check's own reason; the derived columns say which check failed."""
    from gpu_jobs.online.consumer import gate
    from gpu_jobs.online.events import gate_columns

    good = _answer()
    fb = feedback_event(good["answer_id"], model="arith", version="v1", score=0.5)
    bad = [{**fb, "event_id": new_answer_id("evt"), "score": 2.0}, {**good, "version": ""}, {"kind": "vote"},
           {**_answer(), "model": "../escape"}, ["not", "an", "event"]]
    now_ms = int(time.time() * 1000)  # stream ids carry the entry's time, the reference for `created`
    entries = [(f"{now_ms}-{i}", e) for i, e in enumerate([good, fb, *bad])]
    refused = gate(entries)
    assert sorted(refused) == [2, 3, 4, 5, 6]
    assert refused[2] == "score 2.0 is outside [0, 1]" and refused[3] == "no version"
    assert refused[4].startswith("unknown kind 'vote'") and refused[6] == "not an event object (list)"
    cols = gate_columns([e for _, e in entries])
    assert cols["dq_body_ok"][:3] == [True, True, False] and cols["dq_score"][2] == 2.0
    assert cols["dq_ids_ok"][3] is False and cols["dq_model_ok"][3] is None  # not run after a failure
    assert gate(entries[:2]) == {}

"""Serving under faults: real `rlmill serve` and `rlmill feedback consume --follow` processes, a
real redis-server, a client that records every answer it got, and an audit of the committed log.

    .venv/bin/python -m benchmarks.chaos --only broker-down,serve-kill-in-flight
    .venv/bin/python -m benchmarks.chaos.serve_runs consume --root R --redis URL --follow   # the consumer,
        # with RLMILL_SERVE_FAILPOINT=feedback:before-commit armed (held until the harness kills it)

Each row drives the processes as a user does (`python -m flows.cli serve ...`), so whatever serve
and the consumer do today is what is measured. A fault happens at a named point: after the client
has seen N answers, or at a failpoint in the consumer. Every row ends with `audit_answers`: every
request the client got a 200 for is in the committed log exactly once, or is counted in serve's
drop count (/metrics); no event is committed twice.

The broker runs with `--appendonly yes --appendfsync always`: a broker that restarts keeps its
stream and consumer group, as a production Redis would; what a non-persistent one forgets is not
a fault of rlmill's.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .harness import Chaos, Outcome
from .serve_stack import (AFTER_COMMIT, BEFORE_COMMIT, START_S, AnswerAudit, Client, Proc, RedisServer,
                          ServeProcess, audit_answers, committed_ids, consumer, orphan_files, published_all,
                          stream_drained, wait_until)

DRAIN_S = 120.0  # storage's retry waits up to 30 s between tries after an S3 outage


# ------------------------------------------------------------------------------ the rows
@dataclass
class Stack:
    """redis-server, serve and the consumer of one row, under `work`, storing under `root`."""

    work: Path
    root: str
    redis: RedisServer
    serve: ServeProcess
    consumer_env: dict[str, str]
    consumer: Proc | None = None

    def start_consumer(self, failpoint: str | None = None) -> Proc:
        self.consumer = consumer(self.work, self.root, self.redis.url, failpoint, self.consumer_env).start()
        return self.consumer

    def drain(self, timeout: float = DRAIN_S) -> None:
        """serve's queue empty, then every stream entry committed and acked (bounded waits)."""
        wait_until("serve's publisher to send or count every event", lambda: published_all(self.serve), timeout,
                   self.serve, step=0.2)
        wait_until("the consumer to commit and ack every stream entry", lambda: stream_drained(self.redis.url),
                   timeout, self.consumer, step=0.2)

    def close(self) -> None:
        for p in (self.consumer, self.serve, self.redis):
            if p is not None:
                p.stop()


@contextlib.contextmanager
def stack(chaos: Chaos, name: str, *, queue_size: int = 10_000, root: str | None = None,
          consumer_env: dict[str, str] | None = None, serve_args: tuple[str, ...] = (), api_key: str | None = None):
    work = chaos.work / name
    work.mkdir(parents=True, exist_ok=True)
    env = {"PREFECT_API_URL": chaos.api_url} if chaos.api_url else {}  # should the consumer run a flow
    redis = RedisServer(work).start()
    serve = ServeProcess(work, redis.url, queue_size=queue_size, model_args=serve_args, api_key=api_key)
    s = Stack(work, root or str(work / "store"), redis, serve, {**env, **(consumer_env or {})})
    try:
        s.serve.start()
        yield s
    finally:
        s.close()


def _row(fault: str, what: str, audit: AnswerAudit, ok: bool) -> Outcome:
    recovered = ok and audit.data_lost == 0
    return Outcome(fault, f"{what}; {audit.line()}", recovered, audit.data_lost)


def broker_down(chaos: Chaos, fault: str, outage_s: float = 40.0, before: int = 50, after: int = 50,
                queue_size: int = 32, concurrency: int = 4) -> Outcome:
    """Kill redis-server after `before` answers; keep asking for `outage_s`; start it again on
    the same port; `after` more answers; drain; audit (missing answers must equal serve's drops).
    The queue is small so that it overflows in 40 s even on a loaded box (~3 answers/s)."""
    with stack(chaos, "broker-down", queue_size=queue_size) as s:
        s.start_consumer()
        client = Client(s.serve.base, concurrency).start()
        try:
            client.wait_answers(before, START_S, "before the outage")
            s.redis.kill()
            at_kill, t_down = client.count(), time.monotonic()
            time.sleep(outage_s)  # the outage's length is the fault itself, not a wait for an event
            during = client.count() - at_kill
            consumer_died = not s.consumer.alive
            s.redis.start()
            up = time.monotonic() - t_down
            if consumer_died:  # what a supervisor (systemd, the Prefect deployment) would do
                s.start_consumer()
            client.wait_answers(client.count() + after, START_S, "after the broker came back")
        finally:
            client.stop()
        s.drain()
        m = s.serve.metrics()
        dropped = int(m.get("rlmill_serve_events_dropped_total", 0))
        said = "dropped 1 event(s)" in s.serve.text()
        audit = audit_answers(s.root, client.ids, dropped)
    consumer_note = ("the consumer exited when the broker went away and was started again after" if consumer_died
                     else "the consumer kept running")
    told = ("" if not dropped else " and logged" if said else " but NOT logged")
    what = (f"redis SIGKILLed after {at_kill} answers, back {up:.0f} s later; serve answered {during} requests "
            f"meanwhile ({sum(client.errors.values())} errors), queue {queue_size}: {dropped} events dropped, "
            f"counted on /metrics{told}; {consumer_note}")
    # A consumer that dies with the broker needed someone to start it again: not recovered on its own.
    ok = during > queue_size and dropped > 0 and said and len(audit.missing) == dropped and not consumer_died
    return _row(fault, what, audit, ok)


def consumer_kill(chaos: Chaos, fault: str, failpoint: str, before: int = 40, after: int = 40,
                  concurrency: int = 4) -> Outcome:
    """`before` answers wait in the stream; an armed consumer takes them and is SIGKILLed at
    `failpoint`; a plain consumer starts again; `after` more answers; drain; audit."""
    name = "consumer-kill-" + failpoint.split(":")[1]
    with stack(chaos, name) as s:
        client = Client(s.serve.base, concurrency).start()
        try:
            client.wait_answers(before, START_S, "waiting in the stream")
            armed = s.start_consumer(failpoint)
            if failpoint == BEFORE_COMMIT:
                marker = Path(armed.env["RLMILL_FAILPOINT_MARKER"])
                wait_until(f"the consumer to reach {failpoint}", marker.exists, START_S, armed, step=0.05)
                armed.kill()
            else:  # the product's failpoint: the process SIGKILLs itself after the commit
                wait_until(f"the consumer to kill itself at {failpoint}", lambda: not armed.alive, START_S, step=0.05)
            rc, orphans = armed.proc.returncode, orphan_files(s.root)
            committed_at_kill = sum(committed_ids(s.root)[0].values())
            s.start_consumer()
            client.wait_answers(client.count() + after, START_S, "after the consumer restarted")
        finally:
            client.stop()
        s.drain()
        audit = audit_answers(s.root, client.ids, int(s.serve.metrics().get("rlmill_serve_events_dropped_total", 0)))
    what = (f"consumer SIGKILLed at {failpoint} (exit {rc}; {committed_at_kill} answers committed, "
            f"{orphans} segment file(s) without a manifest left by the kill); restarted, redelivered, deduplicated")
    return _row(fault, what, audit, rc == -signal.SIGKILL)


def serve_kill(chaos: Chaos, fault: str, before: int = 50, after: int = 50, concurrency: int = 8) -> Outcome:
    """SIGKILL serve after `before` answers while the client keeps `concurrency` requests in
    flight; start it again on the same port; `after` more answers; drain; audit."""
    with stack(chaos, "serve-kill") as s:
        s.start_consumer()
        client = Client(s.serve.base, concurrency).start()
        try:
            client.wait_answers(before, START_S, "before the kill")
            in_flight, at_kill = client.in_flight, client.count()
            s.serve.kill()
            t_kill, tries = time.monotonic(), restart_on_same_port(s.serve)
            restarted = time.monotonic() - t_kill
            client.wait_answers(client.count() + after, START_S, "after serve restarted")
        finally:
            client.stop()
        s.drain()
        audit = audit_answers(s.root, client.ids, int(s.serve.metrics().get("rlmill_serve_events_dropped_total", 0)))
    port = (f"restarted on the same port at once" if tries == 1 else
            f"restarted on the same port after {tries} tries, {restarted:.0f} s (serve refused the port while "
            "the killed server's connections were in TIME_WAIT)")
    what = (f"serve SIGKILLed after {at_kill} answers with {in_flight} request(s) in flight "
            f"(client errors: {', '.join(f'{n} {k}' for k, n in client.errors.most_common(3))}); {port}")
    return _row(fault, what, audit, in_flight > 0)


def restart_on_same_port(serve: ServeProcess, delay_s: float = 1.0) -> int:
    """Start `serve` again as a supervisor would (systemd Restart=on-failure, RestartSec=1): again
    after `delay_s` while it refuses its port; returns the tries it took."""
    t0 = time.monotonic()
    for tries in itertools.count(1):
        try:
            serve.start()
            return tries
        except RuntimeError as exc:
            if "cannot listen" not in str(exc) or time.monotonic() - t0 > START_S:
                raise
            time.sleep(delay_s)
    raise AssertionError("unreachable")


def s3_down(chaos: Chaos, fault: str, outage_s: float = 40.0, before: int = 40, after: int = 40,
            concurrency: int = 4) -> Outcome:
    """Feedback stored on S3 (moto on loopback): once the consumer has committed a segment there,
    stop the endpoint for `outage_s` with traffic going on; start it again; drain; audit."""
    import s3fs

    from storage import StorageConfig

    from .scenarios import _moto

    with _moto() as (endpoint, box, restart):
        bucket = f"serve-chaos-{int(time.time())}"
        s3fs.S3FileSystem(key="chaos", secret="chaos", client_kwargs={"endpoint_url": endpoint}).mkdir(bucket)
        creds = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "chaos", "AWS_SECRET_ACCESS_KEY": "chaos"}
        storage = StorageConfig(endpoint_url=endpoint, key="chaos", secret="chaos")
        root = f"s3://{bucket}/rl"
        with stack(chaos, "s3-down", root=root, consumer_env=creds) as s:
            s.start_consumer()
            client = Client(s.serve.base, concurrency).start()
            try:
                client.wait_answers(before, START_S, "before the outage")
                wait_until("the consumer's first segment on S3", lambda: committed_ids(root, storage=storage)[0],
                           START_S, s.consumer, step=0.2)
                box["server"].stop()
                at_stop, t_down = client.count(), time.monotonic()
                time.sleep(outage_s)  # the outage's length is the fault itself
                during, alive = client.count() - at_stop, s.consumer.alive
                restart()
                up = time.monotonic() - t_down
                client.wait_answers(client.count() + after, START_S, "after S3 came back")
            finally:
                client.stop()
            s.drain()
            audit = audit_answers(root, client.ids, int(s.serve.metrics().get("rlmill_serve_events_dropped_total", 0)),
                                  storage=storage)
            retried = s.consumer.text().count("retry")
    what = (f"S3 endpoint stopped after {at_stop} answers, back {up:.0f} s later; serve answered {during} "
            f"meanwhile; the consumer {'kept running (storage backoff)' if alive else 'DIED'}, "
            f"{retried} retry line(s) in its log")
    return _row(fault, what, audit, alive)


ROWS = {
    "broker-down": ("Redis broker SIGKILLed for 40 s under load: serve keeps answering, bounded queue drops "
                    "and counts", broker_down),
    "consumer-kill-before-commit": ("feedback consumer SIGKILLed mid-segment: files written, manifest not",
                                    lambda chaos, fault: consumer_kill(chaos, fault, BEFORE_COMMIT)),
    "consumer-kill-after-commit": ("feedback consumer SIGKILLed between a segment's commit and its XACK",
                                   lambda chaos, fault: consumer_kill(chaos, fault, AFTER_COMMIT)),
    "serve-kill-in-flight": ("rlmill serve SIGKILLed with requests in flight, restarted", serve_kill),
    "s3-down-consumer": ("S3 endpoint down 40 s with the feedback consumer running", s3_down),
}


# ------------------------------------------------------------------------------ armed consumer
def _arm_before_commit(marker: str) -> None:
    """Hold the consumer (until the harness kills it) when it commits a feedback segment: its
    files are written, its manifest is not. Wraps storage.commit, which the consumer calls."""
    import storage

    from flows.failpoints import hold
    from gpu_jobs.online.consumer import SEGMENT_KIND

    real = storage.commit

    def commit(dest, files, *a, **kw):
        if kw.get("kind") == SEGMENT_KIND:
            hold(marker)
        return real(dest, files, *a, **kw)

    storage.commit = commit


def main(argv: list[str]) -> None:
    if not argv or argv[0] != "consume":
        sys.exit("usage: python -m benchmarks.chaos.serve_runs consume <rlmill feedback consume options>")
    spec, marker = os.environ.get("RLMILL_SERVE_FAILPOINT"), os.environ.get("RLMILL_FAILPOINT_MARKER")
    if spec not in (None, BEFORE_COMMIT):
        sys.exit(f"RLMILL_SERVE_FAILPOINT={spec!r} is not known here; known: {BEFORE_COMMIT}")
    if spec:
        if not marker:
            sys.exit("RLMILL_SERVE_FAILPOINT needs RLMILL_FAILPOINT_MARKER (the file to touch when it is hit)")
        _arm_before_commit(marker)
    from flows.cli import main as cli

    cli(["feedback", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])

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

import asyncio
import contextlib
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .harness import REPO, Chaos, Outcome

MODEL = "builtin"
# Consumer failpoints installed by this module's `consume` entry point; the product's own
# feedback:after-commit (flows/cli_serve.py) needs no wrapper.
BEFORE_COMMIT = "feedback:before-commit"  # segment files written, manifest not yet
AFTER_COMMIT = "feedback:after-commit"    # manifest written, entries not yet XACKed
START_S = 120.0  # a serve process loads its model in seconds; 2 busy cores can make it much longer
DRAIN_S = 120.0  # storage's retry waits up to 30 s between tries after an S3 outage


# ------------------------------------------------------------------------------ processes
class Proc:
    """A child process in a session of its own, output to a log file, stopped by its pid."""

    def __init__(self, name: str, cmd: list[str], work: Path, env: dict[str, str] | None = None):
        self.name, self.cmd, self.env = name, cmd, env
        self.log = work / f"{name}-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Proc":
        self.log = self.log.with_name(f"{self.name}-{time.monotonic_ns()}.log")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process and its group (what the OOM killer or `kill -9` does)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, grace: float = 10.0) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill()
        elif self.proc is not None:
            self.kill()  # its group may outlive it

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, n: int = 3) -> str:
        lines = [ln.strip() for ln in self.text().splitlines() if ln.strip()]
        return " | ".join(lines[-n:])[:300]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RLMILL_FAILPOINT", "RLMILL_SERVE_FAILPOINT")) and k != "MASTER_PORT"}
    env["PYTHONPATH"] = str(REPO)
    return {**env, **(extra or {})}


def wait_until(what: str, check, timeout: float, proc: Proc | None = None, step: float = 0.1):
    """Poll `check()` until it returns something true; TimeoutError names `what` (and a process
    that exited meanwhile, with its last lines)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if proc is not None and not proc.alive:
            raise RuntimeError(f"{proc.name} exited ({proc.proc.returncode}) while waiting for {what}: {proc.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


class RedisServer(Proc):
    """redis-server on 127.0.0.1:`port`, append-only file fsynced on every write (restarts keep data)."""

    def __init__(self, work: Path, port: int | None = None):
        from tests.servers import free_port

        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not installed: bash scripts/ensure_test_tools.sh installs it")
        self.port = port or free_port()
        data = work / f"redis-{self.port}"
        data.mkdir(parents=True, exist_ok=True)
        super().__init__("redis", [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "yes", "--appendfsync", "always", "--dir", str(data)], work)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        import redis

        super().start()
        client = redis.Redis.from_url(self.url, socket_timeout=1)

        def ping() -> bool:
            try:
                return bool(client.ping())
            except (redis.ConnectionError, redis.TimeoutError):
                return False

        wait_until(f"redis-server on port {self.port} to answer PING", ping, 30, self, step=0.05)
        return self


class ServeProcess(Proc):
    """`python -m flows.cli serve` on a free port; `model_args` e.g. ["--model", "m", "--root", r]."""

    def __init__(self, work: Path, redis_url: str, *, queue_size: int = 10_000, model_args: tuple[str, ...] = (),
                 port: int | None = None, env: dict[str, str] | None = None):
        from tests.servers import free_port

        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        super().__init__(f"serve-{self.port}", [sys.executable, "-m", "flows.cli", "serve", "--port", str(self.port),
                                                "--redis", redis_url, "--queue-size", str(queue_size), *model_args],
                         work, child_env(env))

    def start(self, timeout: float = START_S) -> "ServeProcess":
        import httpx

        super().start()

        def healthy() -> bool:
            try:
                return httpx.get(f"{self.base}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(f"serve on port {self.port} to answer GET /health", healthy, timeout, self, step=0.2)
        return self

    def metrics(self) -> dict[str, float]:
        import httpx

        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        return {k: float(v) for k, v in (ln.split() for ln in text.splitlines() if ln.strip())}


def consumer(work: Path, root: str, redis_url: str, failpoint: str | None = None,
             env: dict[str, str] | None = None) -> Proc:
    """`feedback consume --follow`, as users start it; with `failpoint`, armed (see the module doc)."""
    args = ["feedback", "consume", "--root", root, "--redis", redis_url, "--follow"]
    extra = dict(env or {})
    if failpoint == BEFORE_COMMIT:
        extra.update(RLMILL_SERVE_FAILPOINT=failpoint, RLMILL_FAILPOINT_MARKER=str(work / f"marker-{time.monotonic_ns()}"))
        cmd = [sys.executable, "-m", "benchmarks.chaos.serve_runs", "consume", *args[2:]]
    else:
        if failpoint == AFTER_COMMIT:
            extra["RLMILL_FAILPOINT"] = failpoint  # flows/cli_serve.py kills the process itself there
        cmd = [sys.executable, "-m", "flows.cli", *args]
    return Proc("consumer", cmd, work, child_env(extra))


def stream_drained(redis_url: str) -> bool:
    """Every entry of the stream delivered to the consumer group and acknowledged (committed)."""
    from gpu_jobs.serve.broker import GROUP, STREAM, connect

    try:
        groups = connect(redis_url, check=False).xinfo_groups(STREAM)
    except Exception:  # noqa: BLE001 - broker not back yet, or the stream not created yet
        return False
    for g in groups:
        name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
        if name == GROUP:
            return g["pending"] == 0 and g.get("lag") == 0
    return False


def published_all(serve: ServeProcess) -> bool:
    """serve's publisher holds nothing: every event it made was XADDed or counted as dropped."""
    m = serve.metrics()
    made = m.get("rlmill_serve_answers_total", 0) + m.get("rlmill_serve_feedback_total", 0)
    done = m.get("rlmill_serve_events_published_total", 0) + m.get("rlmill_serve_events_dropped_total", 0)
    return m.get("rlmill_serve_events_queued", 0) == 0 and done >= made


# ------------------------------------------------------------------------------ the client
@dataclass
class Answer:
    answer_id: str
    done: float      # time.monotonic() when the 200 arrived
    latency_s: float


class Client:
    """`concurrency` asyncio workers (httpx) in a thread of their own, each sending the next
    completion as soon as the last one returned (a closed loop); every 200 is recorded with its
    answer id. Connection errors (a server down) are counted and retried after 50 ms.

        client = Client(base, concurrency=4).start()
        client.wait_answers(50, timeout=60)
        client.stop()
    """

    def __init__(self, base: str, concurrency: int = 4, max_tokens: int = 6, seed: int = 0):
        self.base, self.concurrency, self.max_tokens, self.seed = base, concurrency, max_tokens, seed
        self.answers: list[Answer] = []
        self.errors: Counter = Counter()
        self.in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="bench-client", daemon=True)

    def start(self) -> "Client":
        self._thread.start()
        return self

    def stop(self, timeout: float = 120.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the client's requests did not end within {timeout:.0f} s of stop()")

    @property
    def ids(self) -> list[str]:
        with self._lock:
            return [a.answer_id for a in self.answers]

    def count(self) -> int:
        with self._lock:
            return len(self.answers)

    def wait_answers(self, n: int, timeout: float, what: str = "") -> None:
        wait_until(f"{n} answers{' ' + what if what else ''} (got {self.count()})", lambda: self.count() >= n,
                   timeout, step=0.02)

    async def _main(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(base_url=self.base, timeout=120, limits=limits) as http:
            await asyncio.gather(*(self._worker(http, random.Random(self.seed * 1000 + w))
                                   for w in range(self.concurrency)))

    async def _worker(self, http, rng: random.Random) -> None:
        import httpx

        while not self._stop.is_set():
            body = {"prompt": f"{rng.randrange(10, 50)}+{rng.randrange(10, 50)}=", "max_tokens": self.max_tokens,
                    "temperature": 0}
            t0 = time.monotonic()
            with self._lock:
                self.in_flight += 1
            try:
                r = await http.post("/v1/completions", json=body)
            except httpx.HTTPError as exc:
                self.errors[type(exc).__name__] += 1
                await asyncio.sleep(0.05)
                continue
            finally:
                with self._lock:
                    self.in_flight -= 1
            if r.status_code == 200:
                with self._lock:
                    self.answers.append(Answer(r.json()["id"], time.monotonic(), time.monotonic() - t0))
            else:
                self.errors[f"HTTP {r.status_code}"] += 1
                await asyncio.sleep(0.05)


# ------------------------------------------------------------------------------ the audit
@dataclass
class AnswerAudit:
    """Answered requests against the committed log of `model`."""

    answered: int
    committed: int                 # distinct answer ids in committed segments
    missing: list[str] = field(default_factory=list)     # answered, not committed
    duplicated: list[str] = field(default_factory=list)  # answer or event ids committed more than once
    dropped: int = 0               # what serve counted as dropped (its /metrics)
    extra: int = 0                 # committed, but the client never got the 200 (in flight at a kill)

    @property
    def lost(self) -> int:
        """Answered, not committed, and more than serve's drop count can account for."""
        return max(0, len(self.missing) - self.dropped)

    @property
    def data_lost(self) -> int:
        return self.lost + len(self.duplicated)

    def line(self) -> str:
        s = (f"audit: {self.answered} answered, {self.committed} in the log, {len(self.missing)} missing "
             f"(serve's drop count {self.dropped}), {len(self.duplicated)} committed twice")
        return s + (f", {self.extra} committed without a 200 (in flight)" if self.extra else "")


def committed_ids(root: str, model: str = MODEL, storage: Any = None) -> tuple[Counter, Counter]:
    """(answer id -> answer rows with choice 0, event id -> manifests listing it) over every
    committed segment of `model`; the rows are read back through storage's sha256 verifier."""
    from gpu_jobs.serve.consumer import FEEDBACK_DIR, segment_manifests
    from gpu_jobs.serve.dataset import read_segments
    from storage import join

    events = Counter(e for m in segment_manifests(join(root, FEEDBACK_DIR, model), storage)
                     for e in m.extra.get("event_ids", ()))
    answers, _ = read_segments(root, model, storage)
    return Counter(a["answer_id"] for a in answers if a["index"] == 0), events


def audit_answers(root: str, answered: list[str], dropped: int = 0, model: str = MODEL,
                  storage: Any = None) -> AnswerAudit:
    rows, events = committed_ids(root, model, storage)
    dup = sorted(a for a, n in rows.items() if n > 1) + sorted(e for e, n in events.items() if n > 1)
    asked = set(answered)
    return AnswerAudit(len(asked), len(rows), sorted(asked - set(rows)), dup, dropped,
                       len(set(rows) - asked))


def orphan_files(root: str, model: str = MODEL) -> int:
    """Parquet files under the model's feedback folder that no manifest lists (a killed attempt's)."""
    from gpu_jobs.serve.consumer import FEEDBACK_DIR

    folder = Path(root) / FEEDBACK_DIR / model
    listed = {str(Path(m).parent / f) for m in folder.rglob("_MANIFEST.json")
              for f in _manifest_files(Path(m))}
    return sum(1 for p in folder.rglob("*.parquet") if str(p) not in listed)


def _manifest_files(path: Path) -> list[str]:
    import json

    return [f["path"] for f in json.loads(path.read_text()).get("files", [])]


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
          consumer_env: dict[str, str] | None = None):
    work = chaos.work / name
    work.mkdir(parents=True, exist_ok=True)
    env = {"PREFECT_API_URL": chaos.api_url} if chaos.api_url else {}  # should the consumer run a flow
    redis = RedisServer(work).start()
    s = Stack(work, root or str(work / "store"), redis, ServeProcess(work, redis.url, queue_size=queue_size),
              {**env, **(consumer_env or {})})
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
    from gpu_jobs.serve.consumer import SEGMENT_KIND

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

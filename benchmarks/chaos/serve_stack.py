"""The serving stack the chaos rows (serve_runs.py) and `make bench-serve` drive: real
`rlmill serve` and `rlmill feedback consume --follow` processes, a real redis-server (appendonly,
fsync always), a client that records every answer it got, and the audit of the committed log
(every answered request committed exactly once, or counted as dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
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

from .harness import REPO

MODEL = "builtin"
# Consumer failpoints: serve_runs' `consume` entry point installs the first; the product's own
# feedback:after-commit (flows/cli_serve.py) needs no wrapper.
BEFORE_COMMIT = "feedback:before-commit"  # segment files written, manifest not yet
AFTER_COMMIT = "feedback:after-commit"    # manifest written, entries not yet XACKed
START_S = 120.0  # a serve process loads its model in seconds; 2 busy cores can make it much longer


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
                 port: int | None = None, env: dict[str, str] | None = None, api_key: str | None = None):
        from tests.servers import free_port

        self.api_key = api_key  # sent to /metrics when serve runs with --api-keys (a key with the metrics role)
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

        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        text = httpx.get(f"{self.base}/metrics", timeout=10, headers=auth).text
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
    from gpu_jobs.online.broker import GROUP, STREAM, connect

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

    def __init__(self, base: str, concurrency: int = 4, max_tokens: int = 6, seed: int = 0,
                 headers: dict[str, str] | None = None):
        self.base, self.concurrency, self.max_tokens, self.seed = base, concurrency, max_tokens, seed
        self.headers = dict(headers or {})  # e.g. an API key: {"Authorization": "Bearer ..."}
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
        async with httpx.AsyncClient(base_url=self.base, timeout=120, limits=limits, headers=self.headers) as http:
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
    from gpu_jobs.online.consumer import FEEDBACK_DIR, segment_manifests
    from gpu_jobs.online.dataset import read_segments
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
    from gpu_jobs.online.consumer import FEEDBACK_DIR

    folder = Path(root) / FEEDBACK_DIR / model
    listed = {str(Path(m).parent / f) for m in folder.rglob("_MANIFEST.json")
              for f in _manifest_files(Path(m))}
    return sum(1 for p in folder.rglob("*.parquet") if str(p) not in listed)


def _manifest_files(path: Path) -> list[str]:
    import json

    return [f["path"] for f in json.loads(path.read_text()).get("files", [])]

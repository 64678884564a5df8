"""Redis Streams between serving and storage: the publisher side.

    publisher = EventPublisher("redis://127.0.0.1:6379/0", max_queue=10_000, event_key=event_key())
    status = await publisher.publish_async(event, wait_s=0.25)   # "logged" | "buffered" | "dropped"
    publisher.publish(event)       # never waits: "buffered" (queued) or "dropped"
    publisher.stats()              # {'queued': 0, 'published': 1, 'logged': 1, 'buffered': 0, 'dropped': 0, ...}
    publisher.close()

An answer's response waits until its event is in the broker (`publish_async`): when the broker is
up, an HTTP 200 means the event was XADDed, so a serve process SIGKILLed right after answering
loses no answered request (tests/serve/test_hot_swap.py kills one). The wait is bounded: when the
broker is slow (no XADD within `wait_s`) or known to be down (the last XADD failed), the event
stays on a bounded in-process queue and the answer goes out anyway, counted as `buffered`: the
publisher thread sends it when the broker is back. While the broker is down the thread keeps the
events it holds and retries them (nothing taken off the queue is lost), the queue fills, and what
no longer fits is dropped: counted (`dropped`, served on /metrics) and logged, the first time and
every DROP_LOG_EVERY-th after. So every answered request is in the stream, or counted as buffered
(lost only if the process dies before the broker comes back), or counted as dropped.

With `event_key` (signing.event_key(): $RLMILL_EVENT_KEY_FILE or $RLMILL_EVENT_KEY) each entry is
{"event": <json>, "sig": <HMAC of those bytes>}, so a consumer with the same key stores only what
serve sent (signing.py); without one, {"event": <json>}.

The thread sends what has queued up in one pipeline (up to BATCH events), so a busy server pays
one round trip per batch, not per event. A retried XADD whose first reply was lost can add an
event twice; the consumer lands each event id once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError

from gpu_jobs.online.wire import encode

__all__ = ["DEFAULT_REDIS", "STREAM", "GROUP", "PASSWORD_ENV", "BrokerUnreachable", "EventPublisher", "connect",
           "url_password_problem"]

log = logging.getLogger("rlmill.serve")

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"  # the broker `rlmill serve` and the consumer use unless told
STREAM = "rlmill:events"
PASSWORD_ENV = "RLMILL_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "RLMILL_REDIS_PASSWORD_FILE"
GROUP = "rlmill-feedback"
DROP_LOG_EVERY = 1000
RETRY_S = 0.5
BATCH = 256  # events per pipelined XADD round trip at most


def env_password() -> str | None:
    """$RLMILL_REDIS_PASSWORD, else the contents of the file $RLMILL_REDIS_PASSWORD_FILE names
    (stripped), else None. A file that cannot be read raises BrokerUnreachable naming it."""
    if os.environ.get(PASSWORD_ENV):
        return os.environ[PASSWORD_ENV]
    if not (path := os.environ.get(PASSWORD_FILE_ENV)):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError as exc:
        raise BrokerUnreachable(f"{PASSWORD_FILE_ENV}={path}: cannot read it ({exc.strerror or exc})") from None


class BrokerUnreachable(ConnectionError):
    """The Redis server at the URL did not answer a PING; the message names the URL and the fix."""


def connect(url: str, timeout_s: float = 2.0, check: bool = True):
    """A redis client for `url`; with `check`, PING it first (BrokerUnreachable on failure).
    A URL without a password takes it from RLMILL_REDIS_PASSWORD (PASSWORD_ENV), else from the
    file RLMILL_REDIS_PASSWORD_FILE names (what `make serve` generates: .rlmill/redis.password),
    so it need not sit in a command line, a deployment's parameters or the Prefect UI; messages
    show the URL without its password either way."""
    import redis
    from redis.connection import parse_url

    from storage.fs import redact_url

    extra = {}
    if not parse_url(url).get("password") and (password := env_password()) is not None:
        extra["password"] = password
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, **extra)
    if check:
        try:
            client.ping()
        except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError, OSError) as exc:
            said = " ".join(str(exc).split())
            if isinstance(exc, redis.AuthenticationError) or "auth" in said.lower():
                raise BrokerUnreachable(
                    f"the event broker at {redact_url(url)} refused this client ({said}): it asks for a password; "
                    f"set {PASSWORD_ENV}, or {PASSWORD_FILE_ENV}=.rlmill/redis.password (make serve's)") from None
            raise BrokerUnreachable(
                f"the event broker at {redact_url(url)} does not answer ({' '.join(str(exc).split())}): start it "
                "(`redis-server --port 6379`) or pass --redis with the right URL") from None
    return client


def url_password_problem(url: str, where: str) -> str | None:
    """Why broker URL `url`, given as `where` (a command-line flag, a flow parameter), is refused:
    a password in it (`redis://:pw@host`, `user:pw@`, `?password=`) would show in process listings,
    shell history and the Prefect UI; None when it holds none. The password goes in
    RLMILL_REDIS_PASSWORD (connect reads it).

    >>> url_password_problem("redis://127.0.0.1:6379/0", "--redis") is None
    True
    """
    from urllib.parse import parse_qs, urlsplit

    try:
        parts = urlsplit(url)
        held = parts.password is not None or "password" in parse_qs(parts.query)
        shown = f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"
    except ValueError:  # not a URL at all: connect says so
        return None
    if not held:
        return None
    return (f"{where} {shown!r} holds a password, which would show where the URL is shown (process "
            f"listings, the Prefect UI): give the URL without it and set {PASSWORD_ENV} instead")


class EventPublisher:
    """A bounded queue and one thread XADDing to `stream` (approximately capped at `maxlen`).

    Each queued event carries a Future: True once it is XADDed, False when the first XADD of it
    failed (the thread keeps retrying it; a waiter stops waiting and counts it as buffered)."""

    def __init__(self, url: str, *, stream: str = STREAM, max_queue: int = 10_000, maxlen: int | None = None,
                 timeout_s: float = 2.0, event_key: bytes | None = None):
        from storage.fs import redact_url

        self.url, self.stream, self.maxlen = redact_url(url), stream, maxlen  # self.url is for messages
        self._key = event_key  # signs every entry (signing.py); None: unsigned
        self._client = connect(url, timeout_s, check=False)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._counts = {"published": 0, "logged": 0, "buffered": 0, "dropped": 0, "send_errors": 0,
                        "wait_seconds": 0.0}
        self._lock = threading.Lock()
        self._down = False  # the last XADD failed: answers do not wait for the broker meanwhile
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlmill-event-publisher", daemon=True)
        self._thread.start()

    @property
    def event_key(self) -> bytes | None:
        """The key entries are signed with (None: unsigned)."""
        return self._key

    def submit(self, event: dict) -> Future | None:
        """Queue `event`; its Future (see the class docstring), or None when the queue is full
        (the event is dropped, counted and logged)."""
        sent: Future = Future()
        try:
            self._queue.put_nowait((event, sent))
            return sent
        except queue.Full:
            with self._lock:
                self._counts["dropped"] += 1
                dropped = self._counts["dropped"]
            if dropped == 1 or dropped % DROP_LOG_EVERY == 0:
                log.warning("event queue full (%d events waiting for the broker at %s): dropped %d event(s) "
                            "so far", self._queue.maxsize, self.url, dropped)
            return None

    def publish(self, event: dict) -> str:
        """Queue `event` without waiting: "buffered", or "dropped" when the queue is full."""
        return self._settle(self.submit(event) is not None, None)

    async def publish_async(self, event: dict, wait_s: float) -> str:
        """Queue `event` and wait (at most `wait_s`, not at all while the broker is down) until it
        is XADDed: "logged"; else "buffered" (still queued, sent later) or "dropped"."""
        sent = self.submit(event)
        if sent is None:
            return "dropped"
        if wait_s <= 0 or self._down:
            return self._settle(True, None)
        started = time.perf_counter()
        # asyncio.wait, not wait_for: a timeout must not cancel `sent` (the event stays queued)
        waiter = asyncio.wrap_future(sent)
        done, _ = await asyncio.wait({waiter}, timeout=wait_s)
        ok = waiter.result() if done else None  # None: a slow broker
        with self._lock:
            self._counts["wait_seconds"] += time.perf_counter() - started
        return self._settle(True, ok)

    def _settle(self, queued: bool, xadded: bool | None) -> str:
        status = "dropped" if not queued else "logged" if xadded else "buffered"
        if status != "dropped":
            with self._lock:
                self._counts[status] += 1
        return status

    def stats(self) -> dict[str, int]:
        """queued now; published (XADDed), logged (answered after the XADD), buffered (answered
        before it), dropped (queue full, or not sent at close), send_errors (failed XADDs), and
        wait_seconds: what answers spent waiting for their XADD, in all (the latency logging adds)."""
        with self._lock:
            return {"queued": self._queue.qsize(), **self._counts}

    def _run(self) -> None:
        while not self._closing.is_set() or not self._queue.empty():
            try:
                batch = [self._queue.get(timeout=0.1)]
            except queue.Empty:
                continue
            while len(batch) < BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._send(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _send(self, batch: list[tuple[dict, Future]]) -> None:
        """XADD the batch until it succeeds or the publisher closes; no event is lost meanwhile."""
        fields = [encode(event, self._key) for event, _ in batch]
        while True:
            try:
                pipe = self._client.pipeline(transaction=False)
                for f in fields:
                    pipe.xadd(self.stream, f, maxlen=self.maxlen, approximate=True)
                pipe.execute()
                with self._lock:
                    self._counts["published"] += len(batch)
                if self._down:
                    log.warning("event broker %s is back: sending what was queued", self.url)
                self._down = False
                _resolve(batch, True)
                return
            except Exception as exc:  # redis.ConnectionError, TimeoutError, ... : the broker's problem
                with self._lock:
                    self._counts["send_errors"] += 1
                if not self._down:
                    log.warning("event broker %s: %s; retrying every %.1f s, queueing meanwhile", self.url,
                                " ".join(str(exc).split()), RETRY_S)
                self._down = True
                _resolve(batch, False)  # waiting answers go out now, counted as buffered
                if self._closing.wait(RETRY_S):
                    with self._lock:
                        self._counts["dropped"] += len(batch)
                    return

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the queue is empty (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.02)
        return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (up to `timeout_s`), then stop; events left are counted as dropped."""
        self.flush(timeout_s)
        self._closing.set()
        self._thread.join(timeout_s)
        left = self._queue.qsize()
        if left:
            with self._lock:
                self._counts["dropped"] += left
            log.warning("event publisher closed with %d event(s) not sent to %s: counted as dropped", left, self.url)


def _resolve(batch: list[tuple[dict, Future]], xadded: bool) -> None:
    for _, sent in batch:
        with contextlib.suppress(InvalidStateError):  # already resolved (a retry), or cancelled
            sent.set_result(xadded)

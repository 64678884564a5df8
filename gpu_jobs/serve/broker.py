"""Redis Streams between serving and storage: the publisher side.

    publisher = EventPublisher("redis://127.0.0.1:6379/0", max_queue=10_000)
    publisher.publish(event)       # never blocks: queued, or dropped and counted
    publisher.stats()              # {'queued': 0, 'published': 1, 'dropped': 0, 'send_errors': 0}
    publisher.close()

Answering never waits for the broker: `publish` puts the event on a bounded in-process queue and a
publisher thread XADDs it. When the broker is slow or down, the thread keeps the event it holds
and retries it (so nothing taken off the queue is lost), the queue fills, and what no longer fits
is dropped: counted (`dropped`, served on /metrics) and logged, the first time and every
DROP_LOG_EVERY-th after. A retried XADD whose first reply was lost can add an event twice; the
consumer lands each event id once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from gpu_jobs.serve.events import encode

__all__ = ["STREAM", "GROUP", "BrokerUnreachable", "EventPublisher", "connect"]

log = logging.getLogger("rlmill.serve")

STREAM = "rlmill:events"
GROUP = "rlmill-feedback"
DROP_LOG_EVERY = 1000
RETRY_S = 0.5


class BrokerUnreachable(ConnectionError):
    """The Redis server at the URL did not answer a PING; the message names the URL and the fix."""


def connect(url: str, timeout_s: float = 2.0, check: bool = True):
    """A redis client for `url`; with `check`, PING it first (BrokerUnreachable on failure)."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    if check:
        try:
            client.ping()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise BrokerUnreachable(
                f"the event broker at {url} does not answer ({' '.join(str(exc).split())}): start it "
                "(`redis-server --port 6379`) or pass --redis with the right URL") from None
    return client


class EventPublisher:
    """A bounded queue and one thread XADDing to `stream` (approximately capped at `maxlen`)."""

    def __init__(self, url: str, *, stream: str = STREAM, max_queue: int = 10_000, maxlen: int | None = None,
                 timeout_s: float = 2.0):
        self.url, self.stream, self.maxlen = url, stream, maxlen
        self._client = connect(url, timeout_s, check=False)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._counts = {"published": 0, "dropped": 0, "send_errors": 0}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlmill-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, event: dict) -> bool:
        """Queue `event` for the broker; False (and counted) when the queue is full."""
        try:
            self._queue.put_nowait(event)
            return True
        except queue.Full:
            with self._lock:
                self._counts["dropped"] += 1
                dropped = self._counts["dropped"]
            if dropped == 1 or dropped % DROP_LOG_EVERY == 0:
                log.warning("event queue full (%d events waiting for the broker at %s): dropped %d event(s) "
                            "so far", self._queue.maxsize, self.url, dropped)
            return False

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"queued": self._queue.qsize(), **self._counts}

    def _run(self) -> None:
        while not self._closing.is_set() or not self._queue.empty():
            try:
                event = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._send(event)
            finally:
                self._queue.task_done()

    def _send(self, event: dict) -> None:
        """XADD until it succeeds or the publisher closes; the event is not lost meanwhile."""
        fields = encode(event)
        while True:
            try:
                self._client.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
                with self._lock:
                    self._counts["published"] += 1
                return
            except Exception as exc:  # redis.ConnectionError, TimeoutError, ... : the broker's problem
                with self._lock:
                    self._counts["send_errors"] += 1
                    first = self._counts["send_errors"] == 1
                if first:
                    log.warning("event broker %s: %s; retrying every %.1f s, queueing meanwhile", self.url,
                                " ".join(str(exc).split()), RETRY_S)
                if self._closing.wait(RETRY_S):
                    with self._lock:
                        self._counts["dropped"] += 1
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

"""Answers the server no longer holds in memory (a restart, an evicted id), found where they were
logged: the event stream, else the committed feedback log.

    recall = AnswerRecall(redis_url="redis://127.0.0.1:6379/0", root="s3://bucket/rl", model="arith")
    recall.find("chatcmpl-01a2...")             # KnownAnswer(...) or None, in this thread
    await recall.find_async("chatcmpl-01a2...")  # the same in recall's own executor (the API's way)

An answer id carries its creation time (answers.id_time), so neither place is scanned whole: in
the stream, the entries from a minute before that time to SCAN_AFTER_S after it (the event is
added once the answer is generated, or later when the broker was down); in storage, the segments
of the two hour folders the consumer files it in (the hour of the request's start, which is at
most the id's time, and the hour before). The consumer trims committed entries from the stream,
so the two together cover the retention window.

What a lookup costs is bounded whoever asks (feedback naming made-up ids inside the window was
an amplifier: each one an XRANGE of up to 20,000 entries and a read of two hours of manifests):
- an id index: the stream is read a minute at a time (one XRANGE per minute, at most SCAN_MAX
  entries), and the answers found in a minute are kept for INDEX_TTL_S (at most INDEX_MINUTES
  minutes, least recently used dropped); an hour folder's manifests (the answer ids they list)
  likewise. Many ids born in the same stretch cost one read of it per INDEX_TTL_S, not one each.
- a negative cache: an id not found is answered "not found" for MISS_TTL_S (at most MAX_MISSES
  ids), with no read at all; lookups of one id at once share one read.
- its own executor (WORKERS threads, never the pool tokenisation uses), and at most MAX_PENDING
  lookups waiting for it: one more is a 429 with Retry-After, so a flood queues nowhere.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gpu_jobs.online.answers import KnownAnswer, id_time

__all__ = ["AnswerRecall", "INDEX_TTL_S", "MISS_TTL_S", "SCAN_AFTER_S", "SCAN_MAX"]

log = logging.getLogger("rlmill.serve")

SCAN_BEFORE_S = 60.0
SCAN_AFTER_S = 900.0
SCAN_MAX = 20_000  # stream entries read for one minute at most
INDEX_TTL_S = 30.0  # a minute of the stream, or an hour folder, is read again after this
INDEX_MINUTES = 256  # minutes (and hour folders) kept in the index
MISS_TTL_S = 60.0
MAX_MISSES = 10_000
WORKERS = 1
MAX_PENDING = 32


class _Cache:
    """key -> value for `ttl_s`, at most `size` keys (least recently used dropped); thread-safe."""

    def __init__(self, size: int, ttl_s: float, clock=time.monotonic):
        self.size, self.ttl_s, self._clock = size, ttl_s, clock
        self._items: OrderedDict[Any, tuple[float, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            item = self._items.get(key)
            if item is None or self._clock() - item[0] > self.ttl_s:
                self._items.pop(key, None)
                return default
            self._items.move_to_end(key)
            return item[1]

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._items[key] = (self._clock(), value)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


@dataclass
class AnswerRecall:
    """Looks an answer up in the stream (`redis_url`, `stream`) and under `root` for `model`;
    either may be None (not looked in). Any failure of a store is logged and counts as not found
    (and is not cached)."""

    redis_url: str | None
    root: str | None
    model: str
    stream: str = "rlmill:events"
    storage: Any = None
    event_key: bytes | None = None  # with serve's signing key, an entry it did not sign is not recalled
    reads: dict = field(default_factory=lambda: {"minutes": 0, "hours": 0, "misses_cached": 0, "busy": 0})

    def __post_init__(self) -> None:
        self._minutes = _Cache(INDEX_MINUTES, INDEX_TTL_S)  # minute -> {answer_id: KnownAnswer}
        self._hours = _Cache(INDEX_MINUTES, INDEX_TTL_S)  # hour folder -> [(answer ids, manifest)]
        self._misses = _Cache(MAX_MISSES, MISS_TTL_S)
        self._executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="rlmill-recall")
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()

    async def find_async(self, answer_id: str) -> KnownAnswer | None:
        """find() in recall's own executor; lookups of one id share one; an ApiError 429 when
        MAX_PENDING lookups wait already (see the module docstring)."""
        if self._misses.get(answer_id, False):
            self.reads["misses_cached"] += 1
            return None
        with self._lock:
            future = self._pending.get(answer_id)
            if future is None:
                if len(self._pending) >= MAX_PENDING:
                    self.reads["busy"] += 1
                    from gpu_jobs.online.protocol import ApiError

                    raise ApiError(429, f"{MAX_PENDING} lookups of answers the server no longer holds are waiting; "
                                        "retry shortly", "answer_id", "rate_limit_error", {"Retry-After": "1"})
                future = self._pending[answer_id] = self._executor.submit(self.find, answer_id)
                future.add_done_callback(lambda _: self._forget(answer_id))
        return await asyncio.wrap_future(future)

    def _forget(self, answer_id: str) -> None:
        with self._lock:
            self._pending.pop(answer_id, None)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def find(self, answer_id: str) -> KnownAnswer | None:
        born = id_time(answer_id)
        if born is None:
            return None
        if self._misses.get(answer_id, False):
            return None
        failed = False
        for where in (self._in_stream, self._in_storage):
            try:
                if (found := where(answer_id, born)) is not None:
                    return found
            except Exception as exc:  # noqa: BLE001 -- a store that is down answers "not found"
                failed = True
                log.warning("rlmill serve: looking up answer %s in %s failed: %s", answer_id, where.__name__[4:],
                            " ".join(str(exc).split())[:200])
        if not failed:  # a store that failed may hold it: asked again next time
            self._misses.put(answer_id, True)
        return None

    def _in_stream(self, answer_id: str, born: float) -> KnownAnswer | None:
        if self.redis_url is None:
            return None
        first, last = int((born - SCAN_BEFORE_S) // 60), int((born + SCAN_AFTER_S) // 60)
        client = None
        for minute in range(max(0, first), last + 1):
            answers = self._minutes.get(minute)
            if answers is None:
                if client is None:
                    from gpu_jobs.online.broker import connect

                    client = connect(self.redis_url, check=False)
                answers = self._read_minute(client, minute)
                self._minutes.put(minute, answers)
            if answer_id in answers:
                return answers[answer_id]
        return None

    def _read_minute(self, client: Any, minute: int) -> dict[str, KnownAnswer]:
        """The answers whose events the stream holds in `minute` (one XRANGE, SCAN_MAX at most)."""
        from gpu_jobs.online.wire import decode

        self.reads["minutes"] += 1
        out: dict[str, KnownAnswer] = {}
        start = minute * 60_000
        for _, fields in client.xrange(self.stream, min=f"{start}-0", max=f"{start + 59_999}-18446744073709551615",
                                       count=SCAN_MAX):
            e = decode(fields, self.event_key)
            if isinstance(e, dict) and e.get("kind") == "answer" and isinstance(e.get("answer_id"), str) \
                    and isinstance(e.get("choices"), list) and isinstance(e.get("created"), (int, float)):
                out[e["answer_id"]] = KnownAnswer(e["answer_id"], float(e["created"]), str(e.get("model")),
                                                  str(e.get("version")), len(e["choices"]))
        return out

    def _in_storage(self, answer_id: str, born: float) -> KnownAnswer | None:
        if self.root is None:
            return None
        from gpu_jobs.online.consumer import FEEDBACK_DIR, hour_of, manifest_rows, segment_manifests
        from storage import check_name, join

        for hour in (hour_of(born), hour_of(born - 3600)):
            folder = join(self.root, FEEDBACK_DIR, check_name(self.model, "model name"), hour)
            listed = self._hours.get(folder)
            if listed is None:
                self.reads["hours"] += 1
                listed = [(frozenset(m.extra.get("answer_ids", ())), m) for m in segment_manifests(folder, self.storage)]
                self._hours.put(folder, listed)
            for ids, m in listed:
                if answer_id not in ids:
                    continue
                files = [f for f in m.files if f.path.startswith("answers-")]
                rows = [r for r in manifest_rows(m, files, self.storage) if r["answer_id"] == answer_id]
                if rows:
                    return KnownAnswer(answer_id, float(rows[0]["created"]), rows[0]["model"], rows[0]["version"],
                                       len(rows))
        return None

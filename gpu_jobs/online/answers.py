"""Answer ids that carry their creation time, and the bounded index of recent answers.

    >>> aid = new_answer_id("chatcmpl")
    >>> aid.startswith("chatcmpl-") and abs(id_time(aid) - time.time()) < 1
    True

An id is `<prefix>-<uuid>` with a version-7 uuid (48-bit Unix milliseconds, then random bits), so
its age is known from the id alone: feedback for an answer older than the retention window is
refused as such even when the index no longer holds it (evicted, or a restarted server).

The index also holds the votes each answer took (`vote`): one per (answer, choice, voter), so
the same caller cannot post the same judgement twice while the answer is in memory, and at most
MAX_VOTES per answer in all (an answer is one caller's; many voters on it is stuffing).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["AnswerIndex", "KnownAnswer", "MAX_VOTES", "id_time", "new_answer_id", "new_event_id"]

MAX_VOTES = 64  # votes one answer takes at most, all choices and voters together


def _uuid7(at: float | None = None) -> uuid.UUID:
    ms = int((time.time() if at is None else at) * 1000) & ((1 << 48) - 1)
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms << 80) | (0x7 << 76) | ((rand >> 68) & 0xFFF) << 64 | (0b10 << 62) | (rand & ((1 << 62) - 1))
    return uuid.UUID(int=value)


def new_answer_id(prefix: str, at: float | None = None) -> str:
    """`chatcmpl-<uuid>` / `cmpl-<uuid>` (OpenAI's prefixes), time-ordered; `at` (Unix s) = now."""
    return f"{prefix}-{_uuid7(at)}"


def new_event_id() -> str:
    """`evt-<uuid>`: one per answer or feedback event; the consumer lands each exactly once by it."""
    return f"evt-{_uuid7()}"


def id_time(some_id: str) -> float | None:
    """Creation time (Unix seconds) of an id made here, None for anything else."""
    try:
        u = uuid.UUID(some_id[-36:])
    except (ValueError, TypeError):
        return None
    return (u.int >> 80) / 1000.0 if u.version == 7 else None


@dataclass(frozen=True)
class KnownAnswer:
    """What feedback needs to know about an answer: when, which model, how many choices."""

    answer_id: str
    created: float
    model: str
    version: str
    n_choices: int


class AnswerIndex:
    """The most recent `capacity` answers, oldest evicted first; thread-safe.

    >>> idx = AnswerIndex(capacity=2)
    >>> for i in "abc": idx.add(KnownAnswer(i, 0.0, "m", "v1", 1))
    >>> idx.get("a") is None, idx.get("c").version
    (True, 'v1')
    >>> idx.vote("c", 0, "alice"), idx.vote("c", 0, "alice"), idx.vote("c", 0, "bob"), idx.vote("a", 0, "bob")
    ('ok', 'duplicate', 'ok', 'unknown')
    """

    def __init__(self, capacity: int = 200_000):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, KnownAnswer] = OrderedDict()
        self._votes: dict[str, set[tuple[int, str]]] = {}  # answer id -> {(choice, voter)}
        self._lock = threading.Lock()

    def add(self, answer: KnownAnswer) -> None:
        with self._lock:
            self._items[answer.answer_id] = answer
            while len(self._items) > self.capacity:
                old, _ = self._items.popitem(last=False)
                self._votes.pop(old, None)

    def vote(self, answer_id: str, index: int, voter: str) -> str:
        """Record a vote by `voter` on choice `index`: "ok", "duplicate" (this voter's second on
        that choice), "full" (the answer took MAX_VOTES) or "unknown" (not in the index)."""
        with self._lock:
            if answer_id not in self._items:
                return "unknown"
            votes = self._votes.setdefault(answer_id, set())
            if (index, voter) in votes:
                return "duplicate"
            if len(votes) >= MAX_VOTES:
                return "full"
            votes.add((index, voter))
            return "ok"

    def get(self, answer_id: str) -> KnownAnswer | None:
        with self._lock:
            return self._items.get(answer_id)

    def __len__(self) -> int:
        return len(self._items)

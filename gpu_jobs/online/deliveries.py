"""The consumer group's bookkeeping beyond read-and-ack: entries that keep coming back go to a
dead-letter stream, entries a vanished consumer left pending are taken over, and what every group
has acknowledged is trimmed from the stream.

    ledger = Deliveries(client, "rlmill:events", "rlmill-feedback", "consumer-1", max_deliveries=5)
    ledger.claim_abandoned(idle_s=60)          # XAUTOCLAIM: a dead consumer's pending entries are ours
    keep, dead = ledger.screen(entries)        # pending entries delivered too often -> dead letter
    ledger.forgive(entries, counts)            # a broker or storage outage: not the entries' fault
    trim_acknowledged(client, "rlmill:events") # XTRIM MINID: what no group still needs
    group_lag("redis://127.0.0.1:6379/0")      # what waits for the group, read without consuming

Why a count decides: the quality gate and the per-event table check quarantine every event whose
data is wrong, so an entry that still comes back again and again is one that kills the consumer
process itself (memory, a bug): Redis counts each delivery (XREADGROUP of pending entries too),
and past `max_deliveries` the entry goes, whole and with its reason, to `<stream>:dead` (XADD and
XACK in one MULTI), counted and logged, so the entries after it flow again. A broker or storage
failure (consumer.outage: storage down, Redis gone) is not the entries' fault: `forgive` gives
their count back (XCLAIM RETRYCOUNT), so an outage never dead-letters valid events. Any other
failure is some entry's: the consumer commits the batch one entry at a time and quarantines the
one that fails; only a failure of that, too, is left to count toward the dead letter.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gpu_jobs.online.broker import GROUP, STREAM, connect
from gpu_jobs.online.events import event_json

__all__ = ["DEAD_SUFFIX", "MAX_DELIVERIES", "CLAIM_IDLE_S", "Deliveries", "GroupLag", "Outage", "dead_letters", "group_lag",
           "id_time_of_stream", "trim_acknowledged"]

log = logging.getLogger("rlmill.feedback")

DEAD_SUFFIX = ":dead"
MAX_DELIVERIES = 5  # deliveries of one entry before it is dead-lettered (4 consumer deaths on it)
CLAIM_IDLE_S = 60.0  # a pending entry idle this long under another consumer is taken over


@dataclass
class Deliveries:
    """Delivery counts and the dead letters of one consumer (see the module docstring)."""

    client: Any
    stream: str
    group: str
    consumer: str
    max_deliveries: int = MAX_DELIVERIES
    _claimed_at: float = field(default=float("-inf"), repr=False)

    @property
    def dead_stream(self) -> str:
        return self.stream + DEAD_SUFFIX

    def claim_abandoned(self, idle_s: float = CLAIM_IDLE_S, batch: int = 500) -> int:
        """XAUTOCLAIM every entry pending for at least `idle_s` under any consumer: they become this
        consumer's pending entries, read next (cursor "0"). Returns how many were taken over."""
        start, claimed = "0-0", 0
        while True:
            reply = self.client.xautoclaim(self.stream, self.group, self.consumer, int(idle_s * 1000), start,
                                           count=batch, justid=True)
            ids = reply if reply and not isinstance(reply[0], (list, tuple)) else []
            claimed += len(ids)
            if len(ids) < batch:
                break
            start = _increment(_s(ids[-1]))
        self._claimed_at = time.monotonic()
        if claimed:
            log.warning("rlmill: took over %d entries left pending by another consumer for over %.0f s", claimed,
                        idle_s)
        return claimed

    def claim_if_due(self, idle_s: float = CLAIM_IDLE_S, batch: int = 500) -> int:
        """claim_abandoned, at most once every `idle_s` (a following consumer calls it per read)."""
        now = time.monotonic()
        if now - self._claimed_at <= idle_s:
            return 0
        self._claimed_at = now
        return self.claim_abandoned(idle_s, batch)

    def counts(self, sids: list[str]) -> dict[str, int]:
        """How often each of this consumer's pending entries `sids` was delivered (this time too)."""
        if not sids:
            return {}
        wanted = set(sids)
        rows = self.client.xpending_range(self.stream, self.group, min=min(sids, key=_key),
                                          max=max(sids, key=_key), count=len(sids) + 1000,
                                          consumername=self.consumer)
        return {_s(r["message_id"]): int(r["times_delivered"]) for r in rows if _s(r["message_id"]) in wanted}

    def screen(self, entries: list[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], dict[str, str]]:
        """Pending `entries` (read with cursor "0") -> (those to process, {stream id: reason} of those
        dead-lettered: delivered more than max_deliveries times)."""
        counts = self.counts([sid for sid, _ in entries])
        keep, dead = [], {}
        for sid, e in entries:
            n = counts.get(sid, 1)
            if n > self.max_deliveries:
                dead[sid] = (f"delivered {n} times without a commit (more than {self.max_deliveries}): "
                             "the consumer died on it")
                self._dead_letter(sid, e, dead[sid], n)
            else:
                keep.append((sid, e))
        return keep, dead

    def _dead_letter(self, sid: str, event: Any, reason: str, deliveries: int) -> None:
        pipe = self.client.pipeline(transaction=True)  # both or neither: never acked without its copy
        pipe.xadd(self.dead_stream, {"stream_id": sid, "reason": reason, "deliveries": str(deliveries),
                                     "consumer": self.consumer, "event": event_json(event)})
        pipe.xack(self.stream, self.group, sid)
        pipe.execute()
        log.warning("rlmill: dead-lettered stream entry %s to %s: %s", sid, self.dead_stream, reason)

    def forgive(self, entries: list[tuple[str, Any]], counts: dict[str, int]) -> None:
        """Give back the delivery these entries just had: the failure was caught and is not theirs.
        Best effort: with the broker down too, the count stays (one more delivery)."""
        try:
            for sid, _ in entries:
                self.client.xclaim(self.stream, self.group, self.consumer, 0, [sid],
                                   retrycount=max(0, counts.get(sid, 1) - 1), justid=True)
        except Exception as exc:  # noqa: BLE001 -- the failure being handled is the one to report
            log.debug("could not give back delivery counts: %s", exc)


class Outage:
    """A following consumer's broker outage: one line when it starts and one when it ends, and a
    wait between tries that doubles from RETRY_S up to MAX_RETRY_S."""

    RETRY_S, MAX_RETRY_S = 0.5, 5.0

    def __init__(self, url: str):
        self.url, self.since, self.delay = url, None, self.RETRY_S

    def wait(self, exc: BaseException, stop: threading.Event | None = None) -> None:
        if self.since is None:
            self.since, self.delay = time.monotonic(), self.RETRY_S
            log.warning("rlmill: the event broker at %s went away (%s): retrying (committed segments are kept, "
                        "unacknowledged entries come back)", self.url, " ".join(str(exc).split()))
        (stop or threading.Event()).wait(self.delay)
        self.delay = min(self.MAX_RETRY_S, 2 * self.delay)

    def over(self) -> None:
        if self.since is not None:
            log.warning("rlmill: the event broker at %s is back after %.0f s", self.url, time.monotonic() - self.since)
            self.since = None


def dead_letters(client: Any, stream: str, count: int = 100) -> list[dict[str, str]]:
    """The newest `count` dead letters of `stream`, newest first, as text fields with their id."""
    rows = client.xrevrange(stream + DEAD_SUFFIX, count=count)
    return [{"id": _s(sid), **{_s(k): _s(v) for k, v in fields.items()}} for sid, fields in rows]


def trim_acknowledged(client: Any, stream: str) -> int:
    """XTRIM MINID: drop the entries every consumer group has read and acknowledged (users'
    prompts do not stay in the broker once committed). Returns how many were removed; nothing
    when a group has not read anything yet, or no group exists."""
    import redis

    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream
        return 0
    if not groups:
        return 0
    keep_from = []
    for g in groups:
        summary = client.xpending(stream, _s(g["name"]))
        if int(summary["pending"]):
            keep_from.append(_key(_s(summary["min"])))
        else:
            last = _s(g["last-delivered-id"])
            if last == "0-0":
                return 0
            keep_from.append(_key(_increment(last)))
    ms, seq = min(keep_from)
    return int(client.xtrim(stream, minid=f"{ms}-{seq}", approximate=False))


def id_time_of_stream(sid: str) -> float:
    """A Redis stream id's time: `<ms>-<seq>`."""
    try:
        return int(str(sid).split("-")[0]) / 1000.0
    except ValueError:
        return 0.0


@dataclass(frozen=True)
class GroupLag:
    """What waits for consumer group `group` of `stream` (Redis 7 XINFO GROUPS, XPENDING)."""

    stream: str
    group: str
    length: int  # entries in the stream (XLEN)
    lag: int | None  # entries not yet delivered to the group; None when Redis cannot tell (entries deleted)
    pending: int  # delivered to a consumer, not acknowledged (a consumer died mid-batch, or is at work)
    consumers: dict[str, int]  # consumer name -> its pending count
    oldest_pending_age_s: float | None  # age of the oldest pending entry (from its stream id)
    oldest_waiting_age_s: float | None  # age of the oldest entry not yet acknowledged (pending or undelivered)
    group_exists: bool = True  # False before the first consume: then every entry is waiting

    @property
    def waiting(self) -> int | None:
        """Entries not yet acknowledged: the backlog a drain has to commit."""
        return None if self.lag is None else self.lag + self.pending


def group_lag(redis_url: str, *, stream: str = STREAM, group: str = GROUP, now: float | None = None) -> GroupLag:
    """The consumer group's backlog, read without consuming anything (see GroupLag)."""
    import redis

    client = connect(redis_url)
    now = time.time() if now is None else now
    length = client.xlen(stream)
    try:
        info = next((g for g in client.xinfo_groups(stream) if _s(g["name"]) == group), None)
    except redis.ResponseError:  # no such stream yet
        info = None
    if info is None:
        first = client.xrange(stream, count=1)
        oldest = now - id_time_of_stream(_s(first[0][0])) if first else None
        return GroupLag(stream, group, length, length, 0, {}, None, oldest, group_exists=False)
    summary = client.xpending(stream, group)
    pending = int(summary["pending"])
    oldest_pending = now - id_time_of_stream(_s(summary["min"])) if pending else None
    undelivered = client.xrange(stream, min="(" + _s(info["last-delivered-id"]), count=1)
    oldest_undelivered = now - id_time_of_stream(_s(undelivered[0][0])) if undelivered else None
    ages = [a for a in (oldest_pending, oldest_undelivered) if a is not None]
    lag = info.get("lag")
    return GroupLag(stream, group, length, None if lag is None else int(lag), pending,
                    {_s(c["name"]): int(c["pending"]) for c in summary.get("consumers") or ()},
                    oldest_pending, max(ages) if ages else None)


def _key(sid: str) -> tuple[int, int]:
    ms, _, seq = sid.partition("-")
    return int(ms), int(seq or 0)


def _increment(sid: str) -> str:
    ms, seq = _key(sid)
    return f"{ms}-{seq + 1}"


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


"""The stream -> Parquet segments, committed through storage's manifest, acked after the commit.

    result = consume("s3://bucket/rl", "redis://127.0.0.1:6379/0")   # drain what is there, then return
    consume(root, url, follow=True)                                    # keep reading (rlmill feedback consume --follow)
    consume(root, url, max_s=45, on_segment=print)                     # one bounded drain (the rl-feedback flow)
    group_lag("redis://127.0.0.1:6379/0")                              # what waits for the consumer group

Layout, manifests and the committed-ids index: segments.py; one batch's gate, dedupe and commit:
ingest.py. Events the quality gate refuses (great-expectations over events.gate_columns, as for
rollouts; feedback for an answer never logged; an answer logged twice) go, whole and with the
reason, to <root>/feedback/_quarantine/: counted, never dropped.

No entry can stop it: each is parsed within bounds (wire.py: size, nesting, every number) against
the strict schema (events.py), and one that fails, or whose check or row raises, is quarantined
alone. With an event key (signing.py; $RLMILL_EVENT_KEY_FILE or $RLMILL_EVENT_KEY), an entry serve
did not sign with it is quarantined ("unsigned entry", "signature does not match"). A batch that
still fails is sorted by its error (`outage`): a broker or storage failure gives the entries
their delivery back (they come again, never dead-lettered for an outage); anything else is some
entry's, and the batch is committed again one entry at a time, the one that fails quarantined
with its error. An entry the consumer keeps dying on (the process killed) goes to the
dead-letter stream after `max_deliveries`, a vanished consumer's pending entries are taken over
after `claim_idle_s`, and acknowledged entries are trimmed from the stream (deliveries.py).

Following (`follow`): a batch waits up to `linger_s` for more entries (until `batch` of them)
before it is committed, so a steady trickle of events makes one segment a second, not one per
event (whose Parquet writes and manifest would take CPU from the server answering on the same
machine); a broker that goes away is waited out (one line when it goes, one when it is back). A
drain (no `follow`) raises BrokerUnreachable instead.

Exactly once: a consumer group (XREADGROUP) delivers each entry; it is XACKed only after its
segment committed. A consumer that dies between commit and ack gets the same entries again (its
pending list is read first, with id 0). Before writing, each event id is looked up in the
committed-ids index: the event ids the manifests of the hour folders a batch touches list (read
once per folder per process, then kept up to date), so an event already committed -- a
redelivery, or a duplicate XADD by a publisher whose first reply was lost -- is skipped, not
written twice. Segment names come from the first event id left, and a segment name that is
already committed with the same ids is a no-op. `on_segment` runs after a segment's manifest is
committed and before the batch's XACK, so whatever it does (the rl-feedback flow emits a Prefect
event) happens only for committed data; `max_s` stops between batches (after an XACK), so a bounded
drain leaves nothing half-done.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gpu_jobs.online.broker import GROUP, STREAM, BrokerUnreachable, connect
from gpu_jobs.online.deliveries import (CLAIM_IDLE_S, MAX_DELIVERIES, Deliveries, GroupLag, Outage, group_lag,
                                        id_time_of_stream, trim_acknowledged)
from gpu_jobs.online.ingest import Round, entry_time, gate  # noqa: F401 -- gate, entry_time: re-exported
from gpu_jobs.online.segments import (FEEDBACK_DIR, QUARANTINE_DIR, QUARANTINE_KIND, SEGMENT_KIND,  # noqa: F401
                                      CommittedIds, Segment, commit_segment, hour_of, manifest_rows,
                                      segment_manifests)
from gpu_jobs.online.wire import decode

__all__ = ["FEEDBACK_DIR", "QUARANTINE_DIR", "QUARANTINE_KIND", "SEGMENT_KIND", "ConsumeResult", "GroupLag",
           "Segment", "consume", "group_lag", "hour_of", "id_time_of_stream", "manifest_rows", "segment_manifests"]

log = logging.getLogger("rlmill.feedback")

_commit_segment = commit_segment  # the name tests and tools used before segments.py
FROM_ENV = "env"  # consume(event_key=FROM_ENV): the key of $RLMILL_EVENT_KEY / $RLMILL_EVENT_KEY_FILE


@dataclass
class ConsumeResult:
    """What one consume() call did."""

    read: int = 0  # stream entries handled (and acked)
    answers: int = 0  # answer events committed
    feedback: int = 0  # feedback events committed
    duplicates: int = 0  # events skipped because their id was already committed
    quarantined: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # quarantine reason -> count
    segments: list[str] = field(default_factory=list)  # manifest URIs committed
    dead_lettered: int = 0  # entries delivered too often, moved to the dead-letter stream (deliveries.py)
    claimed: int = 0  # entries taken over from a consumer that left them pending
    versions_corrected: int = 0  # feedback naming another version than its answer's: stored with the answer's
    isolated: int = 0  # batches that failed as a whole and were committed one entry at a time
    stopped_early: bool = False  # max_s ran out (or stop was set) with entries possibly still waiting


def _ensure_group(client, stream: str, group: str) -> None:
    import redis

    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _entries(response, key: bytes | None) -> list[tuple[str, Any]]:
    if not response:
        return []
    out = []
    for _stream, items in response:
        for sid, fields in items:
            sid = sid.decode() if isinstance(sid, bytes) else sid
            out.append((sid, decode(fields, key)))
    return out


def consume(root: str, redis_url: str, *, stream: str = STREAM, group: str = GROUP, consumer: str = "consumer-1",
            batch: int = 500, follow: bool = False, block_ms: int = 1000, max_s: float | None = None, storage=None,
            after_commit: Callable[[ConsumeResult], None] | None = None,
            on_segment: Callable[[Segment], None] | None = None, stop: threading.Event | None = None,
            linger_s: float = 1.0, max_deliveries: int = MAX_DELIVERIES, claim_idle_s: float = CLAIM_IDLE_S,
            trim: bool = True, event_key: bytes | str | None = FROM_ENV) -> ConsumeResult:
    """Read the stream as `consumer` of `group`, commit segments, ack (see the module docstring;
    `on_segment` per committed segment, `after_commit` per batch before its XACK). Without `follow`,
    returns once nothing new waits; past `max_s` or once `stop` is set, reads no new batch.
    `event_key`: entries must be signed with it (signing.py); FROM_ENV: the environment's, if any
    (an unusable one raises signing.SigningKeyError); None: nothing verified."""
    import redis

    from storage.fs import redact_url
    from storage.layout import check_root

    _check_bounds(max_s, max_deliveries)
    key = _key(event_key)
    client = connect(redis_url)
    check_root(root)
    _ensure_group(client, stream, group)
    index, result, cursor = CommittedIds(storage), ConsumeResult(), "0"  # own pending entries first
    deadline = None if max_s is None else time.monotonic() + max_s
    outage, ledger = Outage(redact_url(redis_url)), Deliveries(client, stream, group, consumer, max_deliveries)
    result.claimed += ledger.claim_abandoned(claim_idle_s, batch)
    while True:
        try:
            if outage.since is not None:  # back from an outage: the group may be new, pending first
                _ensure_group(client, stream, group)
            if follow and cursor == ">" and (claimed := ledger.claim_if_due(claim_idle_s, batch)):
                result.claimed, cursor = result.claimed + claimed, "0"  # taken over: read them next
            entries = _read_batch(client, group, consumer, stream, cursor, batch, block_ms if follow else None,
                                  linger_s if follow else 0.0, deadline, key)
            if entries:
                _handle_batch(entries, cursor, ledger, result, lambda: Round(root, index, result, storage,
                                                                             on_segment), after_commit)
                if trim:
                    trim_acknowledged(client, stream)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if not follow:
                raise _gone(redact_url(redis_url), exc) from None
            # Following: wait it out. Entries read and not acked are redelivered (pending first)
            # and the committed-ids index skips what a round already committed.
            outage.wait(exc, stop)
            cursor = "0"
            if _ended(deadline, stop):
                result.stopped_early = True
                return result
            continue
        outage.over()
        if not entries:
            if cursor == "0":  # own pending entries done: new ones next
                cursor = ">"
                continue
            if not follow:
                return result
        # Checked after a read, never before the first: a bound smaller than one read still drains a batch.
        if _ended(deadline, stop):
            result.stopped_early = True
            return result


def _key(event_key: bytes | str | None) -> bytes | None:
    from gpu_jobs.online.signing import event_key as from_env

    return from_env() if event_key == FROM_ENV else event_key


def _gone(shown_url: str, exc: Exception) -> BrokerUnreachable:
    return BrokerUnreachable(f"the event broker at {shown_url} went away mid-drain ({' '.join(str(exc).split())}): "
                             "what was committed stays committed; run the consumer again once the broker is back")


def _check_bounds(max_s: float | None, max_deliveries: int) -> None:
    if max_s is not None and not max_s > 0:
        raise ValueError(f"max_s={max_s!r}: give a positive number of seconds, or None for no bound")
    if not (isinstance(max_deliveries, int) and max_deliveries >= 1):
        raise ValueError(f"max_deliveries={max_deliveries!r}: give 1 or more")


def outage(exc: BaseException) -> bool:
    """Whether `exc` is the broker's or storage's failure (connection, timeout, S3 error, ...),
    not something about the entries being committed."""
    import redis

    from storage.errors import StorageError

    if isinstance(exc, (redis.RedisError, OSError, StorageError)):
        return True
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # pragma: no cover - s3fs brings botocore
        return False
    return isinstance(exc, (BotoCoreError, ClientError))


def _handle_batch(entries: list[tuple[str, Any]], cursor: str, ledger: Deliveries, result: ConsumeResult,
                  new_round: Callable[[], Round], after_commit: Callable[[ConsumeResult], None] | None) -> None:
    """Screen pending entries for dead letters, commit the rest, ack them all. A broker or storage
    failure gives the batch its delivery back before it propagates (`outage`); any other failure
    is some entry's: the batch is committed again one entry at a time (_isolate)."""
    counts = ledger.counts([sid for sid, _ in entries]) if cursor == "0" else {}
    if cursor == "0":
        live, dead = ledger.screen(entries)
        result.dead_lettered += len(dead)
    else:
        live = entries
    try:
        if live:
            new_round().run(live)
    except Exception as exc:  # noqa: BLE001 -- sorted by outage(): given back, or found and quarantined
        if outage(exc):
            ledger.forgive(live, counts)
            raise
        _isolate(live, counts, ledger, result, new_round, exc)
    if after_commit is not None:
        after_commit(result)
    if live:
        ledger.client.xack(ledger.stream, ledger.group, *[sid for sid, _ in live])
    result.read += len(entries)


def _isolate(live: list[tuple[str, Any]], counts: dict[str, int], ledger: Deliveries, result: ConsumeResult,
             new_round: Callable[[], Round], failure: Exception) -> None:
    """Commit `live` one entry at a time after the batch failed with `failure` (not an outage): an
    entry whose own round fails too is quarantined with that error. What the failed attempt had
    committed is skipped as a duplicate. Should even the quarantine fail (not an outage), that
    propagates, unforgiven: the delivery counts toward the dead letter (deliveries.py)."""
    log.warning("rlmill: a batch of %d entries failed (%s: %s): committing them one at a time", len(live),
                type(failure).__name__, " ".join(str(failure).split())[:200])
    result.isolated += 1
    for i, (sid, e) in enumerate(live):
        try:
            try:
                new_round().run([(sid, e)])
            except Exception as exc:  # noqa: BLE001 -- see outage()
                if outage(exc):
                    raise
                alone = new_round()
                alone.quarantine.append((sid, e, f"the consumer failed on it ({type(exc).__name__}: "
                                                 f"{' '.join(str(exc).split())[:200]})"))
                alone.commit_quarantine()
        except Exception as exc:
            if outage(exc):
                ledger.forgive(live[i:], counts)
            raise


def _read_batch(client, group: str, consumer: str, stream: str, cursor: str, batch: int, block_ms: int | None,
                linger_s: float, deadline: float | None, key: bytes | None) -> list[tuple[str, Any]]:
    """Up to `batch` entries from `cursor` ("0": own pending ones, ">": new ones). New entries are
    waited for up to `block_ms` (None: not at all), never past `deadline`, and then for up to
    `linger_s` more (_linger)."""
    block = None
    if cursor == ">" and block_ms is not None:  # never past the bound, and never 0 (forever)
        block = block_ms if deadline is None else max(1, min(block_ms, int(1000 * (deadline - time.monotonic()))))
    entries = _entries(client.xreadgroup(group, consumer, {stream: cursor}, count=batch, block=block), key)
    if entries and cursor == ">" and linger_s > 0:
        entries += _linger(client, group, consumer, stream, batch - len(entries), linger_s, deadline, key)
    return entries


def _ended(deadline: float | None, stop: threading.Event | None) -> bool:
    """The bound ran out or `stop` was set."""
    return (deadline is not None and time.monotonic() >= deadline) or (stop is not None and stop.is_set())


def _linger(client, group: str, consumer: str, stream: str, room: int, linger_s: float,
            deadline: float | None, key: bytes | None) -> list[tuple[str, Any]]:
    """Up to `room` more new entries, read for at most `linger_s` (and not past `deadline`)."""
    more: list[tuple[str, Any]] = []
    until = time.monotonic() + linger_s if deadline is None else min(deadline, time.monotonic() + linger_s)
    while len(more) < room and (left := until - time.monotonic()) > 0.001:
        got = _entries(client.xreadgroup(group, consumer, {stream: ">"}, count=room - len(more),
                                         block=max(1, int(1000 * left))), key)
        if not got:
            break
        more += got
    return more

"""The stream -> Parquet segments, committed through storage's manifest, acked after the commit.

    result = consume("s3://bucket/rl", "redis://127.0.0.1:6379/0")   # drain what is there, then return
    consume(root, url, follow=True)                                    # keep reading (rlmill feedback consume --follow)
    consume(root, url, max_s=45, on_segment=print)                     # one bounded drain (the rl-feedback flow)
    group_lag("redis://127.0.0.1:6379/0")                              # what waits for the consumer group

Layout: <root>/feedback/<model>/<yyyy-mm-dd-hh>/segment-<first event id>/ holds answers-*.parquet
(one row per choice) and feedback-*.parquet, published by a `_MANIFEST.json` (kind
"feedback-segment") that also lists the segment's event ids and answer ids. The hour is the
event's `created` time in UTC. Events the quality gate refuses (great-expectations over
events.gate_columns, as for rollouts; and feedback for an answer never logged) go, whole and with
the reason, to <root>/feedback/_quarantine/<yyyy-mm-dd-hh>/segment-<first event id>/: counted, never dropped.

No entry can stop it: each is parsed against the strict schema (events.py) and one that fails,
or whose row cannot be built, is quarantined alone; an entry the consumer keeps dying on goes to
the dead-letter stream after `max_deliveries`, a vanished consumer's pending entries are taken
over after `claim_idle_s`, and acknowledged entries are trimmed from the stream (deliveries.py).

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

import datetime as dt
import io
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from gpu_jobs.online.answers import id_time
from gpu_jobs.online.broker import GROUP, STREAM, BrokerUnreachable, connect
from gpu_jobs.online.deliveries import (CLAIM_IDLE_S, MAX_DELIVERIES, Deliveries, GroupLag, Outage, group_lag,
                                        id_time_of_stream, trim_acknowledged)
from gpu_jobs.online.events import (answers_table, check_event, decode, feedback_table, gate_columns,
                                    gate_expectations, quarantine_table)

__all__ = ["FEEDBACK_DIR", "QUARANTINE_DIR", "QUARANTINE_KIND", "SEGMENT_KIND", "ConsumeResult", "GroupLag",
           "Segment", "consume", "group_lag", "hour_of", "manifest_rows", "segment_manifests"]

log = logging.getLogger("rlmill.feedback")

FEEDBACK_DIR = "feedback"
QUARANTINE_DIR = "_quarantine"  # not a valid model name (check_name), so it never collides with one
SEGMENT_KIND = "feedback-segment"
QUARANTINE_KIND = "feedback-quarantine"


@dataclass(frozen=True)
class Segment:
    """One segment, right after its manifest was committed (what `on_segment` receives)."""

    uri: str  # its _MANIFEST.json
    kind: str  # SEGMENT_KIND (answers + feedback of one model and hour) or QUARANTINE_KIND
    model: str | None  # None for a quarantine segment (its events may name no valid model)
    hour: str  # the yyyy-mm-dd-hh folder it is in
    answers: int = 0
    feedback: int = 0
    quarantined: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # quarantine reason -> count


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
    stopped_early: bool = False  # max_s ran out (or stop was set) with entries possibly still waiting


def hour_of(ts: float) -> str:
    """The UTC hour folder name of a Unix time.

    >>> hour_of(0.0)
    '1970-01-01-00'
    """
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d-%H")


class _CommittedIds:
    """Event ids and answer ids of committed segments, per hour folder, read from the manifests."""

    def __init__(self, storage=None):
        self.storage = storage
        self._folders: dict[str, tuple[set[str], set[str]]] = {}

    def folder(self, url: str) -> tuple[set[str], set[str]]:
        if url not in self._folders:
            events, answers = set(), set()
            for m in segment_manifests(url, self.storage):
                events.update(m.extra.get("event_ids", ()))
                answers.update(m.extra.get("answer_ids", ()))
            self._folders[url] = (events, answers)
        return self._folders[url]


def segment_manifests(folder_url: str, storage=None) -> list:
    """The committed segment manifests under `folder_url` (recursively), oldest name first; one
    that a later segment `replaces` (rlmill feedback forget's rewrite, committed before the old
    folder is removed: gpu_jobs/online/forget.py) is left out, so no reader sees a row twice."""
    from storage import read_manifest, url_to_fs
    from storage.manifest import MANIFEST_NAME

    fs, path = url_to_fs(folder_url, storage)
    if not fs.exists(path):
        return []
    found = sorted(p for p in fs.find(path) if p.endswith("/" + MANIFEST_NAME) and "/segment-" in p)
    prefix = folder_url.rstrip("/")
    manifests = [read_manifest(prefix + p[len(path.rstrip("/")):], storage) for p in found]
    def tail(uri: str) -> str:  # <hour>/<segment>/_MANIFEST.json: the same whatever spelling of the root
        return "/".join(uri.rsplit("/", 3)[-3:])

    replaced = {tail(u) for m in manifests for u in m.extra.get("replaces", ())}
    return [m for m in manifests if tail(m.uri) not in replaced]


def manifest_rows(manifest, files=None, storage=None) -> list[dict]:
    """The rows of a committed manifest's Parquet `files` (default: all it lists), verified on read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from storage.manifest import read_files

    files = manifest.files if files is None else files
    return [r for data in read_files(manifest, files, storage=storage)
            for r in pq.read_table(pa.BufferReader(data), use_threads=False).to_pylist()]


def _parquet(table) -> bytes:
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(table, sink, use_dictionary=False)
    return sink.getvalue()


def _commit_segment(dest: str, tables: dict[str, Any], kind: str, extra: dict, storage=None) -> str:
    """Write the tables under fresh names and commit them; an existing commit with the same
    event ids (a re-commit of the same batch) is returned as it is."""
    from storage import committed, read_manifest, write_files
    from storage import commit as commit_files
    from storage.errors import ManifestExistsError

    if (uri := committed(dest, storage)) is not None and _same_ids(read_manifest(uri, storage), extra):
        return uri
    attempt = uuid.uuid4().hex[:12]
    blobs = {f"{name}-{attempt}.parquet": _parquet(t) for name, t in tables.items()}
    rows = {f"{name}-{attempt}.parquet": t.num_rows for name, t in tables.items()}
    files = write_files(dest, blobs, storage, rows=rows)
    metrics = {name: t.num_rows for name, t in tables.items()}
    try:
        return commit_files(dest, files, kind=kind, metrics=metrics, extra=extra, storage=storage)
    except ManifestExistsError:
        uri = committed(dest, storage)
        if uri is not None and _same_ids(read_manifest(uri, storage), extra):
            return uri
        raise


def _same_ids(manifest, extra: dict) -> bool:
    return set(extra["event_ids"]) <= set(manifest.extra.get("event_ids", ()))


class _Round:
    """One batch of stream entries: gate, dedupe, group, commit."""

    def __init__(self, root: str, index: _CommittedIds, result: ConsumeResult, storage=None,
                 on_segment: Callable[[Segment], None] | None = None):
        self.root, self.index, self.result, self.storage = root, index, result, storage
        self.on_segment = on_segment
        self.quarantine: list[tuple[str, Any, str]] = []

    def folder(self, model: str, hour: str) -> str:
        from storage import join

        return join(self.root, FEEDBACK_DIR, model, hour)

    def run(self, entries: list[tuple[str, Any]]) -> None:
        good: dict[tuple[str, str], list[dict]] = {}
        seen: set[str] = set()
        round_answers = set()
        refused = gate(entries)
        for i, (sid, e) in enumerate(entries):
            if i in refused:
                self.quarantine.append((sid, e, refused[i]))
            elif e["event_id"] in seen:
                self.result.duplicates += 1
            else:
                seen.add(e["event_id"])
                good.setdefault((e["model"], hour_of(e["created"])), []).append((sid, e))
                if e["kind"] == "answer":
                    round_answers.add(e["answer_id"])
        for (model, hour), items in sorted(good.items()):
            self._commit_group(model, hour, [(sid, e) for sid, e in items], round_answers)
        self._commit_quarantine()

    def _answer_known(self, e: dict, round_answers: set[str]) -> bool:
        if e["answer_id"] in round_answers:
            return True
        born = id_time(e["answer_id"])
        if born is None:
            return False
        return any(e["answer_id"] in self.index.folder(self.folder(e["model"], hour_of(t)))[1]
                   for t in (born, born - 3600))  # the request's start may be in the hour before its id's

    def _commit_group(self, model: str, hour: str, items: list[tuple[str, dict]], round_answers: set[str]) -> None:
        folder = self.folder(model, hour)
        done_events, done_answers = self.index.folder(folder)
        keep = []
        for sid, e in items:
            if e["event_id"] in done_events:
                self.result.duplicates += 1
            elif e["kind"] == "feedback" and not self._answer_known(e, round_answers):
                self.quarantine.append((sid, e, f"feedback for answer {e['answer_id']} that was never logged"))
            else:
                keep.append(e)
        if not keep:
            return
        answers = self._storable([e for e in keep if e["kind"] == "answer"], items, answers_table)
        feedback = self._storable([e for e in keep if e["kind"] == "feedback"], items, feedback_table)
        keep = answers + feedback
        if not keep:
            return
        extra = {"event_ids": [e["event_id"] for e in keep], "answer_ids": [e["answer_id"] for e in answers]}
        from storage import join

        dest = join(folder, f"segment-{keep[0]['event_id']}")
        uri = _commit_segment(dest, {"answers": answers_table(answers), "feedback": feedback_table(feedback)},
                              SEGMENT_KIND, extra, self.storage)
        done_events.update(extra["event_ids"])
        done_answers.update(extra["answer_ids"])
        self.result.answers += len(answers)
        self.result.feedback += len(feedback)
        self.result.segments.append(uri)
        self._committed(Segment(uri, SEGMENT_KIND, model, hour, answers=len(answers), feedback=len(feedback)))

    def _storable(self, events: list[dict], items: list[tuple[str, dict]], table: Callable) -> list[dict]:
        """The events whose rows `table` can build; any other goes to quarantine with the error.
        One table for all first; only when that fails, one per event to find which."""
        try:
            table(events)
            return events
        except Exception:  # noqa: BLE001 -- any error building rows is that data's problem
            pass
        sid_of = {id(e): sid for sid, e in items}
        ok = []
        for e in events:
            try:
                table([e])
                ok.append(e)
            except Exception as exc:  # noqa: BLE001
                self.quarantine.append((sid_of[id(e)], e, f"cannot be stored: {type(exc).__name__}: "
                                                         f"{' '.join(str(exc).split())[:200]}"))
        return ok

    def _committed(self, segment: Segment) -> None:
        if self.on_segment is not None:
            self.on_segment(segment)

    def _commit_quarantine(self) -> None:
        from storage import join

        by_hour: dict[str, list] = {}
        for sid, e, reason in self.quarantine:  # filed by the entry's stream time: `created` may be anything
            by_hour.setdefault(hour_of(entry_time(sid)), []).append((sid, e, reason))
        for hour, items in sorted(by_hour.items()):
            folder = join(self.root, FEEDBACK_DIR, QUARANTINE_DIR, hour)
            done = self.index.folder(folder)[0]
            keys = [_quarantine_key(sid, e) for sid, e, _ in items]
            fresh = [(k, it) for k, it in zip(keys, items) if k not in done]
            self.result.duplicates += len(items) - len(fresh)
            if not fresh:
                continue
            extra = {"event_ids": [k for k, _ in fresh], "answer_ids": []}
            dest = join(folder, f"segment-{fresh[0][1][0]}")  # a stream id: safe in a path
            uri = _commit_segment(dest, {"quarantine": quarantine_table([it for _, it in fresh])},
                                  QUARANTINE_KIND, extra, self.storage)
            done.update(extra["event_ids"])
            self.result.segments.append(uri)
            reasons: dict[str, int] = {}
            for _, (sid, e, reason) in fresh:
                kind = _reason_kind(reason)
                reasons[kind] = reasons.get(kind, 0) + 1
                log.warning("quarantined stream entry %s: %s", sid, reason)
            self.result.quarantined += len(fresh)
            for kind, n in reasons.items():
                self.result.reasons[kind] = self.result.reasons.get(kind, 0) + n
            self._committed(Segment(uri, QUARANTINE_KIND, None, hour, quarantined=len(fresh), reasons=reasons))


def gate(entries: list[tuple[str, Any]]) -> dict[int, str]:
    """The stream's quality gate (great-expectations, storage.quality.run_gate, as for rollouts)
    over one batch of entries: {row: reason} for the events it refuses. The reason is the check's
    own words (events.check_event), or the failed expectations where that has none."""
    import pandas as pd

    from storage.quality import run_gate

    events = [e for _, e in entries]
    received = [entry_time(sid) for sid, _ in entries]
    df = pd.DataFrame({"stream_id": [sid for sid, _ in entries]})
    result = run_gate("feedback-events", df, gate_columns(events, received), gate_expectations,
                      on_failure="quarantine")
    if result.passed:
        return {}
    return {int(row): check_event(events[int(row)], received[int(row)]) or "failed " + ", ".join(failed)
            for row, failed in zip(result.quarantined["dq_row"], result.quarantined["dq_failures"])}


def _reason_kind(reason: str) -> str:
    """The reason without the event's own details, to count by."""
    if reason.startswith("feedback for answer"):
        return "feedback for an answer never logged"
    return reason.split(" (")[0].split(":")[0]


def _quarantine_key(sid: str, e: Any) -> str:
    """The stream entry's id: stable across redeliveries of the entry, and distinct for two entries
    that claim one event id (an event id is the producer's word, and a refused entry's is not
    trusted)."""
    return f"stream:{sid}"


def entry_time(sid: str) -> float:
    """When an entry reached the stream, from its id, but never later than now: an id given
    explicitly to XADD may claim any time."""
    now = time.time()
    t = id_time_of_stream(sid)
    return t if 0 < t <= now else now


def _ensure_group(client, stream: str, group: str) -> None:
    import redis

    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _entries(response) -> list[tuple[str, Any]]:
    if not response:
        return []
    out = []
    for _stream, items in response:
        for sid, fields in items:
            sid = sid.decode() if isinstance(sid, bytes) else sid
            out.append((sid, decode(fields)))
    return out


def consume(root: str, redis_url: str, *, stream: str = STREAM, group: str = GROUP, consumer: str = "consumer-1",
            batch: int = 500, follow: bool = False, block_ms: int = 1000, max_s: float | None = None, storage=None,
            after_commit: Callable[[ConsumeResult], None] | None = None,
            on_segment: Callable[[Segment], None] | None = None, stop: threading.Event | None = None,
            linger_s: float = 1.0, max_deliveries: int = MAX_DELIVERIES, claim_idle_s: float = CLAIM_IDLE_S,
            trim: bool = True) -> ConsumeResult:
    """Read the stream as `consumer` of `group`, commit segments, ack (see the module docstring;
    `on_segment` per committed segment, `after_commit` per batch before its XACK). Without `follow`,
    returns once nothing new waits; past `max_s` or once `stop` is set, reads no new batch."""
    import redis

    from storage.fs import redact_url
    from storage.layout import check_root

    _check_bounds(max_s, max_deliveries)
    client = connect(redis_url)
    check_root(root)
    _ensure_group(client, stream, group)
    index, result, cursor = _CommittedIds(storage), ConsumeResult(), "0"  # own pending entries first
    deadline = None if max_s is None else time.monotonic() + max_s
    outage = Outage(redact_url(redis_url))
    ledger = Deliveries(client, stream, group, consumer, max_deliveries)
    result.claimed += ledger.claim_abandoned(claim_idle_s, batch)
    while True:
        try:
            if outage.since is not None:  # back from an outage: the group may be new, pending first
                _ensure_group(client, stream, group)
            if follow and cursor == ">" and (claimed := ledger.claim_if_due(claim_idle_s, batch)):
                result.claimed, cursor = result.claimed + claimed, "0"  # taken over: read them next
            entries = _read_batch(client, group, consumer, stream, cursor, batch, block_ms if follow else None,
                                  linger_s if follow else 0.0, deadline)
            if entries:
                _handle_batch(entries, cursor, ledger, result, lambda e: _Round(
                    root, index, result, storage, on_segment).run(e), after_commit)
                if trim:
                    trim_acknowledged(client, stream)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if not follow:
                raise BrokerUnreachable(f"the event broker at {redact_url(redis_url)} went away mid-drain "
                                        f"({' '.join(str(exc).split())}): what was committed stays committed; "
                                        "run the consumer again once the broker is back") from None
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


def _check_bounds(max_s: float | None, max_deliveries: int) -> None:
    if max_s is not None and not max_s > 0:
        raise ValueError(f"max_s={max_s!r}: give a positive number of seconds, or None for no bound")
    if not (isinstance(max_deliveries, int) and max_deliveries >= 1):
        raise ValueError(f"max_deliveries={max_deliveries!r}: give 1 or more")


def _handle_batch(entries: list[tuple[str, Any]], cursor: str, ledger: Deliveries, result: ConsumeResult,
                  commit: Callable[[list], None], after_commit: Callable[[ConsumeResult], None] | None) -> None:
    """Screen pending entries for dead letters, commit the rest, ack them all. A failure other
    than the broker's (storage down) gives the batch its delivery back before it propagates."""
    import redis

    counts = ledger.counts([sid for sid, _ in entries]) if cursor == "0" else {}
    if cursor == "0":
        live, dead = ledger.screen(entries)
        result.dead_lettered += len(dead)
    else:
        live = entries
    try:
        if live:
            commit(live)
    except (redis.ConnectionError, redis.TimeoutError):
        raise
    except Exception:
        ledger.forgive(live, counts)
        raise
    if after_commit is not None:
        after_commit(result)
    if live:
        ledger.client.xack(ledger.stream, ledger.group, *[sid for sid, _ in live])
    result.read += len(entries)


def _read_batch(client, group: str, consumer: str, stream: str, cursor: str, batch: int, block_ms: int | None,
                linger_s: float, deadline: float | None) -> list[tuple[str, Any]]:
    """Up to `batch` entries from `cursor` ("0": own pending ones, ">": new ones). New entries are
    waited for up to `block_ms` (None: not at all), never past `deadline`, and then for up to
    `linger_s` more (_linger)."""
    block = None
    if cursor == ">" and block_ms is not None:  # never past the bound, and never 0 (forever)
        block = block_ms if deadline is None else max(1, min(block_ms, int(1000 * (deadline - time.monotonic()))))
    entries = _entries(client.xreadgroup(group, consumer, {stream: cursor}, count=batch, block=block))
    if entries and cursor == ">" and linger_s > 0:
        entries += _linger(client, group, consumer, stream, batch - len(entries), linger_s, deadline)
    return entries


def _ended(deadline: float | None, stop: threading.Event | None) -> bool:
    """The bound ran out or `stop` was set."""
    return (deadline is not None and time.monotonic() >= deadline) or (stop is not None and stop.is_set())


def _linger(client, group: str, consumer: str, stream: str, room: int, linger_s: float,
            deadline: float | None) -> list[tuple[str, Any]]:
    """Up to `room` more new entries, read for at most `linger_s` (and not past `deadline`)."""
    more: list[tuple[str, Any]] = []
    until = time.monotonic() + linger_s if deadline is None else min(deadline, time.monotonic() + linger_s)
    while len(more) < room and (left := until - time.monotonic()) > 0.001:
        got = _entries(client.xreadgroup(group, consumer, {stream: ">"}, count=room - len(more),
                                         block=max(1, int(1000 * left))))
        if not got:
            break
        more += got
    return more

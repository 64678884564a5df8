"""One batch of stream entries into storage: gate, dedupe, resolve each feedback's answer, commit.

    Round(root, CommittedIds(), ConsumeResult()).run([(stream_id, event_or_Unreadable), ...])

The quality gate (great-expectations over events.gate_columns, as for rollouts) refuses what the
strict schema does not hold; a check that raises on one event (RecursionError, MemoryError, ...)
refuses that event (events.event_problem). Then, against the committed-ids index (segments.py):
- an event id already committed is skipped (a redelivery, a publisher's retried XADD);
- an answer whose id another event already logged is quarantined (serve logs each answer once;
  a second one is forged or broken);
- feedback takes its `version` from the answer it names, found in this batch or in the index of
  the two hour folders the answer's id points to; feedback on an answer never logged is
  quarantined. A feedback event that names another version is stored with the answer's and
  counted (`versions_corrected`): a writer of the stream cannot move a vote to the other arm.
Rows that cannot be built are quarantined one by one. Quarantined entries are filed, whole and
with their reason, by their stream time.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from gpu_jobs.online.answers import id_time
from gpu_jobs.online.deliveries import id_time_of_stream
from gpu_jobs.online.events import answers_table, check_event, feedback_table, gate_columns, gate_expectations, \
    quarantine_table
from gpu_jobs.online.segments import (FEEDBACK_DIR, QUARANTINE_DIR, QUARANTINE_KIND, SEGMENT_KIND, CommittedIds,
                                      Segment, commit_segment, hour_of)

__all__ = ["Round", "entry_time", "gate", "reason_kind"]

log = logging.getLogger("rlmill.feedback")

_LAST_HOUR = 253_402_297_200.0  # 9999-12-31 23:00 UTC, the last hour a folder name can hold


class Round:
    """One batch of stream entries: gate, dedupe, resolve, group, commit (module docstring).
    `result` is the consumer's ConsumeResult, counted into."""

    def __init__(self, root: str, index: CommittedIds, result: Any, storage=None,
                 on_segment: Callable[[Segment], None] | None = None):
        self.root, self.index, self.result, self.storage = root, index, result, storage
        self.on_segment = on_segment
        self.quarantine: list[tuple[str, Any, str]] = []
        self.answers: dict[str, str] = {}  # answer id -> version, of this batch's answers

    def folder(self, model: str, hour: str) -> str:
        from storage import join

        return join(self.root, FEEDBACK_DIR, model, hour)

    def run(self, entries: list[tuple[str, Any]]) -> None:
        good: dict[tuple[str, str], list[tuple[str, dict]]] = {}
        seen: set[str] = set()
        refused = gate(entries)
        for i, (sid, e) in enumerate(entries):
            if i in refused:
                self.quarantine.append((sid, e, refused[i]))
            elif e["event_id"] in seen:
                self.result.duplicates += 1
            elif e["kind"] == "answer" and (why := self._logged_before(e)) is not None:
                self.quarantine.append((sid, e, f"answer {e['answer_id']} {why}"))
            else:
                seen.add(e["event_id"])
                good.setdefault((e["model"], hour_of(e["created"])), []).append((sid, e))
                if e["kind"] == "answer":
                    self.answers[e["answer_id"]] = e["version"]
        for (model, hour), items in sorted(good.items()):
            self._commit_group(model, hour, items)
        self.commit_quarantine()

    def _logged_before(self, e: dict) -> str | None:
        """Why answer event `e` is a second log of its answer id (serve logs each answer once), or
        None. Checked before the batch's feedback is resolved, so a forged second answer event
        never lends its version to feedback; a redelivery of the same event is a duplicate, not this."""
        if e["event_id"] in self.index.folder(self.folder(e["model"], hour_of(e["created"]))).events:
            return None  # committed already: _commit_group skips it as a duplicate
        if e["answer_id"] in self.answers:
            return "logged twice in one batch, by two events"
        if self._committed_version(e) is not None:
            return "was already logged by another event"
        return None

    def _committed_version(self, e: dict) -> str | None:
        """The version of answer e["answer_id"] of model e["model"] as committed, or None."""
        born = id_time(e["answer_id"])
        if born is None or not 3600 < born < _LAST_HOUR:  # an id may claim any time; hour_of needs a year
            return None
        for t in (born, born - 3600):  # the request's start may be in the hour before its id's
            if (version := self.index.version_of(self.folder(e["model"], hour_of(t)), e["answer_id"])) is not None:
                return version
        return None

    def _resolved(self, sid: str, e: dict) -> dict | None:
        """The event as it is stored (feedback with its answer's version), or None: skipped or quarantined."""
        if e["kind"] == "answer":
            return e
        version = self.answers.get(e["answer_id"]) or self._committed_version(e)
        if version is None:
            self.quarantine.append((sid, e, f"feedback for answer {e['answer_id']} that was never logged"))
            return None
        if version != e["version"]:
            self.result.versions_corrected += 1
            log.warning("stream entry %s: feedback names version %r, its answer %s was answered by %r: stored with "
                        "the answer's", sid, e["version"], e["answer_id"], version)
            return {**e, "version": version}
        return e

    def _commit_group(self, model: str, hour: str, items: list[tuple[str, dict]]) -> None:
        from storage import join

        folder = self.folder(model, hour)
        done = self.index.folder(folder)
        keep = []
        for sid, e in items:
            if e["event_id"] in done.events:
                self.result.duplicates += 1
            elif (stored := self._resolved(sid, e)) is not None:
                keep.append((sid, stored))
        answers = self._storable([it for it in keep if it[1]["kind"] == "answer"], answers_table)
        feedback = self._storable([it for it in keep if it[1]["kind"] == "feedback"], feedback_table)
        if not answers and not feedback:
            return
        extra = {"event_ids": [e["event_id"] for e in answers + feedback],
                 "answer_ids": [e["answer_id"] for e in answers],
                 "answer_versions": {e["answer_id"]: e["version"] for e in answers}}
        dest = join(folder, f"segment-{(answers + feedback)[0]['event_id']}")
        uri = commit_segment(dest, {"answers": answers_table(answers), "feedback": feedback_table(feedback)},
                             SEGMENT_KIND, extra, self.storage)
        done.events.update(extra["event_ids"])
        done.answers.update(extra["answer_ids"])
        done.versions.update(extra["answer_versions"])
        self.result.answers += len(answers)
        self.result.feedback += len(feedback)
        self.result.segments.append(uri)
        self._committed(Segment(uri, SEGMENT_KIND, model, hour, answers=len(answers), feedback=len(feedback)))

    def _storable(self, items: list[tuple[str, dict]], table: Callable) -> list[dict]:
        """The events whose rows `table` can build; any other goes to quarantine with the error.
        One table for all first; only when that fails, one per event to find which."""
        events = [e for _, e in items]
        try:
            table(events)
            return events
        except Exception:  # noqa: BLE001 -- any error building rows is that data's problem
            pass
        ok = []
        for sid, e in items:
            try:
                table([e])
                ok.append(e)
            except Exception as exc:  # noqa: BLE001
                self.quarantine.append((sid, e, f"cannot be stored: {type(exc).__name__}: "
                                                f"{' '.join(str(exc).split())[:200]}"))
        return ok

    def _committed(self, segment: Segment) -> None:
        if self.on_segment is not None:
            self.on_segment(segment)

    def commit_quarantine(self) -> None:
        """Commit what `quarantine` holds, filed by each entry's stream time (`created` may be anything)."""
        from storage import join

        by_hour: dict[str, list] = {}
        for sid, e, reason in self.quarantine:
            by_hour.setdefault(hour_of(entry_time(sid)), []).append((sid, e, reason))
        for hour, items in sorted(by_hour.items()):
            folder = join(self.root, FEEDBACK_DIR, QUARANTINE_DIR, hour)
            done = self.index.folder(folder).events
            # keyed by stream id: stable across redeliveries, and distinct for two entries that
            # claim one event id (a refused entry's event id is not trusted)
            fresh = [(f"stream:{it[0]}", it) for it in items if f"stream:{it[0]}" not in done]
            self.result.duplicates += len(items) - len(fresh)
            if not fresh:
                continue
            extra = {"event_ids": [k for k, _ in fresh], "answer_ids": []}
            dest = join(folder, f"segment-{fresh[0][1][0]}")  # a stream id: safe in a path
            uri = commit_segment(dest, {"quarantine": quarantine_table([it for _, it in fresh])},
                                 QUARANTINE_KIND, extra, self.storage)
            done.update(extra["event_ids"])
            self.result.segments.append(uri)
            reasons: dict[str, int] = {}
            for _, (sid, e, reason) in fresh:
                reasons[reason_kind(reason)] = reasons.get(reason_kind(reason), 0) + 1
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


def reason_kind(reason: str) -> str:
    """The reason without the event's own details, to count by."""
    for words, kind in (("that was never logged", "feedback for an answer never logged"),
                        ("logged twice in one batch", "an answer logged twice"),
                        ("was already logged by another event", "an answer logged twice")):
        if words in reason:
            return kind
    return reason.split(" (")[0].split(":")[0]


def entry_time(sid: str) -> float:
    """When an entry reached the stream, from its id, but never later than now: an id given
    explicitly to XADD may claim any time."""
    now = time.time()
    t = id_time_of_stream(sid)
    return t if 0 < t <= now else now

"""The online loop's audit: after a fault, no feedback row trained twice or skipped, and CURRENT and
serve only ever named versions that were promoted (or the running canary's candidate).

    layout = collect(root, "arith")        # what storage holds, as plain data (reads segments, windows, history)
    report = check(layout)                 # pure arithmetic on it
    report.trained_twice, report.skipped   # feedback rows: both must be 0
    report.line()                          # one line for the chaos table

What it checks (issue 26, item 5):
- every committed feedback segment is in exactly one window: none in two (its rows would train
  twice), none left out while a later window was claimed (its rows would never train; a window
  claims every segment no window holds, so one committed before a window's claim and held by
  none was skipped). Segments committed after the last window wait for the next one: counted as
  `waiting`, not a fault;
- each finished window trained what its segments hold: its done record's feedback rows equal the
  segments' own (their manifests' counts), and its training rows equal both the rows rebuilt from
  those segments now and the rows of the file the run trained on;
- every version CURRENT ever named (models/<name>/CURRENT and history) has a committed version
  folder, and each move has its proof: a retrain's move a done record that promoted that version,
  a canary's move a committed "promote" outcome for it, a rollback record leaves CURRENT where it was;
- every answer in the committed log came from a version CURRENT named or a canary's candidate.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Layout", "OnlineAudit", "check", "collect"]

CLAIM_SLACK_S = 1.0  # window times are whole seconds: a segment this close to a claim may have missed its listing


@dataclass
class Layout:
    """What storage holds for one model, as plain data (`collect` reads it; tests build it by hand)."""

    segments: dict[str, tuple[int, float]]            # segment URI -> (feedback rows, committed at, Unix s)
    windows: dict[int, tuple[float, tuple[str, ...]]]  # seq -> (claimed at, Unix s; the segment URIs it holds)
    done: dict[int, dict[str, Any]] = field(default_factory=dict)  # seq -> done record (rows, feedback_rows, ...)
    rebuilt_rows: dict[int, int] = field(default_factory=dict)     # seq -> training rows rebuilt from its segments
    file_rows: dict[int, int] = field(default_factory=dict)        # seq -> rows in the file its run trained on
    history: list[dict[str, Any]] = field(default_factory=list)    # models/<name>/history records (from, to, by)
    current: str | None = None
    committed_versions: set[str] = field(default_factory=set)      # version folders with a committed index
    promoted_by_canary: set[str] = field(default_factory=set)      # candidates with a committed "promote" outcome
    candidates: set[str] = field(default_factory=set)              # every canary candidate, running or ended
    served: Counter = field(default_factory=Counter)               # version -> answers in the committed log


@dataclass
class OnlineAudit:
    """What `check` found; every list names the offending item with why."""

    in_two: list[str] = field(default_factory=list)        # a segment held by more than one window
    skipped: list[str] = field(default_factory=list)       # a segment no window holds, older than a claim
    miscounted: list[str] = field(default_factory=list)    # a done window whose rows do not add up
    unpromoted: list[str] = field(default_factory=list)    # CURRENT named a version without its proof
    unserved: list[str] = field(default_factory=list)      # an answer from a version never CURRENT nor candidate
    trained_twice: int = 0   # feedback rows trained more than once (the extra times)
    skipped_rows: int = 0    # feedback rows that will never be trained
    waiting: int = 0         # feedback rows committed after the last window: the next one's
    windows: int = 0
    answers: int = 0

    @property
    def problems(self) -> int:
        return len(self.in_two) + len(self.skipped) + len(self.miscounted) + len(self.unpromoted) + len(self.unserved)

    def line(self) -> str:
        s = (f"online audit: {self.windows} window(s); feedback rows {self.trained_twice} trained twice, "
             f"{self.skipped_rows} skipped, {self.waiting} waiting; {self.answers} answer(s) logged, "
             f"{len(self.unserved)} version(s) served without promotion")
        bad = [f"{name}: {'; '.join(v[:2])}" for name, v in (("in two windows", self.in_two), ("skipped", self.skipped),
               ("miscounted", self.miscounted), ("unpromoted", self.unpromoted), ("unserved", self.unserved)) if v]
        return s + (" -- " + " | ".join(bad) if bad else "")


def _check_windows(layout: Layout, out: OnlineAudit) -> None:
    """Every segment in exactly one window; none skipped (see the module docstring)."""
    holders: dict[str, list[int]] = {}
    for seq, (_, uris) in layout.windows.items():
        for uri in uris:
            holders.setdefault(uri, []).append(seq)
    last_claim = max((at for at, _ in layout.windows.values()), default=None)
    for uri, (rows, at) in sorted(layout.segments.items()):
        seqs = holders.get(uri, [])
        if len(seqs) > 1:
            out.in_two.append(f"{uri} in windows {seqs}")
            out.trained_twice += rows * (len(seqs) - 1)
        elif not seqs and rows > 0:
            if last_claim is not None and at + CLAIM_SLACK_S < last_claim:
                out.skipped.append(f"{uri} ({rows} feedback rows) is in no window, committed before window claims")
                out.skipped_rows += rows
            else:
                out.waiting += rows
    for uri, seqs in holders.items():
        if uri not in layout.segments:
            out.miscounted.append(f"windows {seqs} hold {uri}, which is no committed segment")


def _check_done(layout: Layout, out: OnlineAudit) -> None:
    """Each done window's rows: its segments' feedback rows, rebuilt rows, the trained file's rows."""
    for seq, record in sorted(layout.done.items()):
        if seq not in layout.windows:
            out.miscounted.append(f"done record {seq} has no window")
            continue
        own = sum(layout.segments.get(u, (0, 0.0))[0] for u in layout.windows[seq][1])
        said = int(record.get("feedback_rows", own))
        if said != own:
            out.miscounted.append(f"window {seq} says {said} feedback rows, its segments hold {own}")
            out.trained_twice += max(0, said - own)
            out.skipped_rows += max(0, own - said)
        rows = record.get("rows")
        for what, n in (("rebuilt from its segments", layout.rebuilt_rows.get(seq)),
                        ("in the file its run trained on", layout.file_rows.get(seq))):
            if n is not None and rows is not None and int(rows) != n:
                out.miscounted.append(f"window {seq} trained {rows} rows, {n} {what}")


def _check_versions(layout: Layout, out: OnlineAudit) -> None:
    """CURRENT only ever named committed versions, each move with its proof; serve only those or candidates."""
    promoted_by_retrain = {str(d["promoted_version"]) for d in layout.done.values() if d.get("promoted_version")}
    named = {v for h in layout.history for v in (h.get("from"), h.get("to")) if v} | ({layout.current} - {None})
    for v in sorted(named - layout.committed_versions):
        out.unpromoted.append(f"{v}: CURRENT named it, no committed version folder")
    for h in layout.history:
        by, to = h.get("by"), h.get("to")
        if by == "retrain" and to not in promoted_by_retrain:
            out.unpromoted.append(f"history {h.get('seq')}: retrain moved CURRENT to {to}, no done record promoted it")
        elif by == "canary" and to not in layout.promoted_by_canary:
            out.unpromoted.append(f"history {h.get('seq')}: canary moved CURRENT to {to} without a promote outcome")
        elif by == "canary-rollback" and h.get("from") != to:
            out.unpromoted.append(f"history {h.get('seq')}: a rollback record moved CURRENT {h.get('from')} -> {to}")
    allowed = named | layout.candidates
    for v, n in sorted(layout.served.items()):
        if v not in allowed:
            out.unserved.append(f"{n} answer(s) from {v}")


def check(layout: Layout) -> OnlineAudit:
    """The audit's arithmetic (the module docstring's four checks) on `layout`.

    >>> seg = {"s1": (3, 10.0), "s2": (2, 20.0), "s3": (4, 100.0)}
    >>> a = check(Layout(seg, {1: (50.0, ("s1", "s2"))}, {1: {"feedback_rows": 5, "rows": 5}}, {1: 5}, {1: 5}))
    >>> (a.trained_twice, a.skipped_rows, a.waiting, a.problems)
    (0, 0, 4, 0)
    """
    out = OnlineAudit(windows=len(layout.windows), answers=sum(layout.served.values()))
    _check_windows(layout, out)
    _check_done(layout, out)
    _check_versions(layout, out)
    return out


# ------------------------------------------------------------------------------------ reading storage
def _ts(iso: str) -> float:
    return dt.datetime.fromisoformat(iso).timestamp() if iso else 0.0


def _file_rows(url: str, storage: Any) -> int | None:
    import pyarrow.parquet as pq

    from storage import url_to_fs

    fs, path = url_to_fs(url, storage)
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as f:
        return pq.ParquetFile(f).metadata.num_rows


def _canary_records(models: Any) -> tuple[set[str], set[str]]:
    """(candidates with a committed promote outcome, every candidate: ended or running)."""
    import json

    from storage import join, url_to_fs
    from gpu_jobs.online.canary import OUTCOMES_DIR, read_canary

    fs, path = url_to_fs(join(models.root, OUTCOMES_DIR), models.storage)
    found = [p for p in fs.ls(path, detail=False) if p.endswith(".json")] if fs.exists(path) else []
    records = [json.loads(b) for b in fs.cat(found).values()] if found else []
    running = read_canary(models)
    candidates = {r["canary"]["candidate"] for r in records} | ({running.candidate} if running else set())
    return {r["canary"]["candidate"] for r in records if r.get("outcome") == "promote"}, candidates


def collect(root: str, model: str, storage: Any = None) -> Layout:
    """Read `model`'s segments, windows, done records, versions, canaries and answer log under `root`."""
    from flows.online.retrain import feedback_pieces, window_rows
    from gpu_jobs.online.dataset import read_segments
    from storage import INDEX_NAME, ModelLayout, committed, join
    from gpu_jobs.online.windows import WindowLog

    models = ModelLayout(root, model, storage)
    windows, done = WindowLog(models).read()
    segments = {p.uri: (p.rows.get("feedback", 0), p.committed_at) for p in feedback_pieces(root, model, storage)}
    history, current = models.history(), models.current_version()
    promoted_by_canary, candidates = _canary_records(models)
    named = {v for h in history for v in (h.get("from"), h.get("to")) if v} | ({current} - {None}) | candidates
    answers = read_segments(root, model, storage)[0] if segments else []
    return Layout(
        segments=segments,
        windows={w.seq: (_ts(w.created_at), tuple(w.uris)) for w in windows},
        done=done,
        rebuilt_rows={w.seq: len(window_rows(root, model, w, storage)) for w in windows if w.seq in done},
        file_rows={w.seq: n for w in windows if w.seq in done
                   and (n := _file_rows(join(models.root, "retrain", w.run_id, "window.parquet"), storage)) is not None},
        history=history, current=current,
        committed_versions={v for v in named if committed(models.version(v), storage, name=INDEX_NAME)},
        promoted_by_canary=promoted_by_canary, candidates=candidates,
        served=Counter(a["version"] for a in answers if a.get("index", 0) == 0))

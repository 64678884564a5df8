"""Training windows: which committed data a retraining run trained on, each piece exactly once.

    log = WindowLog(ModelLayout(root, "arith"))
    w = log.claim(segments, run_id_for=lambda seq: f"retrain-arith-w{seq}")   # None: nothing new
    log.pending()          # the oldest window whose run has not finished (a crashed run's)
    log.finish(w, {"decision": "promote"})                                    # the run is done
    readiness(rows=300, oldest_age_s=12.0, min_rows=256, max_wait_s=300.0)    # whether to start one

Layout: models/<name>/windows/<seq>.json (the window: the manifest URIs it holds with their row
counts, and the run id that trains on it) and models/<name>/windows/<seq>.done.json (that run's
outcome). Both are written create-only (storage's `write_once`: os.link locally, If-None-Match on
S3), the way ModelLayout.record_move writes history records, so a committed window never changes.

Why this is exactly once:
- A window holds the pieces (committed manifests, e.g. feedback segments) that no earlier window
  holds, read from the listing at claim time; a piece committed later is the next window's.
- Two claimers that read the same listing pick the same seq: the create-only write lets one win;
  the loser reads the windows again, finds its pieces held and gets None ("nothing new").
- A run is named after its window (`run_id_for(seq)`), so a retry or resume of that run finds
  its own window by run id (`find`) and trains on the same pieces, never a recomputed set.
- A window whose run crashed has no done record: `pending` hands it to the next run, which
  resumes the same run id from its committed stages, so its pieces are neither skipped nor
  claimed again.

The log knows nothing about what a piece holds: the caller lists them (`Piece`: URI, row counts,
commit time) -- for feedback, gpu_jobs.online.consumer.segment_manifests. A piece committed to
replace others (`aliases`: rlmill feedback forget rewrites a segment under a new URI) is held where
one it replaces is held, and `current_uris` maps a window's URIs to the pieces that hold them now.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from storage.errors import ObjectExistsError
from storage.fs import join, url_to_fs, write_once
from storage.layout import ModelLayout, check_name

__all__ = ["Piece", "Window", "WindowLog", "Readiness", "readiness", "backlog", "current_uris", "WINDOWS_DIR"]

WINDOWS_DIR = "windows"
_DONE = ".done"

log = logging.getLogger("rlmill")


@dataclass(frozen=True)
class Piece:
    """One committed manifest a window can hold: its URI, row counts by table, commit time (Unix s),
    and the URIs of the pieces it replaced (a rewrite without a forgotten party's rows)."""

    uri: str
    rows: dict[str, int] = field(default_factory=dict)
    committed_at: float = 0.0
    aliases: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri, "rows": dict(self.rows), "committed_at": self.committed_at,
                **({"aliases": list(self.aliases)} if self.aliases else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Piece":
        return cls(str(d["uri"]), {str(k): int(v) for k, v in (d.get("rows") or {}).items()},
                   float(d.get("committed_at") or 0.0), tuple(str(a) for a in d.get("aliases") or ()))

    def held_in(self, held: set[str]) -> bool:
        """Whether a window holds this piece, or one it replaced."""
        return self.uri in held or any(a in held for a in self.aliases)


@dataclass(frozen=True)
class Window:
    """A committed window: `seq`, the run that trains on it, the pieces it holds."""

    seq: int
    run_id: str
    pieces: tuple[Piece, ...]
    created_at: str = ""
    uri: str = ""

    def rows(self, table: str) -> int:
        """Rows of `table` (e.g. "feedback") over the window's pieces."""
        return sum(p.rows.get(table, 0) for p in self.pieces)

    @property
    def uris(self) -> list[str]:
        return [p.uri for p in self.pieces]

    def to_json(self) -> str:
        return json.dumps({"seq": self.seq, "run_id": self.run_id, "created_at": self.created_at,
                           "pieces": [p.to_dict() for p in self.pieces]}, indent=1, sort_keys=True)


class WindowLog:
    """The windows of one model: models/<name>/windows/ (see the module docstring).

    Example:
        >>> log = WindowLog(ModelLayout("memory://rlmill-doc-windows", "arith"))
        >>> w = log.claim([Piece("s/1", {"feedback": 3})], run_id_for=lambda seq: f"r-w{seq}")
        >>> (w.seq, w.run_id, w.rows("feedback")), log.claim([Piece("s/1", {"feedback": 3})], lambda s: "x")
        ((1, 'r-w1', 3), None)
    """

    def __init__(self, models: ModelLayout):
        self.models = models
        self.storage = models.storage
        self.dir = join(models.root, WINDOWS_DIR)

    def __repr__(self) -> str:
        return f"WindowLog({self.dir!r})"

    def url(self, seq: int, done: bool = False) -> str:
        return join(self.dir, f"{seq:08d}{_DONE if done else ''}.json")

    # ------------------------------------------------------------------ reading
    def read(self) -> tuple[list[Window], dict[int, dict[str, Any]]]:
        """Every window and every done record, oldest first: one listing, one GET per file."""
        fs, path = url_to_fs(self.dir, self.storage)
        if not fs.exists(path):
            return [], {}
        names = {p.rstrip("/").rsplit("/", 1)[-1]: p for p in fs.ls(path, detail=False)}
        listed = {n: p for n, p in names.items() if n.endswith(".json") and n.split(".", 1)[0].isdigit()}
        blobs = fs.cat(sorted(listed.values())) if listed else {}
        windows, done = [], {}
        for name, p in sorted(listed.items()):
            seq = int(name.split(".", 1)[0])
            try:
                body = json.loads(blobs[p])
                if name.endswith(_DONE + ".json"):
                    done[seq] = body
                elif name == f"{seq:08d}.json":
                    windows.append(Window(seq, check_name(body["run_id"], "run id"),
                                          tuple(Piece.from_dict(d) for d in body["pieces"]), body.get("created_at", ""),
                                          self.url(seq)))
            except (ValueError, KeyError, TypeError) as exc:
                # Records are created whole, so a file that does not parse was put there by
                # someone else; it holds nothing (its pieces go to a later window).
                log.warning("skipping %s: not a window record (%s)", p, exc)
        return sorted(windows, key=lambda w: w.seq), done

    def windows(self) -> list[Window]:
        return self.read()[0]

    def done(self) -> dict[int, dict[str, Any]]:
        """seq -> the outcome record of every finished window."""
        return self.read()[1]

    def find(self, run_id: str) -> Window | None:
        """The window that `run_id` trains on, or None."""
        return next((w for w in self.windows() if w.run_id == run_id), None)

    def pending(self) -> Window | None:
        """The oldest window without a done record (its run is running, or crashed)."""
        windows, done = self.read()
        return next((w for w in windows if w.seq not in done), None)

    def unheld(self, pieces: Iterable[Piece]) -> list[Piece]:
        """The pieces no committed window holds, in the order given."""
        held = {u for w in self.windows() for u in w.uris}
        return [p for p in pieces if not p.held_in(held)]

    # ------------------------------------------------------------------ writing
    def claim(self, pieces: Iterable[Piece], run_id_for: Callable[[int], str]) -> Window | None:
        """Commit a window holding every piece of `pieces` that no window holds yet, trained by
        run `run_id_for(seq)`; None when there is nothing new. Costs one listing and one PUT (a
        lost race: one more listing, then None or the next seq)."""
        pieces = list(pieces)
        while True:
            windows, _ = self.read()
            held = {u for w in windows for u in w.uris}
            new = tuple(p for p in pieces if not p.held_in(held))
            if not new:
                return None
            seq = windows[-1].seq + 1 if windows else 1
            window = Window(seq, check_name(run_id_for(seq), "run id"), new,
                            dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), self.url(seq))
            try:
                write_once(window.uri, window.to_json(), self.storage)
                return window
            except ObjectExistsError:
                continue  # another claimer took this seq: re-read what it holds

    def finish(self, window: Window, outcome: dict[str, Any]) -> dict[str, Any]:
        """Record that `window`'s run finished (create-only); returns the record on file (the
        first one, when a retry finds it already written)."""
        record = {"seq": window.seq, "run_id": window.run_id,
                  "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **outcome}
        try:
            write_once(self.url(window.seq, done=True), json.dumps(record, sort_keys=True, default=str), self.storage)
            return record
        except ObjectExistsError:
            return self.done()[window.seq]


# ------------------------------------------------------------------------------------ readiness
@dataclass(frozen=True)
class Readiness:
    ready: bool
    rows: int  # rows waiting to be trained on
    oldest_age_s: float | None  # age of the oldest piece with rows waiting; None when none waits
    reason: str


def readiness(rows: int, oldest_age_s: float | None, min_rows: int, max_wait_s: float) -> Readiness:
    """"At least `min_rows` waiting rows, or the oldest waiting for `max_wait_s` seconds, whichever
    first" -- never with nothing waiting.

    >>> readiness(300, 10.0, 256, 300.0).ready, readiness(5, 301.0, 256, 300.0).ready
    (True, True)
    >>> readiness(5, 10.0, 256, 300.0).reason
    '5 of 256 rows, oldest 10 s of 300 s: not yet'
    """
    if rows <= 0:
        return Readiness(False, 0, None, "nothing waits")
    if rows >= min_rows:
        return Readiness(True, rows, oldest_age_s, f"{rows} rows >= {min_rows}")
    if oldest_age_s is not None and oldest_age_s >= max_wait_s:
        return Readiness(True, rows, oldest_age_s, f"{rows} rows, the oldest waiting {oldest_age_s:.0f} s >= "
                                                   f"{max_wait_s:.0f} s")
    age = "?" if oldest_age_s is None else f"{oldest_age_s:.0f}"
    return Readiness(False, rows, oldest_age_s, f"{rows} of {min_rows} rows, oldest {age} s of {max_wait_s:.0f} s: "
                                                "not yet")


def backlog(log_: WindowLog, pieces: Iterable[Piece], table: str, now: float) -> tuple[int, float | None]:
    """(rows of `table` not yet trained on, age in seconds of the oldest piece holding some):
    the pieces no window holds plus those of a window whose run has not finished (a crashed run
    still owes them, so they keep the rule true until it is resumed)."""
    windows, done = log_.read()
    held = {u for w in windows for u in w.uris}
    waiting = [p for p in pieces if not p.held_in(held) and p.rows.get(table, 0) > 0]
    waiting += [p for w in windows if w.seq not in done for p in w.pieces if p.rows.get(table, 0) > 0]
    if not waiting:
        return 0, None
    return sum(p.rows.get(table, 0) for p in waiting), max(0.0, now - min(p.committed_at for p in waiting))


def current_uris(uris: Iterable[str], pieces: Iterable[Piece]) -> list[str]:
    """`uris` (a window's) as the pieces that hold them now: a URI a later piece replaced becomes
    that piece's; one no piece holds any more (removed by retention) stays as it is.

    >>> current_uris(["s/1", "s/2"], [Piece("s/1.forget-a", aliases=("s/1",)), Piece("s/2")])
    ['s/1.forget-a', 's/2']
    """
    now = {a: p.uri for p in pieces for a in (p.uri, *p.aliases)}
    return list(dict.fromkeys(now.get(u, u) for u in uris))

"""Retention: raw feedback events, quarantined events and dead letters older than a set age go.

    policy = RetentionPolicy.parse("30d")                  # RetentionPolicy(older_than_s=2592000.0)
    retain(root, policy, redis_url="redis://127.0.0.1:6379/0", dry_run=True)   # what would go
    retain(root, policy, redis_url=...)                    # RetentionResult: removed, kept, dead letters

The unit of removal is an hour folder, `<root>/feedback/<model>/<yyyy-mm-dd-hh>/` (events filed by
their `created` hour) and `<root>/feedback/_quarantine/<yyyy-mm-dd-hh>/` (filed by the hour they
reached the stream): a folder goes once its whole hour is older than the cutoff (now minus
`older_than_s`), so no row younger than the cutoff is removed. A folder that holds a segment of a
retrain window whose run has not finished is kept and named (its run still reads it); it goes at
the first retention after that run finishes. Dead letters (`<stream>:dead`) older than the cutoff
are trimmed by their stream id's time (XTRIM MINID). Forget records (`feedback/_forget/`), window
records and versions stay: they are the audit of what was trained and what was deleted.

Run it daily (the `rl-retention/daily` deployment, flows/online/retention.py) or by hand:
`rlmill feedback retain --root ROOT --older-than 30d [--dry-run]`. The default, 30 days, is the
consumer's own window: an event whose `created` is older than that is refused at the gate, so a
re-published event of a removed hour cannot come back in.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from dataclasses import dataclass, field
from typing import Any

from gpu_jobs.online.events import MAX_EVENT_AGE_S

__all__ = ["RetentionPolicy", "RetentionResult", "parse_age", "retain"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_HOUR = re.compile(r"\d{4}-\d{2}-\d{2}-\d{2}")


def parse_age(text: Any) -> float:
    """'30d', '12h', '90m', '3600s', '2w' (or a number of seconds) -> seconds.

    >>> parse_age("30d"), parse_age("1.5h"), parse_age(60)
    (2592000.0, 5400.0, 60.0)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", str(text))
        if m is None:
            raise ValueError(f"age {text!r}: give a number and a unit, e.g. 30d, 12h, 90m or 3600s")
        value = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if not value > 0 or value == float("inf"):
        raise ValueError(f"age {text!r}: give a positive age, e.g. 30d")
    return value


@dataclass(frozen=True)
class RetentionPolicy:
    """How long raw feedback is kept (the one setting of retention)."""

    older_than_s: float = field(default=MAX_EVENT_AGE_S, metadata={"help": (
        "raw feedback events, quarantined events and dead letters older than this are removed (hour folders "
        "whose whole hour is older; folders an unfinished retrain window holds are kept)")})

    def __post_init__(self) -> None:
        parse_age(self.older_than_s)  # refuses 0, negative, NaN, infinity

    @classmethod
    def parse(cls, text: Any) -> "RetentionPolicy":
        return cls(parse_age(text))


@dataclass
class RetentionResult:
    cutoff: float  # Unix time: what is older goes
    dry_run: bool
    removed: list[str] = field(default_factory=list)  # hour folders removed (with dry_run: that would be)
    kept: dict[str, str] = field(default_factory=dict)  # old enough, kept: folder -> why
    dead_letters: int | None = None  # trimmed (or that would be); None: the broker was not asked
    broker_error: str | None = None  # why the dead letters were not trimmed


def _hour_start(name: str) -> float | None:
    if not _HOUR.fullmatch(name):
        return None
    return dt.datetime.strptime(name, "%Y-%m-%d-%H").replace(tzinfo=dt.timezone.utc).timestamp()


def _held_folders(root: str, model: str, storage: Any) -> dict[str, str]:
    """Hour folders (path tail `<model>/<hour>`) holding a segment of an unfinished window -> why."""
    from storage.layout import ModelLayout

    from gpu_jobs.online.windows import WindowLog

    windows, done = WindowLog(ModelLayout(root, model, storage)).read()
    held = {}
    for w in windows:
        if w.seq not in done:
            for u in w.uris:
                hour = u.rstrip("/").rsplit("/", 3)[-3]
                held[f"{model}/{hour}"] = f"held by window {w.seq} (run {w.run_id}), whose run has not finished"
    return held


def _old_folders(root: str, cutoff: float, storage: Any) -> tuple[list[str], dict[str, str]]:
    """(hour folder URLs to remove, {folder: why kept}) under <root>/feedback/."""
    from gpu_jobs.online.consumer import FEEDBACK_DIR
    from storage import join, url_to_fs

    base = join(root, FEEDBACK_DIR)
    fs, path = url_to_fs(base, storage)
    if not fs.exists(path):
        return [], {}
    go, kept = [], {}
    for top in sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False) if fs.isdir(p)):
        if top.startswith("_") and top != "_quarantine":  # _forget: the audit stays
            continue
        held = {} if top.startswith("_") else _held_folders(root, top, storage)
        for p in sorted(fs.ls(f"{path.rstrip('/')}/{top}", detail=False)):
            hour = p.rstrip("/").rsplit("/", 1)[-1]
            start = _hour_start(hour)
            if start is None or start + 3600 > cutoff:
                continue
            if f"{top}/{hour}" in held:
                kept[join(base, top, hour)] = held[f"{top}/{hour}"]
            else:
                go.append(join(base, top, hour))
    return go, kept


def _trim_dead(redis_url: str, stream: str, cutoff: float, dry_run: bool) -> int:
    from gpu_jobs.online.broker import connect
    from gpu_jobs.online.deliveries import DEAD_SUFFIX

    client = connect(redis_url)
    dead, ms = stream + DEAD_SUFFIX, int(cutoff * 1000)
    if dry_run:
        return len(client.xrange(dead, min="-", max=str(ms - 1)))
    return int(client.xtrim(dead, minid=f"{ms}-0", approximate=False))


def retain(root: str, policy: RetentionPolicy, *, redis_url: str | None = None, stream: str | None = None,
           dry_run: bool = False, now: float | None = None, storage: Any = None) -> RetentionResult:
    """Remove what `policy` says is too old (see the module docstring); with `dry_run`, only
    say what would go. An unreachable broker leaves the dead letters (said in `broker_error`)."""
    from gpu_jobs.online.broker import STREAM, BrokerUnreachable
    from storage import url_to_fs
    from storage.layout import check_root

    check_root(root)
    cutoff = (time.time() if now is None else now) - policy.older_than_s
    result = RetentionResult(cutoff, dry_run)
    result.removed, result.kept = _old_folders(root, cutoff, storage)
    if not dry_run:
        for url in result.removed:
            fs, path = url_to_fs(url, storage)
            fs.rm(path, recursive=True)
    if redis_url is not None:
        try:
            result.dead_letters = _trim_dead(redis_url, stream or STREAM, cutoff, dry_run)
        except BrokerUnreachable as exc:
            result.broker_error = str(exc)
    return result

"""Why a rank group failed, as a RankGroupError: which rank failed first and how (its
traceback, or the signal that killed it), what the other ranks said, and the launcher's log.

The parent learns of a failure from three sources that race: the error files the ranks write
(``error-rank<k>.json``: time, traceback), the times it saw each process exit (pidfds), and
torchrun's exit report in its log. The first rank that raised counts (a collective's error that
only echoes another rank's death counts only if nothing else is known), else the first rank seen
dead; with neither, the caller names the launcher or the deadline.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
from typing import Any, NamedTuple

from .errors import RankGroupError

__all__ = ["Culprit", "read_error_files", "read_log_tail", "exit_codes", "first_causes", "where_failed",
           "rank_failure", "failure_error"]

_SIGNALS = {-s.value: s.name for s in signal.Signals}


class Culprit(NamedTuple):
    """What failed: ``head`` is the report's first line after "rank group failed: "."""

    head: str
    rank: int | None = None
    pid: int | None = None
    traceback_text: str = ""
    traceback_part: str = ""  # "--- rank k traceback ---" section, when the rank raised


def read_error_files(workdir: str) -> dict[int, dict]:
    """rank -> the error its worker recorded (gpu_jobs.train.ranks.worker.write_error)."""
    out = {}
    for path in glob.glob(os.path.join(workdir, "error-rank*.json")):
        try:
            with open(path) as f:
                e = json.load(f)
            out[int(e["rank"])] = e
        except (OSError, ValueError, KeyError):
            pass
    return out


def read_log_tail(path: str, n: int = 12000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def exit_codes(log: str) -> dict[int, int]:
    """pid -> exit code from torchrun's failure report ("exitcode: -9 ... (pid: 123)")."""
    out: dict[int, int] = {}
    for m in re.finditer(r"exitcode\s*:?\s*(-?\d+)\)?[^\n]*?\(?pid:?\s*(\d+)", log):
        out[int(m.group(2))] = int(m.group(1))
    for m in re.finditer(r"exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)", log):
        out[int(m.group(2))] = int(m.group(1))
    return out


def first_causes(errors: dict[int, dict], deaths: dict[Any, float], teardown_at: float
                 ) -> list[tuple[float, bool, int, str]]:
    """(time, is_comm_error, rank, "error" | "died"), earliest first: the ranks that raised or
    died before the teardown, collectives' echoes of another failure only when nothing else is."""
    events = [(e["time"], bool(e.get("comm")), r, "error") for r, e in errors.items()]
    events += [(t, False, r, "died") for r, t in deaths.items()
               if isinstance(r, int) and r not in errors and t < teardown_at]
    return sorted(e for e in events if not e[1]) or sorted(events)


def where_failed(command: str, causes: list[tuple], sent_at: float) -> str:
    if command == "start":
        return "while starting"
    if causes and causes[0][0] < sent_at:
        return f"between calls (found when sending {command!r})"
    return f"while running {command!r}"


def rank_failure(cause: tuple, errors: dict[int, dict], pids: list[int], log_tail: str, where: str) -> Culprit:
    """The culprit a first cause names: the rank's traceback, or how it died."""
    _, _, rank, kind = cause
    pid = pids[rank] if rank < len(pids) else errors.get(rank, {}).get("pid")
    if kind == "error":
        e = errors[rank]
        tb = e["traceback"]
        return Culprit(f"rank {rank} (pid {pid}) raised {e['type']}: {e['message']} {where}", rank, pid, tb,
                       f"--- rank {rank} traceback ---\n{tb.rstrip()}")
    code = exit_codes(log_tail).get(pid)
    how = (f"exit code {code}" + (f" = {_SIGNALS[code]}" if code in _SIGNALS else "")
           if code is not None else "killed by a signal or os._exit")
    return Culprit(f"rank {rank} (pid {pid}) died ({how}) {where}", rank, pid,
                   f"rank {rank} (pid {pid}) died without a Python error ({how})")


def failure_error(command: str, culprit: Culprit, errors: dict[int, dict], log_tail: str,
                  note: str = "") -> RankGroupError:
    """The report: the culprit, the other ranks' errors, the end of the launcher's log."""
    parts = [f"rank group failed: {culprit.head}" + (f" ({note})" if note else "")]
    if culprit.traceback_part:
        parts.append(culprit.traceback_part)
    others = [f"rank {r}: {e['type']}: {e['message'][:200]}" for r, e in sorted(errors.items())
              if r != culprit.rank]
    if others:
        parts.append("--- other ranks ---\n" + "\n".join(others))
    if log_tail:
        parts.append("--- launcher log (end) ---\n" + log_tail[-3000:].rstrip())
    return RankGroupError("\n".join(parts), rank=culprit.rank, pid=culprit.pid, traceback_text=culprit.traceback_text,
                          command=command, log_tail=log_tail)

"""One live process per run id.

Two processes training the same run would race on every stage manifest; the create-only commits
keep the data consistent, but the loser wastes a whole iteration and its warm roles diverge.
So the flow takes an exclusive OS lock keyed by (storage root, run id) before doing any work.

    with RunLock(root_url, run_id):
        ...train...

The lock is a `flock` on a file under ~/.cache/rlmill/locks that records its holder (pid, host,
start time). The kernel releases a flock when its process dies (kill -9 included), so a dead
holder never blocks anyone: the lock is refused only while its holder lives. A holder that
exits normally empties the file; one that died leaves its record behind, and the next start
says so ("found and cleared a stale lock left by pid N ... (no longer running)") before taking
the lock: the run it was training is resumed, not silently taken over. It guards processes on
one machine; runs started on different machines against the same bucket must use different run
ids (the create-only manifests still refuse to overwrite each other's commits).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("rlmill")


class RunLockedError(RuntimeError):
    """Another live process holds the run."""


def _lock_dir() -> Path:
    return Path(os.environ.get("RLMILL_LOCK_DIR", Path.home() / ".cache" / "rlmill" / "locks"))


def _pid_alive(pid: Any) -> bool | None:
    """Whether `pid` names a live process on this machine (None: not a pid)."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _holder(text: str) -> dict[str, Any]:
    try:
        info = json.loads(text) if text.strip().startswith("{") else {}
    except ValueError:
        info = {}
    return info if isinstance(info, dict) else {}


def _describe(info: dict[str, Any]) -> str:
    started = info.get("started")
    when = f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}" if isinstance(
        started, (int, float)) else ""
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}{when}"


class RunLock:
    def __init__(self, root_url: str, run_id: str):
        self.root_url, self.run_id = root_url, run_id
        key = hashlib.sha256(f"{root_url}\0{run_id}".encode()).hexdigest()[:24]
        self.path = _lock_dir() / f"{key}.lock"
        self._fd: int | None = None
        self.stale: dict[str, Any] | None = None  # the dead holder's record this acquire cleared

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _holder(self._read(fd))
            os.close(fd)
            raise RunLockedError(self._refusal(info)) from None
        try:
            previous = _holder(self._read(fd))
            if previous:  # a holder that exits empties the file: this one died holding the run
                self.stale = previous
                alive = _pid_alive(previous.get("pid")) if previous.get("host") == socket.gethostname() else None
                why = {False: "no longer running", True: "its pid now names another process",
                       None: "its process is gone"}[alive]
                log.warning("rlmill: found and cleared a stale lock on run %r under %s, left by %s (%s); "
                            "resuming the run from what it committed", self.run_id, self.root_url,
                            _describe(previous), why)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                      "started": time.time(), "run_id": self.run_id}).encode(), 0)
        except BaseException:
            os.close(fd)  # closing drops the flock too
            raise
        self._fd = fd

    def _refusal(self, info: dict[str, Any]) -> str:
        holder = _describe(info)
        if info.get("host") == socket.gethostname() and _pid_alive(info.get("pid")) is False:
            # The recorded holder is dead but the flock is still held: a process it started inherited
            # the lock's file descriptor (a fork) and outlived it.
            return (f"run {self.run_id!r} under {self.root_url} is locked by a process that {holder} started "
                    f"(that pid is dead, a child of it still holds {self.path}): stop the leftover process "
                    f"(`fuser -v {self.path}` names it), then start again")
        return (f"run {self.run_id!r} under {self.root_url} is already being trained by {holder}; "
                "wait for it to finish, stop it, or start this one with another run_id")

    @staticmethod
    def _read(fd: int) -> str:
        return os.pread(fd, 4096, 0).decode(errors="replace")

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # an empty file: released on purpose, not stale
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

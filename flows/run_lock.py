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

A process the kernel kills for memory leaves no Python error behind, so the holder's record also
carries its memory: every RLMILL_LOCK_HEARTBEAT_S seconds (5; 0 turns it off) a thread writes the
resident memory of the holder and its child processes together (rank workers, an engine's
workers), the most it has seen, and the machine's available memory. The next start's stale-lock
line reports them, and says "likely killed by the kernel for lack of memory" when the last
record had under 10% of the machine's memory available or the processes held over 80% of it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import threading
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


RECORD_BYTES = 1024  # the record is padded to this size and rewritten in place: never empty midway
OOM_AVAILABLE_SHARE, OOM_RESIDENT_SHARE = 0.10, 0.80


def _heartbeat_s() -> float:
    try:
        return max(0.0, float(os.environ.get("RLMILL_LOCK_HEARTBEAT_S", "5")))
    except ValueError:
        return 5.0


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc (Linux); [pid] where /proc has no children files."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def tree_resident_bytes(pid: int | None = None) -> int | None:
    """Resident memory of `pid` (this process by default) and all its descendants, in bytes; None
    without /proc."""
    total, page = 0, os.sysconf("SC_PAGE_SIZE")
    for p in _descendants(pid or os.getpid()):
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            if p == (pid or os.getpid()):
                return None
    return total


def machine_memory() -> tuple[int, int] | None:
    """(available, total) bytes from /proc/meminfo; None without it."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _memory_words(info: dict[str, Any]) -> str:
    """'; last seen ... with X GB resident ...' for a record that has the heartbeat's fields."""
    rss, peak, avail, total = (info.get(k) for k in ("rss", "peak_rss", "mem_available", "mem_total"))
    if not all(isinstance(v, (int, float)) for v in (rss, peak, avail, total)) or not total:
        return ""
    seen = info.get("seen")
    when = time.strftime(" %H:%M:%S", time.localtime(seen)) if isinstance(seen, (int, float)) else ""
    words = (f"; last seen{when} with {rss / 2**30:.1f} GB resident (it and its child processes; at most "
             f"{peak / 2**30:.1f} GB) and {avail / 2**30:.1f} of the machine's {total / 2**30:.1f} GB available")
    if avail < OOM_AVAILABLE_SHARE * total or peak > OOM_RESIDENT_SHARE * total:
        words += (": likely killed by the kernel for lack of memory (the kernel log says: "
                  "`dmesg | grep -i 'killed process'`)")
    return words


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
        self._record: dict[str, Any] = {}
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

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
                log.warning("rlmill: found and cleared a stale lock on run %r under %s, left by %s (%s, with no "
                            "error%s); resuming the run from what it committed", self.run_id, self.root_url,
                            _describe(previous), why, _memory_words(previous))
            os.ftruncate(fd, 0)
            self._record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                            "run_id": self.run_id}
            self._write(fd)
        except BaseException:
            os.close(fd)  # closing drops the flock too
            raise
        self._fd = fd
        if (every := _heartbeat_s()) > 0:
            self._stop.clear()
            self._beat = threading.Thread(target=self._heartbeat, args=(fd, every), name="rlmill-run-lock",
                                          daemon=True)
            self._beat.start()

    def live_holder(self) -> str | None:
        """The refusal naming the live process that holds this run now, None when none does. Takes and
        drops the lock, as a start check does (a dead holder's lock is cleared on the way)."""
        try:
            self.acquire()
        except RunLockedError as exc:
            return str(exc)
        self.release()
        return None

    def _write(self, fd: int) -> None:
        data = json.dumps(self._record).encode()[:RECORD_BYTES]
        os.pwrite(fd, data.ljust(RECORD_BYTES), 0)  # in place, one size: a reader never sees it half gone

    def _heartbeat(self, fd: int, every: float) -> None:
        """Record the process tree's memory until release()."""
        peak = 0
        while True:
            rss, mem = tree_resident_bytes(), machine_memory()
            if rss is None or mem is None:
                return  # no /proc: nothing to record
            peak = max(peak, rss)
            self._record.update(seen=time.time(), rss=rss, peak_rss=peak, mem_available=mem[0], mem_total=mem[1])
            try:
                self._write(fd)
            except OSError:
                return
            if self._stop.wait(every):
                return

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
        if self._beat is not None:
            self._stop.set()
            self._beat.join()
            self._beat = None
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

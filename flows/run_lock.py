"""One live process per run id.

Two processes training the same run would race on every stage manifest; the create-only commits
keep the data consistent, but the loser wastes a whole iteration and its warm engines diverge.
So the flow takes an exclusive OS lock keyed by (storage root, run id) before doing any work.

    with RunLock(root_url, run_id):
        ...train...

The lock is a `flock` on a file under ~/.cache/rlmill/locks: the kernel releases it when the
process dies (kill -9 included), so a crashed run never leaves a stale lock behind. It guards
processes on one machine; runs started on different machines against the same bucket must use
different run ids (the create-only manifests still refuse to overwrite each other's commits).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
from pathlib import Path


class RunLockedError(RuntimeError):
    """Another live process holds the run."""


def _lock_dir() -> Path:
    return Path(os.environ.get("RLMILL_LOCK_DIR", Path.home() / ".cache" / "rlmill" / "locks"))


class RunLock:
    def __init__(self, root_url: str, run_id: str):
        self.root_url, self.run_id = root_url, run_id
        key = hashlib.sha256(f"{root_url}\0{run_id}".encode()).hexdigest()[:24]
        self.path = _lock_dir() / f"{key}.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Path(self.path).read_text() or "{}"
            os.close(fd)
            info = json.loads(holder) if holder.startswith("{") else {}
            raise RunLockedError(
                f"run {self.run_id!r} under {self.root_url} is already being trained by pid "
                f"{info.get('pid', '?')} on {info.get('host', '?')}; wait for it to finish, stop it, "
                "or start this one with another run_id"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

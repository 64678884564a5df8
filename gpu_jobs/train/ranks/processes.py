"""Process plumbing of a rank group: dying with the parent, liveness without reaping, and the
group's local folder (RAM-backed when it can be) with the lock that marks it as in use."""

from __future__ import annotations

import glob
import os
import shutil
import signal

__all__ = ["set_pdeathsig", "workdir_root", "alive", "remove_stale_workdirs", "hold_owner_lock"]


def set_pdeathsig() -> None:  # preexec_fn: runs in the child between fork and exec
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def workdir_root(min_free: int = 1 << 30) -> str | None:
    """/dev/shm when it is writable and has room (RAM-backed: batches and buckets never touch
    a disk), else the default temp folder."""
    try:
        st = os.statvfs("/dev/shm")
        if os.access("/dev/shm", os.W_OK) and st.f_bavail * st.f_frsize >= min_free:
            return "/dev/shm"
    except OSError:
        pass
    return None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def remove_stale_workdirs(root: str) -> None:
    """Remove the folders of groups whose parent was killed (nothing else removes them, and
    /dev/shm is memory): a live group's parent holds a flock on its owner.lock."""
    import fcntl

    for lock in glob.glob(os.path.join(root, "rlmill-group-*", "owner.lock")):
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: a live group
        finally:
            os.close(fd)
        shutil.rmtree(os.path.dirname(lock), ignore_errors=True)


def hold_owner_lock(workdir: str) -> int:
    """Lock <workdir>/owner.lock for this group's life (the file appears already locked)."""
    import fcntl

    tmp = os.path.join(workdir, ".owner.lock")
    fd = os.open(tmp, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(tmp, os.path.join(workdir, "owner.lock"))
    return fd

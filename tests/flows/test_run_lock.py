"""One live process per run id: a live holder is refused, a dead one's stale lock is named and cleared."""

import os
import signal
import subprocess
import sys
import time

import pytest

from flows.run_lock import RunLock, RunLockedError


def test_second_holder_is_refused_with_the_holder_named(tmp_path, monkeypatch):
    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path))
    with RunLock("/data", "run-a"):
        with pytest.raises(RunLockedError, match=r"already being trained by pid \d+"):
            RunLock("/data", "run-a").acquire()
        RunLock("/data", "run-b").acquire()  # another run id is independent
        RunLock("/other", "run-a").acquire()  # so is the same id under another root
    with RunLock("/data", "run-a"):  # released on exit
        pass


def test_a_killed_holder_leaves_no_stale_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path))
    code = ("import os, signal; from flows.run_lock import RunLock; RunLock('/data', 'r').acquire(); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code], env={"RLMILL_LOCK_DIR": str(tmp_path), "PATH": ""})
    assert proc.returncode == -9
    with RunLock("/data", "r"):
        pass


def _dead_holder(tmp_path) -> int:
    """A process that takes the lock and is SIGKILLed holding it; returns its (now dead) pid."""
    code = ("import os, signal; from flows.run_lock import RunLock; RunLock('/data', 'r').acquire(); "
            "print(os.getpid(), flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code], env={"RLMILL_LOCK_DIR": str(tmp_path), "PATH": ""},
                          stdout=subprocess.PIPE, text=True)
    assert proc.returncode == -9
    return int(proc.stdout.split()[0])


def test_a_stale_lock_from_a_dead_process_is_named_and_cleared(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path))
    dead = _dead_holder(tmp_path)
    with caplog.at_level("WARNING", logger="rlmill"):
        with RunLock("/data", "r") as lock:
            assert lock.stale is not None and lock.stale["pid"] == dead
    (line,) = [r.getMessage() for r in caplog.records if "stale lock" in r.getMessage()]
    assert f"found and cleared a stale lock on run 'r' under /data, left by pid {dead}" in line
    assert "no longer running" in line
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlmill"):  # released normally: nothing stale next time
        with RunLock("/data", "r") as lock:
            assert lock.stale is None
    assert not [r for r in caplog.records if "stale" in r.getMessage()]


def test_a_live_holder_in_another_process_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path))
    code = ("import sys; from flows.run_lock import RunLock\n"
            "with RunLock('/data', 'r'):\n    print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code], env={"RLMILL_LOCK_DIR": str(tmp_path), "PATH": ""},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=rf"already being trained by pid {holder.pid} on "):
            RunLock("/data", "r").acquire()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    with RunLock("/data", "r") as lock:  # it released the lock: free, and not stale
        assert lock.stale is None


def test_a_child_that_inherited_the_lock_is_named_not_mistaken_for_the_dead_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path))
    code = ("import os, signal, time; from flows.run_lock import RunLock; RunLock('/data', 'r').acquire()\n"
            "child = os.fork()\n"
            "if child == 0:\n    os.dup2(os.open(os.devnull, os.O_WRONLY), 1); time.sleep(60); os._exit(0)\n"
            "print(child, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code], env={"RLMILL_LOCK_DIR": str(tmp_path), "PATH": ""},
                          stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.split()[0])
    try:
        with pytest.raises(RunLockedError, match="a child of it still holds"):
            RunLock("/data", "r").acquire()
    finally:
        os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:  # once the child is gone, so is its flock: the lock is stale, and cleared
        try:
            with RunLock("/data", "r") as lock:
                assert lock.stale is not None
            break
        except RunLockedError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_a_holder_killed_without_an_error_is_reported_with_its_memory(tmp_path, monkeypatch, caplog):
    """The kernel's OOM killer leaves no Python error: the next start says how much memory the dead
    holder (and its child processes) had, from the record its heartbeat kept."""
    monkeypatch.setenv("RLMILL_LOCK_DIR", str(tmp_path))
    code = ("import json, os, signal, time; from flows.run_lock import RunLock\n"
            "lock = RunLock('/data', 'r'); lock.acquire(); ballast = b'x' * (300 << 20)\n"
            "deadline = time.monotonic() + 60\n"
            "while json.loads(open(lock.path).read() or '{}').get('peak_rss', 0) < (300 << 20):\n"
            "    assert time.monotonic() < deadline, 'no heartbeat recorded the ballast in 60 s'\n"
            "    time.sleep(0.02)\n"
            "os.kill(os.getpid(), signal.SIGKILL)")
    env = {"RLMILL_LOCK_DIR": str(tmp_path), "RLMILL_LOCK_HEARTBEAT_S": "0.05", "PATH": ""}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == -9
    with caplog.at_level("WARNING", logger="rlmill"):
        with RunLock("/data", "r") as lock:
            assert lock.stale["peak_rss"] >= 300 << 20 and lock.stale["mem_total"] > 0
    (line,) = [r.getMessage() for r in caplog.records if "stale lock" in r.getMessage()]
    assert "with no error; last seen " in line and " GB resident (it and its child processes" in line, line


def test_the_memory_words_name_a_likely_oom_kill():
    from flows.run_lock import _memory_words

    gb = 2**30
    tight = {"seen": 0, "rss": 22 * gb, "peak_rss": 23 * gb, "mem_available": gb // 2, "mem_total": 24 * gb}
    assert "likely killed by the kernel for lack of memory" in _memory_words(tight)
    roomy = {**tight, "rss": 2 * gb, "peak_rss": 3 * gb, "mem_available": 20 * gb}
    assert "2.0 GB resident" in _memory_words(roomy) and "likely killed" not in _memory_words(roomy)
    assert _memory_words({"pid": 1}) == ""  # a record from before the heartbeat existed


def test_resident_memory_counts_the_child_processes():
    from flows.run_lock import tree_resident_bytes

    before = tree_resident_bytes()
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = b'x' * (200 << 20); print('ready', flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert tree_resident_bytes() - before >= 200 << 20
    finally:
        child.stdin.close()
        child.wait(timeout=30)

"""One live process per run id."""

import subprocess
import sys

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

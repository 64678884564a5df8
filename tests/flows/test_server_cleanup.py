"""A killed `rlmill train` takes its ephemeral Prefect API server with it (Linux).

Without PREFECT_API_URL, Prefect serves flows from an ephemeral `uvicorn prefect.server.api...`
child that it stops in an atexit hook; a SIGKILL skips that hook, so every crash used to leave a
server running. The CLI starts that child with PR_SET_PDEATHSIG (flows/cli_prefect.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process from /proc, or None once it no longer exists."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def _gone(pid: int) -> bool:
    # Z: dead, waiting for a reaper; in a container whose init never reaps, it stays a zombie.
    st = _stat(pid)
    return st is None or st[0] in ("Z", "X")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None and st[1] == pid:
            out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _poll(predicate, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    return predicate()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: whatever it left behind
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def test_a_child_started_through_the_wrapper_dies_with_its_parent():
    """The mechanism alone, in a second: a parent starts `sleep` the way the CLI starts the server."""
    script = textwrap.dedent(
        """
        import subprocess, sys, time
        from flows.cli_prefect import _SubprocessDyingWithParent, _die_with_parent_preexec
        proxy = _SubprocessDyingWithParent(subprocess, _die_with_parent_preexec())
        child = proxy.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        print(child.pid, flush=True)
        time.sleep(300)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        assert not _gone(child)
        os.kill(proc.pid, signal.SIGKILL)
        assert _poll(lambda: _gone(child), timeout=30), f"child {child} outlived its parent"
    finally:
        _kill_group(proc)


def test_only_the_main_thread_asks_for_the_death_signal():
    """PR_SET_PDEATHSIG fires when the forking *thread* ends: a server started from a worker
    thread must not get it, or it would stop when that thread does."""
    from flows.cli_prefect import _SubprocessDyingWithParent

    calls = []
    fake = type("FakeSubprocess", (), {"Popen": staticmethod(lambda *a, **kw: calls.append(kw))})
    proxy = _SubprocessDyingWithParent(fake, preexec_fn="marker")
    proxy.Popen(["x"])
    worker = threading.Thread(target=proxy.Popen, args=(["x"],))
    worker.start()
    worker.join()
    assert calls == [{"preexec_fn": "marker"}, {}]


@pytest.mark.slow
@pytest.mark.prefect
def test_sigkilled_rlmill_train_leaves_no_prefect_server(example_path, tiny, tmp_path):
    from gpu_jobs.train.ranks.dist import child_env

    env = {k: v for k, v in child_env().items() if k != "PREFECT_API_URL"}  # the ephemeral API
    env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(tmp_path / "prefect"), OMP_NUM_THREADS="1",
               RLMILL_LOCK_DIR=str(tmp_path / "locks"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    argv = [sys.executable, "-m", "flows.cli", "train", "--config", str(example_path),
            *tiny(str(tmp_path / "root"), "trainer.total_iterations=100")]
    log = open(tmp_path / "train.log", "w")
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def server() -> int | None:
            found = [c for c in _children(proc.pid) if "uvicorn" in _cmdline(c) and "prefect.server.api" in _cmdline(c)]
            return found[0] if found else None

        pid = _poll(lambda: server() or proc.poll() is not None, timeout=300)
        assert isinstance(pid, int) and not isinstance(pid, bool), (
            f"no Prefect server child appeared:\n{(tmp_path / 'train.log').read_text()[-3000:]}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert _poll(lambda: _gone(pid), timeout=60), f"Prefect server {pid} outlived the killed rlmill train"
    finally:
        _kill_group(proc)
        log.close()

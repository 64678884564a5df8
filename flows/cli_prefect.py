"""The ephemeral Prefect API server `rlmill train` and `rlmill run` start, as a child the kernel
stops when the CLI's process dies (Linux: PR_SET_PDEATHSIG), so a killed run leaves no server.

    _start_ephemeral_api()   # before the flow: Prefect's client then finds the server running
"""

from __future__ import annotations

import os
import signal
import sys
import threading

class _SubprocessDyingWithParent:
    """Stands in for the `subprocess` module inside `prefect.server.api.server` only (the module
    whose `SubprocessASGIServer._run_uvicorn_command` starts the ephemeral API server with
    `subprocess.Popen`): Popen calls made from the main thread get a preexec_fn that asks the
    kernel to SIGTERM the child when this process dies. Everything else is the real module."""

    def __init__(self, real, preexec_fn):
        self._real, self._preexec_fn = real, preexec_fn

    def __getattr__(self, name):
        return getattr(self._real, name)

    def Popen(self, *args, **kwargs):  # noqa: N802 (the module's name)
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child ends: only the main
        # thread lives as long as the process, so a server started elsewhere is left as it was.
        if threading.current_thread() is threading.main_thread() and kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = self._preexec_fn
        return self._real.Popen(*args, **kwargs)


def _die_with_parent_preexec():
    """A preexec_fn (Linux) putting the child in a session of its own with PR_SET_PDEATHSIG=SIGTERM,
    or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, parent = 1, os.getpid()

    def preexec() -> None:
        # Its own session: Ctrl-C in a terminal and a SIGTERM to the run's process group (what
        # `timeout` and a closing terminal send) reach the CLI only, which stops its run through
        # this server (flows/stopping.py) and stops it at exit; it must not go first.
        os.setsid()
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _start_ephemeral_api() -> None:
    """Without PREFECT_API_URL, Prefect runs flows against an ephemeral API server: a `uvicorn
    prefect.server.api...` child started on first use and stopped at exit by an atexit hook,
    which a SIGKILL never runs, so every killed `rlmill train` used to leave that server behind.
    Start it here, from the main thread, as a child the kernel stops when this process dies
    (Linux: PR_SET_PDEATHSIG); Prefect's own client then finds it running and uses it.

    This reaches into Prefect 3.7's `SubprocessASGIServer` (the `subprocess` name of its module
    is replaced by `_SubprocessDyingWithParent`; nothing else there changes). Any Prefect that
    lacks it, or a configured API URL, leaves Prefect's behaviour untouched."""
    preexec = _die_with_parent_preexec()
    if preexec is None:
        return
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return
    try:
        from prefect.server.api import server as prefect_server
    except ImportError:
        return
    ephemeral = getattr(prefect_server, "SubprocessASGIServer", None)
    real = getattr(prefect_server, "subprocess", None)
    if ephemeral is None or not hasattr(ephemeral, "_run_uvicorn_command") or real is None:
        return
    if not isinstance(real, _SubprocessDyingWithParent):
        prefect_server.subprocess = _SubprocessDyingWithParent(real, preexec)
    ephemeral().start()  # the instance get_client() uses (port None); stopped at exit by Prefect


def _stop_ephemeral_api(drain_s: float = 3.0, grace_s: float = 1.0) -> None:
    """For a run stopped by a signal (flows/stopping.py), which cannot spend Prefect's own exit:
    send the logs and events Prefect still holds (at most `drain_s`), then stop the ephemeral API
    server: SIGTERM, SIGKILL after `grace_s` (Prefect's stop at exit waits 5 s for it, which it
    nearly always takes). A no-op for the server when there is none."""
    import subprocess

    try:  # Prefect's log and event workers (what its own exit drains, without a bound)
        from prefect._internal.concurrency.services import _QueueServiceBase

        _QueueServiceBase.drain_all(timeout=drain_s)
    except Exception:  # noqa: BLE001 -- a Prefect without them: nothing to send
        pass
    try:
        from prefect.server.api.server import SubprocessASGIServer
    except ImportError:
        return
    for server in list(getattr(SubprocessASGIServer, "_instances", {}).values()):
        proc = getattr(server, "server_process", None)
        if proc is None or proc.poll() is not None:
            continue
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

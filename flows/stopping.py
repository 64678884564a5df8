"""What SIGINT (Ctrl-C) and SIGTERM do to a run: it stops within seconds, says how to resume, and
leaves nothing running.

    with stop_signals(grace_s=8.0):   # main thread: the CLI around the whole run, the rl-training flow
        ...                            # around its loop; the first signal raises RunStopped here

The first SIGINT or SIGTERM raises `RunStopped` (a KeyboardInterrupt: no `except Exception`
catches it, so no task retry and no wait for the Prefect API) in the main thread, wherever it is.
The stage under way ends there: a stage publishes by writing its manifest last, so an interrupted
one left nothing a reader sees and the resumed run computes it again, exactly as after a kill.
Prefect records the task and flow runs Crashed, the flow closes its engines and rank group, and
`rlmill train` / `rlmill run` print one line (`stop_line`) and exit 128 + the signal (130, 143).

A second signal, or a stop that takes longer than the grace (tasks.stop_grace_seconds), ends the
process at once (os._exit), after the same line: its rank group, reward workers and ephemeral
Prefect server die with it (PR_SET_PDEATHSIG, a parent watch).

Prefect's Cancel: a worker cancelling a deployment run first tells the run's process so over
Prefect's control channel, then sends SIGTERM. Then Prefect's own TerminationSignal is raised
instead of RunStopped, and Prefect ends the run Cancelled, which the automatic resume
(deployments/resume.py) leaves alone. A plain SIGTERM (a worker or a pod shutting down) ends it
Crashed, which the automatic resume resumes.

Signal handlers are per process, so the stop request is too: one module-level `_Stop`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["RunStopped", "hard_exit", "requested", "say_once", "set_default_line", "set_line", "stop_line",
           "stop_signals"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
DEFAULT_GRACE_S = 8.0


class RunStopped(KeyboardInterrupt):
    """Raised in the main thread by the first SIGINT or SIGTERM; `exit_code` is 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Stop:
    """This process's stop request: the first signal, when it came, the grace, and the line to
    print on the way out (set by whoever knows the run and how to resume it)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.t0 = 0.0
        self.grace_s = DEFAULT_GRACE_S
        self.line: Callable[[int], str | None] | None = None
        self.said = False
        self.lock = threading.Lock()


_STOP = _Stop()


def requested() -> int | None:
    """The signal that asked this process to stop, or None."""
    return _STOP.signum


def seconds_since() -> float | None:
    return None if _STOP.signum is None else time.monotonic() - _STOP.t0


def stop_line(run_id: str, signum: int, committed: int, resume: str) -> str:
    """The one line a stopped run prints."""
    return (f"rlmill: run {run_id} stopped by {signal.Signals(signum).name} after {committed} committed "
            f"iteration{'' if committed == 1 else 's'}; resume it: {resume}")


def set_line(line: Callable[[int], str | None] | None, grace_s: float | None = None) -> None:
    """What to print when this process stops (`line(signum)`; None: nothing), and the grace of a stop."""
    _STOP.line = line
    if grace_s is not None:
        _STOP.grace_s = grace_s


def set_default_line(line: Callable[[int], str | None]) -> bool:
    """`set_line(line)` unless a line is set already (the CLI's); True when this one was set."""
    if _STOP.line is not None:
        return False
    _STOP.line = line
    return True


def say_once(signum: int | None = None, emit: Callable[[str], None] | None = None) -> None:
    """Print the stop line on stderr (or hand it to `emit`, a logger's method), once per process:
    the graceful path and the watchdog may race."""
    with _STOP.lock:
        if _STOP.said or _STOP.line is None:
            return
        _STOP.said = True
    signum = signum or _STOP.signum or signal.SIGTERM
    try:
        text = _STOP.line(signum)
    except Exception as exc:  # noqa: BLE001 -- the line must not stop the exit
        text = f"rlmill: stopped by {signal.Signals(signum).name} ({exc})"
    if text and emit is not None:
        emit(text)
    elif text:
        # After the terminal's echoed ^C, on a line of its own.
        lead = "\n" if signum == signal.SIGINT and sys.stderr.isatty() else ""
        print(lead + text, file=sys.stderr, flush=True)


def hard_exit(signum: int | None = None) -> None:
    """End the process now, exit status 128 + the first signal, after the stop line. Children die
    with it: the rank group (PR_SET_PDEATHSIG=SIGKILL), the ephemeral Prefect server
    (PR_SET_PDEATHSIG=SIGTERM), reward workers (they watch their parent)."""
    signum = _STOP.signum or signum or signal.SIGTERM
    say_once(signum)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(128 + signum)


def _watchdog(signum: int) -> None:
    deadline = _STOP.t0 + _STOP.grace_s
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.25))
    print(f"rlmill: the stop took longer than {_STOP.grace_s:.0f} s (tasks.stop_grace_seconds): ending now",
          file=sys.stderr, flush=True)
    if os.environ.get("RLMILL_STOP_DEBUG"):  # what the stop was waiting on: every thread's stack
        import faulthandler

        faulthandler.dump_traceback(all_threads=True)
    hard_exit(signum)


def _cancel_intent() -> bool:
    """Whether Prefect's worker said, over its control channel, that the SIGTERM coming is a Cancel."""
    try:
        from prefect._internal.control_listener import get_intent
    except ImportError:  # a Prefect without it: a Cancel is a plain SIGTERM (the run ends Crashed)
        return False
    return get_intent() is not None


def _handler(signum: int, frame) -> None:
    if _STOP.signum is not None:  # the second signal: no more waiting
        hard_exit(_STOP.signum)
    _STOP.signum, _STOP.t0 = signum, time.monotonic()
    threading.Thread(target=_watchdog, args=(signum,), name="rlmill-stop-watchdog", daemon=True).start()
    if signum == signal.SIGTERM and _cancel_intent():
        from prefect.exceptions import TerminationSignal

        raise TerminationSignal(signal=signum)  # Prefect ends the run Cancelled
    raise RunStopped(signum)


class _QuietCrashes:
    """A logging filter for Prefect's console handlers: the "Crash detected! Execution was aborted
    by an interrupt signal" (or "a termination signal") and "Finished in state Crashed(...)"
    records Prefect writes for each task and flow run a signal ends stay off the console (the API
    and the UI keep them): the stop line says it once. Inside a subflow Prefect's own SIGTERM
    handler is the one that raises, before ours is asked, so the filter goes by the message."""

    ABORTED = "Execution was aborted by a"

    @classmethod
    def filter(cls, record) -> bool:
        message = record.getMessage()
        return not ((message.startswith("Crash detected!") or message.startswith("Finished in state Crashed"))
                    and cls.ABORTED in message)


def _quiet_prefect_console() -> None:
    import logging

    loggers = [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger) and lg.name.startswith("prefect"))]
    for lg in loggers:
        for h in lg.handlers:
            if type(h).__name__ == "PrefectConsoleHandler" and _QuietCrashes not in h.filters:
                h.addFilter(_QuietCrashes)


@contextmanager
def stop_signals(grace_s: float | None = None) -> Iterator[None]:
    """SIGINT and SIGTERM raise RunStopped inside (see the module docstring); the handlers that
    were there before (Prefect's SIGTERM bridge inside a flow run) are put back after. Outside
    the main thread, where Python runs no signal handler, nothing changes."""
    if grace_s is not None:
        _STOP.grace_s = grace_s
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _quiet_prefect_console()
    engine = _prefect_engine()
    bridge = getattr(engine, "_prefect_sigterm_handler", None)
    if bridge is not None:
        engine._prefect_sigterm_handler = _handler
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:
        signal.signal(sig, _handler)
    try:
        yield
    finally:
        if _STOP.signum is None:  # once stopping, keep ours: a second signal ends it
            for sig, old in before.items():
                if old is not None:
                    signal.signal(sig, old)
            if bridge is not None:
                engine._prefect_sigterm_handler = bridge


def _prefect_engine():
    """Prefect's `prefect.utilities.engine`, whose `_prefect_sigterm_handler` ours stands in for
    inside stop_signals, or None. Prefect checks that its own handler is the one installed: a
    subflow keeps it (else it puts its own back, which would raise before ours), and the worker's
    cancel intent is acknowledged only then (else a Cancel ends Crashed). Ours raises Prefect's
    TerminationSignal for a Cancel, so Prefect's handling of one is unchanged."""
    try:
        import importlib

        return importlib.import_module("prefect.utilities.engine")
    except ImportError:
        return None

"""The guarded worker pool that runs users' code: reward functions and tools.

    >>> from gpu_jobs.reward.sandbox import Failed, SandboxSpec, run_guarded
    >>> spec = SandboxSpec(work=len, timeout_s=5, num_workers=1, what="demo")
    >>> run_guarded(["ab", "c"], spec)            # (results, pool restarts)
    ([2, 1], 0)

Every task runs `spec.work(task)` in a worker process (`spec.init(*spec.init_args)` runs once
per worker first, e.g. to load the user's file). One bad task never fails the batch: a task
past `timeout_s` is abandoned by killing the pool's processes and starting a new pool (the
other tasks in flight are re-run), a task that kills its worker twice is given up, and either
comes back as `Failed(kind, message)` in its result slot instead of the work's return value.
`work` and `init` are module-level functions (pickled by reference).

The workers are fenced off (gpu_jobs.reward.isolation, `spec.limits`): a fresh interpreter
with an allow-listed environment (no credentials) and a private HOME, its own process group
(killing a pool kills what its tasks started too), rlimits on memory, files and CPU per task,
and no network where the OS allows a namespace. They stay a pool: one start per batch, not
per task.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

from .custom import SHARED_ENV, fetched_copies
from .isolation import SandboxContext, SandboxLimits, confine, kill_group, limit_cpu_for_task, scrubbed_env

__all__ = ["Failed", "SandboxLimits", "SandboxSpec", "network_unavailable", "run_guarded"]

log = logging.getLogger(__name__)
_REPORTED: set[str] = set()  # why the network stayed on, logged once per process


class Failed(NamedTuple):
    """A task the pool gave up on: kind is "timeout", "crash" or "exception" (its result could
    not travel back)."""

    kind: str
    message: str


@dataclass(frozen=True)
class SandboxSpec:
    """What runs in the workers and under which limits; `what` names it in error messages."""

    work: Callable[[Any], Any]
    timeout_s: float
    num_workers: int
    what: str
    init: Callable[..., None] | None = None
    init_args: tuple = ()
    startup_timeout_s: float = 120.0
    limits: SandboxLimits = field(default_factory=SandboxLimits)

    @property
    def cpu_s(self) -> float:
        return self.limits.cpu_s if self.limits.cpu_s is not None else 2 * self.timeout_s + 1


_WORKER_STATE: dict[str, Any] = {"network": None}


def _exit_with_parent() -> None:
    """End this worker, and what its tasks started, when the process that started it dies: a
    SIGKILLed `rlmill train` otherwise leaves its workers running (an idle one waits on its
    queue forever)."""
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os.killpg(0, signal.SIGKILL)), daemon=True).start()


def _worker_init(init: Callable[..., None] | None, args: tuple, limits: SandboxLimits) -> None:
    # confine first: leaving the network needs a single-threaded process, and the user's file
    # (loaded by init) already runs under the limits.
    _WORKER_STATE["network"] = confine(limits)
    _exit_with_parent()
    if init is not None:
        init(*args)


def _worker_pid(_: int) -> tuple[int, str | None]:
    time.sleep(0.02)  # long enough that each ping lands on a different idle worker
    return os.getpid(), _WORKER_STATE["network"]


def _run_task(work: Callable[[Any], Any], cpu_s: float, task: Any) -> Any:
    limit_cpu_for_task(cpu_s)
    return work(task)


class _Pool:
    """A ProcessPoolExecutor that can be killed: a hung user function never returns, and
    ProcessPoolExecutor cannot cancel a running call, so we terminate its processes."""

    def __init__(self, spec: SandboxSpec, n_workers: int):
        self.spec, self.killed = spec, False
        self.home = tempfile.mkdtemp(prefix="rlmill-sandbox-")  # the workers' HOME and TMPDIR
        env = scrubbed_env(self.home, spec.limits.env)
        copies = fetched_copies()
        if copies:  # the user's files this process fetched from storage: workers need no credentials
            env[SHARED_ENV] = json.dumps(copies)
        context = SandboxContext(env)
        self.executor = ProcessPoolExecutor(max_workers=n_workers, mp_context=context, initializer=_worker_init,
                                            initargs=(spec.init, spec.init_args, spec.limits))
        # Start every worker (and load the user's file) before any task's clock runs, so a
        # slow start is not mistaken for a hung task.
        deadline = time.monotonic() + spec.startup_timeout_s
        pids: set[int] = set()
        while len(pids) < n_workers and time.monotonic() < deadline:
            futures = [self.executor.submit(_worker_pid, i) for i in range(n_workers)]
            done, _ = wait(futures, timeout=max(0.0, deadline - time.monotonic()))
            if len(done) < len(futures):
                self.kill()
                raise TimeoutError(f"{spec.what} worker pool did not start within {spec.startup_timeout_s} s")
            try:
                pings = [f.result() for f in futures]
            except BrokenProcessPool as e:
                self.kill()
                raise RuntimeError(f"{spec.what} workers failed to start; loading the user's code in a fresh "
                                   "process failed") from e
            pids.update(pid for pid, _ in pings)
            _report_network({why for _, why in pings if why})

    def submit(self, task: Any):
        return self.executor.submit(_run_task, self.spec.work, self.spec.cpu_s, task)

    def kill(self) -> None:
        # _processes is private but the only handle on the workers; shutdown() alone would
        # wait for the hung call forever. Each worker leads its own process group: killing the
        # group ends the grandchildren its tasks started as well.
        if self.killed:  # once: a second killpg could reach a reused pid's group
            return
        self.killed = True
        procs = list((getattr(self.executor, "_processes", None) or {}).values())
        for p in procs:
            if p.pid:
                kill_group(p.pid)
        self.executor.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.join(timeout=5)
        shutil.rmtree(self.home, ignore_errors=True)


def network_unavailable() -> str | None:
    """Why this process's sandbox workers kept the network (None: they got a namespace, or
    none has started yet)."""
    return next(iter(sorted(_REPORTED)), None)


def _report_network(reasons: set[str]) -> None:
    for why in reasons - _REPORTED:
        _REPORTED.add(why)
        log.warning("sandbox: %s (docs/guide/reward.md, the sandbox)", why)


class _Flight:
    """The bookkeeping of one run_guarded call: results, the queue, what is in flight."""

    def __init__(self, n_tasks: int):
        self.results: list[Any] = [None] * n_tasks
        self.pending = deque(range(n_tasks))
        self.crashes: Counter[int] = Counter()  # times a task was in flight when a worker died
        self.inflight: dict[Any, tuple[int, float]] = {}

    def fill(self, pool: _Pool, tasks: Sequence[Any], n_workers: int) -> None:
        # Keep at most n_workers in flight so a submitted task starts at once and its clock is
        # honest; a crash suspect runs alone so it cannot take others down.
        while self.pending and len(self.inflight) < n_workers:
            i = self.pending[0]
            if self.crashes[i] and self.inflight:
                break
            self.pending.popleft()
            self.inflight[pool.submit(tasks[i])] = (i, time.monotonic())
            if self.crashes[i]:
                break

    def collect(self, done) -> bool:
        """Store finished results; True when a worker died."""
        broken = False
        for fut in done:
            try:
                self.results[self.inflight[fut][0]] = fut.result()
                del self.inflight[fut]
            except BrokenProcessPool:
                broken = True  # stays in flight: handled by suspect_all
            except Exception as e:  # e.g. the task or result could not be pickled
                self.results[self.inflight.pop(fut)[0]] = Failed("exception", f"{type(e).__name__}: {e}")
        return broken

    def suspect_all(self, what: str) -> None:
        # Which in-flight task killed the worker is unknown, so each becomes a suspect and is
        # retried alone; one that kills a worker twice is given up. An innocent one never
        # crashes alone.
        for i, _ in self.inflight.values():
            self.crashes[i] += 1
            if self.crashes[i] >= 2:
                self.results[i] = Failed("crash", f"{what} worker process died while running this task")
            else:
                self.pending.appendleft(i)
        self.inflight.clear()

    def expire(self, timeout_s: float, what: str) -> bool:
        now = time.monotonic()
        expired = [f for f, (_, t) in self.inflight.items() if now - t >= timeout_s]
        for fut in expired:
            self.results[self.inflight.pop(fut)[0]] = Failed("timeout", f"{what} took longer than {timeout_s:g} s")
        return bool(expired)

    def requeue_bystanders(self) -> None:
        for i, _ in self.inflight.values():  # bystanders of a hang: re-run on the new pool
            self.pending.appendleft(i)
        self.inflight.clear()


def run_guarded(tasks: Sequence[Any], spec: SandboxSpec) -> tuple[list[Any], int]:
    """Run `spec.work` on every task in worker processes; returns (results, pool restarts), a
    result being the work's return value or a `Failed`."""
    if not tasks:
        return [], 0
    flight, restarts = _Flight(len(tasks)), 0
    n_workers = min(spec.num_workers, len(tasks))
    pool = _Pool(spec, n_workers)
    try:
        while flight.pending or flight.inflight:
            flight.fill(pool, tasks, n_workers)
            oldest = min(t for _, t in flight.inflight.values())
            done, _ = wait(list(flight.inflight), timeout=max(0.0, oldest + spec.timeout_s - time.monotonic()),
                           return_when=FIRST_COMPLETED)
            broken = flight.collect(done)
            if broken:
                flight.suspect_all(spec.what)
            if flight.expire(spec.timeout_s, spec.what) or broken:
                flight.requeue_bystanders()
                pool.kill()
                if flight.pending:
                    pool = _Pool(spec, n_workers)
                    restarts += 1
    finally:
        pool.kill()
    return flight.results, restarts

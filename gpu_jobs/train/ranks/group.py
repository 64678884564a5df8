"""A warm rank group: N ranks of ``gpu_jobs.train.ranks.worker`` started once by a launcher, serving
every later command of the run over a control channel (the trainer on top: ranks/trainer.py).

    group = RankGroup(2).start()                 # the launcher, then rank 0's hello
    info = group.call("init", model_path=..., config=...)   # every rank runs it; rank 0's result
    for kind, payload in group.stream("weights", ...): ...  # messages before the result
    group.close()                                # shutdown; SIGTERM, then SIGKILL what is left

How it runs: the parent listens on a loopback ``multiprocessing.connection.Listener`` (random
authkey); a launcher starts the ranks (launch.launcher_for): on one node without CUDA,
``python -m gpu_jobs.train.ranks.forked``, which imports torch and DeepSpeed once and forks the
ranks from itself; otherwise ``python -m torch.distributed.run --standalone --nproc_per_node N -m
gpu_jobs.train.ranks.worker``. Rank 0 connects, receives each command and
broadcasts it to the others (``broadcast_object_list``).

Failures: a rank that raises or dies fails the call with a ``RankGroupError`` carrying that
rank's traceback (or how it died), found from the ranks' error files and the times the parent saw
each process exit (ranks/failure.py); the group is torn down and cannot be used again.

Several nodes (``nnodes`` > 1, ranks/launch.py): this machine is node 0 and runs ranks 0..n-1,
rank 0 among them; every other node joins with ``python -m gpu_jobs.train.ranks.launch``. This
process watches and kills only node 0's processes; another node's launcher ends its ranks when the
collectives fail. The launcher and the ranks die with this process (PR_SET_PDEATHSIG): the
launcher is started from a thread that lives as long as the group, because the kernel ties that
signal to the thread that forked.
"""

from __future__ import annotations

import atexit
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from .errors import RankGroupError
from .failure import (Culprit, failure_error, first_causes, rank_failure, read_error_files, read_log_tail,
                      where_failed)
from .processes import alive, hold_owner_lock, remove_stale_workdirs, set_pdeathsig, workdir_root

__all__ = ["RankGroup"]

_LIVE: set["RankGroup"] = set()


@atexit.register
def _close_live_groups() -> None:
    for g in list(_LIVE):
        g.close(timeout=5.0)


class RankGroup:
    """N ranks of ``gpu_jobs.train.ranks.worker`` under torchrun, and the control channel.

    ``start()`` launches them and waits for rank 0's hello; ``call(command, **kwargs)`` runs one
    command on every rank and returns rank 0's result; ``stream(...)`` the same for commands that
    send messages before their result. Calls are serialized. After a failure the group is closed
    (``usable`` is False) and a RankGroupError is raised."""

    def __init__(self, n_ranks: int, *, env: dict[str, str] | None = None, start_timeout: float = 600.0,
                 workdir_root: str | None = None, python: str = sys.executable, nnodes: int = 1,
                 master_addr: str = "", master_port: int = 0):
        from .launch import NodeLayout

        if n_ranks < 1:
            raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
        self.n_ranks, self.start_timeout, self.python = n_ranks, start_timeout, python
        self.layout = NodeLayout(n_ranks, nnodes, master_addr, master_port)
        self.local_ranks = list(range(self.layout.nproc_per_node))  # node 0's: the ones this machine runs
        self._extra_env = dict(env or {})
        self._workdir_root = workdir_root
        self.workdir = ""
        self.pids: list[int] = []  # by rank
        self.proc: subprocess.Popen | None = None
        self.usable = False
        self.closed = False
        self._conn: Any = None
        self._listener: Any = None
        self._lock = threading.RLock()
        self._deaths: dict[Any, float] = {}  # rank (int) or "launcher" -> time.time() seen dead
        self._stop = threading.Event()
        self._spawned = threading.Event()
        self._spawn_error: BaseException | None = None
        self._keeper: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self._owner_fd = -1
        self._teardown_at: float | None = None
        self._sent_at = 0.0
        self.log_path = ""
        self.launcher = ""  # "fork" or "torchrun" (launch.launcher_for), once started
        self.start_seconds: float | None = None

    def __repr__(self) -> str:
        state = "usable" if self.usable else "closed" if self.closed else "not started"
        return f"RankGroup({self.n_ranks} ranks, {state}, pids={self.pids})"

    # ---- start ----------------------------------------------------------------------------
    def start(self) -> "RankGroup":
        from multiprocessing.connection import Listener

        from .launch import launcher_for

        root = self._workdir_root if self._workdir_root is not None else workdir_root()
        remove_stale_workdirs(root or tempfile.gettempdir())
        self.workdir = tempfile.mkdtemp(prefix="rlmill-group-", dir=root)
        self._owner_fd = hold_owner_lock(self.workdir)
        self.log_path = os.path.join(self.workdir, "launcher.log")
        authkey = os.urandom(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self._listener.address
        env = self._child_env(authkey)
        self.launcher = launcher_for(self.layout, env)
        cmd = self.layout.command(self.python, 0, f"{host}:{port}", self.workdir, self.launcher)
        self._wake_r, self._wake_w = os.pipe()
        _LIVE.add(self)
        t0 = time.monotonic()
        self._keeper = threading.Thread(target=self._keep, args=(cmd, env), name="rank-group-keeper", daemon=True)
        self._keeper.start()
        self._spawned.wait()
        if self._spawn_error is not None:
            self._cleanup()
            raise RankGroupError(f"could not start the rank group: {self._spawn_error}") from self._spawn_error
        self._conn = self._accept(t0 + self.start_timeout)
        kind, hello = self._recv("start", t0 + self.start_timeout)
        if kind != "hello":
            raise self._failure("start", reported=hello if kind == "error" else None)
        self.pids = [pid for _, pid in hello["pids"]]  # (node, pid) by rank; another node's pid means nothing here
        self.local_ranks = [r for r, (node, _) in enumerate(hello["pids"]) if node == 0]
        os.write(self._wake_w, b"p")  # the keeper watches the ranks from now on
        self.usable = True
        self.start_seconds = time.monotonic() - t0
        return self

    def _child_env(self, authkey: bytes) -> dict[str, str]:
        from .launch import rank_env

        env = rank_env(self.layout.nproc_per_node, self.layout.nnodes, self._extra_env)
        env["RLMILL_GROUP_AUTHKEY"] = authkey.hex()
        return env

    def _keep(self, cmd: list[str], env: dict[str, str]) -> None:
        """Start the launcher, then record when it and each rank exit (pidfds), until closed.
        The launcher's PR_SET_PDEATHSIG is tied to THIS thread: it must outlive the group."""
        try:
            log = open(self.log_path, "ab")
            try:
                # The caller's folder: a relative storage root (.rlmill) means the same place to
                # the ranks as to the flow; the code is found through PYTHONPATH.
                self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             preexec_fn=set_pdeathsig, cwd=os.getcwd())
            finally:
                log.close()
        except BaseException as e:  # noqa: BLE001
            self._spawn_error = e
            return
        finally:
            self._spawned.set()
        watched: dict[int, Any] = {}
        try:
            watched[os.pidfd_open(self.proc.pid)] = "launcher"
        except ProcessLookupError:
            self._deaths["launcher"] = time.time()
        ranks_added = False
        while not self._stop.is_set():
            if not ranks_added and self.pids:
                ranks_added = True
                for r, pid in enumerate(self.pids):
                    if r not in self.local_ranks:  # another node's process: its launcher watches it
                        continue
                    try:
                        watched[os.pidfd_open(pid)] = r
                    except ProcessLookupError:
                        self._deaths.setdefault(r, time.time())
            ready, _, _ = select.select([*watched, self._wake_r], [], [], 1.0)
            now = time.time()
            for fd in ready:
                if fd == self._wake_r:
                    os.read(fd, 64)
                    continue
                self._deaths.setdefault(watched.pop(fd), now)
                os.close(fd)
        for fd in watched:
            os.close(fd)

    def _accept(self, deadline: float) -> Any:
        """Rank 0's connection, checking the launcher's liveness while waiting."""
        box: dict[str, Any] = {}

        def accept() -> None:
            try:
                box["conn"] = self._listener.accept()
            except BaseException as e:  # noqa: BLE001
                box["error"] = e

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            if t.is_alive() and (self._deaths or time.monotonic() > deadline):
                # A blocked accept() is not woken by close(): connect once to release it.
                try:
                    socket.create_connection(self._listener.address, timeout=1).close()
                except OSError:
                    pass
                t.join(5)
                raise self._failure("start", timed_out=not self._deaths)
        if "conn" not in box:
            raise self._failure("start", note=f"control channel: {box.get('error')!r}")
        return box["conn"]

    # ---- calls ----------------------------------------------------------------------------
    def call(self, command: str, *, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``command`` on every rank; rank 0's result. RankGroupError (group torn down) if a
        rank raises or dies, or no reply comes within ``timeout`` seconds (None: no limit)."""
        messages = self.stream(command, timeout=timeout, **kwargs)
        try:
            for kind, payload in messages:
                if kind == "ok":
                    return payload
                raise self._failure(command, note=f"unexpected message {kind!r} from rank 0")
        finally:
            messages.close()

    def stream(self, command: str, *, timeout: float | None = None, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """Like call() for a command whose rank 0 sends messages before its result: yields
        ``(kind, payload)`` for each, then ``("ok", result)``. The caller answers with
        ``reply()``. Holds the group until exhausted or closed."""
        with self._lock:
            self._send(command, kwargs)
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                kind, payload = self._recv(command, deadline)
                if kind == "error":
                    raise self._failure(command, reported=payload)
                yield kind, payload
                if kind == "ok":
                    return

    def reply(self, message: Any) -> None:
        """Answer rank 0 inside a stream()."""
        self._send_raw(message, "stream")

    def _send(self, command: str, kwargs: dict[str, Any]) -> None:
        if not self.usable:
            raise RankGroupError(f"the rank group is closed; cannot run {command!r}", command=command)
        self._sent_at = time.time()
        if self._deaths:
            raise self._failure(command)
        self._send_raw((command, kwargs), command)

    def _send_raw(self, message: Any, command: str) -> None:
        if self._conn is None:
            raise RankGroupError(f"the rank group is closed; cannot run {command!r}", command=command)
        try:
            self._conn.send(message)
        except (OSError, EOFError) as e:
            raise self._failure(command, note=f"control channel: {e!r}") from None

    def _recv(self, command: str, deadline: float | None) -> tuple[str, Any]:
        """The next message from rank 0, watching the processes meanwhile: a dead rank or
        launcher, a closed channel or the deadline fails the call."""
        while True:
            if self._conn is None:
                raise RankGroupError(f"the rank group was closed during {command!r}", command=command)
            try:
                if self._conn.poll(0.05):
                    return self._conn.recv()
            except (EOFError, OSError):
                raise self._failure(command) from None
            if self._deaths:
                # Rank 0 may have sent its error just before dying: read it first.
                try:
                    if self._conn.poll(0.2):
                        return self._conn.recv()
                except (EOFError, OSError):
                    pass
                raise self._failure(command)
            if deadline is not None and time.monotonic() > deadline:
                raise self._failure(command, timed_out=True)

    # ---- failure --------------------------------------------------------------------------
    def _failure(self, command: str, *, reported: dict | None = None, timed_out: bool = False,
                 note: str = "") -> RankGroupError:
        """Tear the group down and describe why it failed (ranks/failure.py): the first rank
        that raised, else the first rank seen dead, else the launcher or the deadline."""
        self.usable = False
        if not timed_out:  # torchrun stops the other ranks itself once one fails
            end = time.monotonic() + 10.0
            while "launcher" not in self._deaths and time.monotonic() < end:
                time.sleep(0.05)
        self._teardown_at = time.time()
        self._kill()
        errors = read_error_files(self.workdir)
        if reported is not None:
            errors.setdefault(reported["rank"], reported)
        log_tail = read_log_tail(self.log_path)
        causes = first_causes(errors, self._deaths, self._teardown_at)
        where = where_failed(command, causes, self._sent_at)
        if causes:
            culprit = rank_failure(causes[0], errors, self.pids, log_tail, where)
        else:
            culprit = Culprit(self._no_rank_failed(command, timed_out, where))
        self._cleanup()
        return failure_error(command, culprit, errors, log_tail, note)

    def _no_rank_failed(self, command: str, timed_out: bool, where: str) -> str:
        """The report's head when no rank raised or died: the group never formed, the deadline
        passed, or the launcher itself exited."""
        layout = self.layout
        if timed_out and command == "start" and layout.nnodes > 1:
            joins = "; ".join(layout.join_command(i) for i in range(1, layout.nnodes))
            return (f"the {layout.nnodes}-node group did not form within {self.start_timeout:.0f} s (the ranks "
                    f"were killed): every other node must join it, e.g. `{joins}`, and reach "
                    f"{layout.master_addr}:{layout.master_port}")
        if timed_out:
            return f"no reply {where} within the timeout (the ranks were killed)"
        code = self.proc.returncode if self.proc is not None else None
        return (f"the launcher ({self.launcher}, pid {self.proc.pid if self.proc else '?'}) exited with "
                f"code {code} {where}")

    # ---- teardown -------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Ask the ranks to exit, then SIGTERM and SIGKILL whatever is left (launcher session
        and each rank); remove the group's folder. Idempotent."""
        # A stream left suspended in another thread holds the lock: do not wait for it forever.
        locked = self._lock.acquire(timeout=timeout)
        try:
            if self.closed:
                return
            if self.usable and self._conn is not None:
                try:
                    self._conn.send(("shutdown", {}))
                except (OSError, EOFError):
                    pass
                self.usable = False
                # The ranks exit at once; torchrun lingers seconds after them: stop waiting then.
                end = time.monotonic() + timeout
                while (self.proc is not None and self.proc.poll() is None and time.monotonic() < end
                       and not all(r in self._deaths for r, _ in self._local())):
                    time.sleep(0.02)
            self.usable = False
            # With every rank gone torchrun has nothing left to clean up (its rendezvous store
            # lives in its own process, its log dir in our folder): a short grace will do.
            self._kill(grace=0.5)
            self._cleanup()
        finally:
            if locked:
                self._lock.release()

    def _kill(self, grace: float = 5.0) -> None:
        proc = self.proc

        def signal_all(sig: int) -> None:
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except OSError:
                    pass
            for r, pid in self._local():  # ranks run in sessions of their own
                if r not in self._deaths and alive(pid):
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass

        def all_dead() -> bool:
            return (proc is None or proc.poll() is not None) and not any(
                alive(p) for r, p in self._local() if r not in self._deaths)

        if all_dead():
            return
        signal_all(signal.SIGTERM)
        end = time.monotonic() + grace
        while not all_dead() and time.monotonic() < end:
            time.sleep(0.02)
        if not all_dead():
            signal_all(signal.SIGKILL)
            end = time.monotonic() + 5.0
            while not all_dead() and time.monotonic() < end:
                time.sleep(0.05)

    def _cleanup(self) -> None:
        self.usable = False
        self.closed = True
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._stop.set()
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join(5)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = -1
        for c in (self._conn, self._listener):
            try:
                if c is not None:
                    c.close()
            except OSError:
                pass
        self._conn = self._listener = None
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self._owner_fd >= 0:
            os.close(self._owner_fd)
            self._owner_fd = -1
        _LIVE.discard(self)

    def alive_pids(self) -> list[int]:
        """Launcher and rank pids still running (for checks that nothing is left over)."""
        pids = ([self.proc.pid] if self.proc is not None else []) + [p for _, p in self._local()]
        return [p for p in pids if alive(p)]

    def _local(self) -> list[tuple[int, int]]:
        """(rank, pid) of the ranks on this machine (node 0): the only pids that mean anything here;
        another node's launcher stops its own ranks when the group's collectives fail."""
        return [(r, self.pids[r]) for r in self.local_ranks if r < len(self.pids)]

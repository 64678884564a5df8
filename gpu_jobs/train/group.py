"""A warm rank group for the policy update: N DeepSpeed ranks started once by torchrun, serving
every later command of the run, and a PolicyTrainer-shaped proxy in the parent process.

    from gpu_jobs.train.group import GroupTrainer
    trainer = GroupTrainer(model_dir, TrainerConfig(zero_stage=3), n_ranks=2)  # starts on first use
    metrics = trainer.update(table)              # every rank reads the batch, trains on its slice
    weights = trainer.gathered_state_dict()      # full fp32 weights, here in the parent
    for bucket in trainer.iter_weight_buckets(256 << 20, torch.bfloat16): ...  # bounded memory
    trainer.save(url); trainer.load(url); trainer.save_hf(url + "/policy")
    trainer.close()                              # shutdown; SIGTERM, then SIGKILL what is left

How it runs: the parent listens on a loopback ``multiprocessing.connection.Listener`` (random
authkey); ``python -m torch.distributed.run --standalone --nproc_per_node N -m
gpu_jobs.train.group_worker`` starts the ranks; rank 0 connects, receives each command and
broadcasts it to the others (``broadcast_object_list``). Batches travel as a Parquet file in the
group's local folder (``/dev/shm`` when it has room), weights as safetensors bucket files that
the parent reads and deletes one by one.

Failures: a rank that raises or dies fails the call with a ``RankGroupError`` carrying that
rank's traceback (or how it died), found from the ranks' error files and the times the parent saw
each process exit; the group is torn down and the next call starts a fresh one. The fresh group
is brought back to the trainer's state when that state is reproducible: the start model, or the
last ``save(url)``/``load(url)`` with nothing applied since (it loads ``url``). If updates were
applied since, that state died with the group: ``state_lost`` is set and every call but
``load(url)`` and ``reset()`` raises ``TrainerStateLostError`` rather than training on the wrong
weights.

Several nodes (``nnodes`` > 1, gpu_jobs.train.launch): this machine is node 0 and runs ranks
0..n-1, rank 0 among them; every other node joins with ``python -m gpu_jobs.train.launch``, and
the batch and weight files reach its ranks broadcast from rank 0. This process watches and
kills only node 0's processes; another node's launcher ends its ranks when the collectives fail.
The launcher and the ranks die with this process (PR_SET_PDEATHSIG): the launcher is started from
a thread that lives as long as the group, because the kernel ties that signal to the thread that
forked.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["RankGroup", "GroupTrainer", "RankGroupError", "TrainerStateLostError", "sync_weights",
           "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 256 << 20
_SIGNALS = {-s.value: s.name for s in signal.Signals}


class RankGroupError(RuntimeError):
    """A rank of the group raised or died; the group has been torn down.

    ``rank``/``pid``: the rank that failed first (None when only the launcher failed);
    ``traceback_text``: its Python traceback, or how it died; ``command``: the call that failed;
    ``log_tail``: the end of the launcher's and ranks' output."""

    def __init__(self, message: str, *, rank: int | None = None, pid: int | None = None,
                 traceback_text: str = "", command: str | None = None, log_tail: str = ""):
        super().__init__(message)
        self.rank, self.pid, self.traceback_text = rank, pid, traceback_text
        self.command, self.log_tail = command, log_tail


class TrainerStateLostError(RankGroupError):
    """The group that held updates applied since the last save/load died: its weights and
    optimizer state are gone. ``load(url)`` a checkpoint (then replay), or ``reset()`` to the
    start model."""


# ---------------------------------------------------------------------------------------------
def _set_pdeathsig() -> None:  # preexec_fn: runs in the child between fork and exec
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _workdir_root(min_free: int = 1 << 30) -> str | None:
    """/dev/shm when it is writable and has room (RAM-backed: batches and buckets never touch
    a disk), else the default temp folder."""
    try:
        st = os.statvfs("/dev/shm")
        if os.access("/dev/shm", os.W_OK) and st.f_bavail * st.f_frsize >= min_free:
            return "/dev/shm"
    except OSError:
        pass
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _remove_stale_workdirs(root: str) -> None:
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


def _hold_owner_lock(workdir: str) -> int:
    """Lock <workdir>/owner.lock for this group's life (the file appears already locked)."""
    import fcntl

    tmp = os.path.join(workdir, ".owner.lock")
    fd = os.open(tmp, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(tmp, os.path.join(workdir, "owner.lock"))
    return fd


_LIVE: set["RankGroup"] = set()


@atexit.register
def _close_live_groups() -> None:
    for g in list(_LIVE):
        g.close(timeout=5.0)


class RankGroup:
    """N ranks of ``gpu_jobs.train.group_worker`` under torchrun, and the control channel.

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
        self.start_seconds: float | None = None

    def __repr__(self) -> str:
        state = "usable" if self.usable else "closed" if self.closed else "not started"
        return f"RankGroup({self.n_ranks} ranks, {state}, pids={self.pids})"

    # ---- start ----------------------------------------------------------------------------
    def start(self) -> "RankGroup":
        from multiprocessing.connection import Listener

        root = self._workdir_root if self._workdir_root is not None else _workdir_root()
        _remove_stale_workdirs(root or tempfile.gettempdir())
        self.workdir = tempfile.mkdtemp(prefix="rlmill-group-", dir=root)
        self._owner_fd = _hold_owner_lock(self.workdir)
        self.log_path = os.path.join(self.workdir, "launcher.log")
        authkey = os.urandom(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self._listener.address
        cmd = self.layout.command(self.python, 0, f"{host}:{port}", self.workdir)
        env = self._child_env(authkey)
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
                                             preexec_fn=_set_pdeathsig, cwd=os.getcwd())
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
        with self._lock:
            self._send(command, kwargs)
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                kind, payload = self._recv(command, deadline)
                if kind == "ok":
                    return payload
                if kind == "error":
                    raise self._failure(command, reported=payload)
                raise self._failure(command, note=f"unexpected message {kind!r} from rank 0")

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
        """Tear the group down and describe why it failed: the first rank that raised (a
        collective's error echoing another rank's death counts only if nothing else is known),
        else the first rank seen dead, else the launcher."""
        self.usable = False
        if not timed_out:  # torchrun stops the other ranks itself once one fails
            end = time.monotonic() + 10.0
            while "launcher" not in self._deaths and time.monotonic() < end:
                time.sleep(0.05)
        self._teardown_at = time.time()
        self._kill()
        errors = self._error_files()
        if reported is not None:
            errors.setdefault(reported["rank"], reported)
        log_tail = self._log_tail()
        exit_codes = _exit_codes(log_tail)
        events = [(e["time"], bool(e.get("comm")), r, "error") for r, e in errors.items()]
        events += [(t, False, r, "died") for r, t in self._deaths.items()
                   if isinstance(r, int) and r not in errors and t < self._teardown_at]
        causes = sorted(e for e in events if not e[1]) or sorted(events)
        if command == "start":
            where = "while starting"
        elif causes and causes[0][0] < self._sent_at:
            where = f"between calls (found when sending {command!r})"
        else:
            where = f"while running {command!r}"
        rank = pid = None
        tb = ""
        parts = []
        if causes:
            _, _, rank, kind = causes[0]
            pid = self.pids[rank] if rank < len(self.pids) else errors.get(rank, {}).get("pid")
            if kind == "error":
                e = errors[rank]
                tb = e["traceback"]
                head = f"rank {rank} (pid {pid}) raised {e['type']}: {e['message']} {where}"
                parts.append(f"--- rank {rank} traceback ---\n{tb.rstrip()}")
            else:
                code = exit_codes.get(pid)
                how = (f"exit code {code}" + (f" = {_SIGNALS[code]}" if code in _SIGNALS else "")
                       if code is not None else "killed by a signal or os._exit")
                tb = f"rank {rank} (pid {pid}) died without a Python error ({how})"
                head = f"rank {rank} (pid {pid}) died ({how}) {where}"
        elif timed_out and command == "start" and self.layout.nnodes > 1:
            joins = "; ".join(self.layout.join_command(i) for i in range(1, self.layout.nnodes))
            head = (f"the {self.layout.nnodes}-node group did not form within {self.start_timeout:.0f} s (the ranks "
                    f"were killed): every other node must join it, e.g. `{joins}`, and reach "
                    f"{self.layout.master_addr}:{self.layout.master_port}")
        elif timed_out:
            head = f"no reply {where} within the timeout (the ranks were killed)"
        else:
            code = self.proc.returncode if self.proc is not None else None
            head = (f"the launcher (torchrun, pid {self.proc.pid if self.proc else '?'}) exited with "
                    f"code {code} {where}")
        others = [f"rank {r}: {e['type']}: {e['message'][:200]}" for r, e in sorted(errors.items()) if r != rank]
        if others:
            parts.append("--- other ranks ---\n" + "\n".join(others))
        if log_tail:
            parts.append("--- launcher log (end) ---\n" + log_tail[-3000:].rstrip())
        parts.insert(0, f"rank group failed: {head}" + (f" ({note})" if note else ""))
        self._cleanup()
        return RankGroupError("\n".join(parts), rank=rank, pid=pid, traceback_text=tb, command=command,
                              log_tail=log_tail)

    def _error_files(self) -> dict[int, dict]:
        out = {}
        for path in glob.glob(os.path.join(self.workdir, "error-rank*.json")):
            try:
                with open(path) as f:
                    e = json.load(f)
                out[int(e["rank"])] = e
            except (OSError, ValueError, KeyError):
                pass
        return out

    def _log_tail(self, n: int = 12000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

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
                if r not in self._deaths and _alive(pid):
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass

        def all_dead() -> bool:
            return (proc is None or proc.poll() is not None) and not any(
                _alive(p) for r, p in self._local() if r not in self._deaths)

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
        return [p for p in pids if _alive(p)]

    def _local(self) -> list[tuple[int, int]]:
        """(rank, pid) of the ranks on this machine (node 0): the only pids that mean anything here;
        another node's launcher stops its own ranks when the group's collectives fail."""
        return [(r, self.pids[r]) for r in self.local_ranks if r < len(self.pids)]


def _exit_codes(log: str) -> dict[int, int]:
    """pid -> exit code from torchrun's failure report ("exitcode: -9 ... (pid: 123)")."""
    out: dict[int, int] = {}
    for m in re.finditer(r"exitcode\s*:?\s*(-?\d+)\)?[^\n]*?\(?pid:?\s*(\d+)", log):
        out[int(m.group(2))] = int(m.group(1))
    for m in re.finditer(r"exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)", log):
        out[int(m.group(2))] = int(m.group(1))
    return out


# ---------------------------------------------------------------------------------------------
class GroupTrainer:
    """PolicyTrainer's surface, served by a warm group of ``n_ranks`` DeepSpeed ranks.

        trainer = GroupTrainer(model_path, config, n_ranks=2, tokenizer=tok, storage=storage_config)

    The group starts on the first call that needs it (``start()`` starts it now) and serves every
    later call; ``close()`` (or dropping the last reference) tears it down. Attributes as
    PolicyTrainer: ``step``, ``config``, ``model_config``, ``model_path``, ``tokenizer``,
    ``storage``, ``zero_stage``, ``rank`` (0: the parent speaks for rank 0), ``world_size``.
    Also ``state_lost``, ``groups_started`` and ``last_start_seconds``."""

    def __init__(self, model_path: str, config: Any = None, *, n_ranks: int, tokenizer: Any = None,
                 storage: Any = None, call_timeout: float | None = None, start_timeout: float = 600.0,
                 workdir_root: str | None = None, env: dict[str, str] | None = None, nnodes: int = 1,
                 master_addr: str = "", master_port: int = 0):
        from transformers import AutoConfig

        from gpu_jobs.models import resolve_model_path

        from .config import TrainerConfig

        self.config = config if config is not None else TrainerConfig()
        pp = self.config.pipeline_parallel_size  # > 1: the ranks run PipelinePolicyTrainer (ZeRO 0/1)
        if n_ranks % pp:
            raise ValueError(f"pipeline_parallel_size={pp} must divide the {n_ranks} ranks of the group")
        self.storage = storage
        self.model_path = resolve_model_path(model_path, storage)
        self.model_config = AutoConfig.from_pretrained(self.model_path)
        self.tokenizer = tokenizer
        self.rank, self.world_size = 0, n_ranks
        resolve = getattr(self.config, "resolved_zero_stage", None)
        self.zero_stage = resolve(n_ranks // pp) if resolve else self.config.zero_stage
        self.step = 0
        self.state_lost = False
        self.groups_started = 0
        self.last_start_seconds: float | None = None
        self.call_timeout, self.start_timeout = call_timeout, start_timeout
        self._workdir_root, self._env = workdir_root, env
        self._nodes = {"nnodes": nnodes, "master_addr": master_addr, "master_port": master_port}
        self._restore_url: str | None = None  # what a fresh group loads to reach this state
        self._dirty = False  # state changed since the restore point (start model or _restore_url)
        self._box: list[RankGroup | None] = [None]
        self._start_lock = threading.RLock()
        self._finalizer = weakref.finalize(self, _close_box, self._box)

    def __repr__(self) -> str:
        return f"GroupTrainer({self.model_path!r}, {self.world_size} ranks, step {self.step}, {self._box[0]!r})"

    # ---- the group ------------------------------------------------------------------------
    @property
    def group(self) -> RankGroup | None:
        return self._box[0]

    @property
    def pids(self) -> list[int]:
        """The ranks' pids (rank order) of the current group; [] before it starts."""
        g = self._box[0]
        return list(g.pids) if g is not None and g.usable else []

    def group_layout(self):
        """Where the group's ranks run (a gpu_jobs.train.launch.NodeLayout): its join_command(i)
        is what node i runs."""
        from .launch import NodeLayout

        return NodeLayout(self.world_size, **self._nodes)

    def start(self) -> "GroupTrainer":
        """Start the group now (else the first call does)."""
        self._ensure()
        return self

    def _ensure(self, *, restore: bool = True, allow_lost: bool = False) -> RankGroup:
        with self._start_lock:
            return self._ensure_locked(restore, allow_lost)

    def _ensure_locked(self, restore: bool, allow_lost: bool) -> RankGroup:
        if self.state_lost and not allow_lost:
            raise TrainerStateLostError(
                f"the rank group holding {self.world_size}-rank trainer state (step {self.step}, updated "
                f"since {self._restore_url or 'the start model'}) died, and that state with it; "
                "load(url) a checkpoint and replay the updates after it, or reset() to the start model.")
        g = self._box[0]
        if g is not None and g.usable:
            return g
        if g is not None:
            g.close()
        g = RankGroup(self.world_size, env=self._env, start_timeout=self.start_timeout,
                      workdir_root=self._workdir_root, **self._nodes)
        self._box[0] = g
        t0 = time.monotonic()
        g.start()
        self.groups_started += 1
        info = g.call("init", timeout=self.start_timeout, model_path=self.model_path, config=self.config,
                      tokenizer=self.tokenizer, storage=self.storage)
        self.step = info["step"]
        if restore and self._restore_url is not None and not self.state_lost:
            self.step = g.call("load", timeout=self.call_timeout, url=self._restore_url)["step"]
        self.last_start_seconds = time.monotonic() - t0
        return g

    def _call(self, command: str, *, restore: bool = True, allow_lost: bool = False, **kwargs: Any) -> Any:
        try:
            g = self._ensure(restore=restore, allow_lost=allow_lost)
            return g.call(command, timeout=self.call_timeout, **kwargs)
        except TrainerStateLostError:
            raise
        except RankGroupError:
            if self._dirty:
                self.state_lost = True
            raise

    def _local_file(self, suffix: str) -> str:
        return os.path.join(self._ensure().workdir, f"{uuid.uuid4().hex}{suffix}")

    def close(self) -> None:
        """Shut the group down. The trainer stays usable: the next call starts a fresh group
        (at the restore point; if updates were applied since, state_lost is set)."""
        g = self._box[0]
        self._box[0] = None
        if g is not None:
            if g.usable and self._dirty:
                self.state_lost = True
            g.close()

    def reset(self) -> None:
        """Back to the start model (step 0), dropping any lost state; the group restarts lazily."""
        self.close()
        self.state_lost, self._dirty, self._restore_url, self.step = False, False, None, 0

    # ---- PolicyTrainer's surface ------------------------------------------------------------
    def _check(self, table: Any, require: tuple[str, ...]) -> None:
        """The ranks' input checks, here first: a bad batch raises TrainInputError in the parent
        and leaves the group running."""
        from .batch import read_rows

        read_rows(table, require=require, vocab_size=self.model_config.vocab_size)

    def _write_table(self, table: Any) -> str:
        import pyarrow.parquet as pq

        path = self._local_file(".parquet")
        pq.write_table(table, path, compression="none", use_dictionary=False)
        return path

    def update(self, table: Any) -> dict[str, float]:
        """One policy update (PolicyTrainer.update) on every rank; rank 0's metrics."""
        from .policy import required_columns

        self._check(table, required_columns(self.config, table))
        path = self._write_table(table)
        try:
            out = self._call("update", path=path)
        finally:
            _remove(path)
        self.step = out["step"]
        self._dirty = True
        return out["metrics"]

    def compute_log_probs(self, table: Any) -> list:
        """Per-row float32 log-probs of each response token (no grad)."""
        self._check(table, ())
        path = self._write_table(table)
        try:
            return self._call("compute_log_probs", path=path)
        finally:
            _remove(path)

    def gathered_state_dict(self) -> dict[str, Any]:
        """Full fp32 weights (HF names, as PolicyTrainer.gathered_state_dict), in this process."""
        import torch

        out: dict[str, Any] = {}
        for bucket in self.iter_weight_buckets(DEFAULT_BUCKET_BYTES, torch.float32):
            out.update(bucket)
        return out

    def iter_weight_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: Any = None
                            ) -> Iterator[list[tuple[str, Any]]]:
        """The full weights as lists of (name, tensor) of about ``bucket_bytes`` each (whole
        layers; ``dtype`` default float32). The ranks gather one parameter at a time; rank 0
        writes a bucket file while this process reads the one before and deletes it, so this
        process holds one bucket beyond what the consumer keeps. Stopping early is fine."""
        import torch
        from safetensors.torch import load_file

        dtype = dtype or torch.float32
        name = str(dtype).removeprefix("torch.")
        g = self._ensure()
        folder = tempfile.mkdtemp(prefix="weights-", dir=g.workdir)
        stream = None
        try:
            stream = self._stream(g, "weights", workdir=folder, bucket_bytes=int(bucket_bytes), dtype=name)
            for kind, info in stream:
                if kind == "ok":
                    return
                bucket = load_file(info["path"])
                _remove(info["path"])
                g.reply(("ack", info["index"]))
                items = list(bucket.items())
                del bucket
                yield items
                del items
        except GeneratorExit:
            # The consumer stopped. Rank 0 waits for one answer per bucket it announces: answer
            # "stop" to the next one (if any) and read the command's result.
            if stream is not None and g.usable:
                for kind, info in stream:
                    if kind == "bucket":
                        _remove(info["path"])
                        g.reply(("stop", info["index"]))
            raise
        finally:
            if stream is not None:
                stream.close()
            shutil.rmtree(folder, ignore_errors=True)

    def _stream(self, g: RankGroup, command: str, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        try:
            yield from g.stream(command, timeout=self.call_timeout, **kwargs)
        except RankGroupError:
            if self._dirty:
                self.state_lost = True
            raise

    def save(self, url: str) -> str:
        """Exact-resume state at ``url`` (PolicyTrainer.save, every rank its ZeRO shards)."""
        out = self._call("save", url=url)
        self._restore_url, self._dirty = url, False
        return out

    def load(self, url: str) -> None:
        """Restore a save(url). Also how to recover after TrainerStateLostError."""
        out = self._call("load", restore=False, allow_lost=True, url=url)
        self.step = out["step"]
        self._restore_url, self._dirty, self.state_lost = url, False, False

    def save_hf(self, url: str) -> str | None:
        """HF safetensors checkpoint at ``url`` (written by rank 0)."""
        return self._call("save_hf", url=url)

    def load_weights(self, state: dict[str, Any]) -> None:
        """Copy a full state dict (HF names) into the model; the optimizer's moments stay."""
        from safetensors.torch import save_file

        seen: set[int] = set()
        tensors = {}
        for k, v in state.items():  # safetensors refuses tensors sharing memory (tied weights)
            v = v.detach().cpu()
            ptr = v.untyped_storage().data_ptr()
            tensors[k] = v.clone().contiguous() if ptr in seen else v.contiguous()
            seen.add(ptr)
        path = self._local_file(".safetensors")
        try:
            save_file(tensors, path)
            del tensors
            self._call("load_weights", path=path)
        finally:
            _remove(path)
        self._dirty = True

    def rank_info(self) -> list[dict[str, Any]]:
        """Per rank: pid, zero_stage, partition_numel (its ZeRO-3 share of the parameters),
        materialized_numel (parameter elements held now), full_numel, optimizer_numel."""
        return self._call("rank_info")

    def _debug_raise(self, rank: int, message: str = "debug_raise") -> None:
        """Make ``rank`` raise RuntimeError(message) (tests and diagnostics)."""
        self._call("debug_raise", rank=rank, message=message)


def _close_box(box: list) -> None:
    g = box[0]
    box[0] = None
    if g is not None:
        g.close()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
def sync_weights(engine: Any, trainer: Any, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: Any = None) -> int:
    """Hand the trainer's full weights to a rollout engine; returns the number of parts sent.

    An engine with ``update_weights_partial(dict)`` (and optionally ``finish_weight_update()``,
    called after the last part) gets the weights bucket by bucket from a trainer with
    ``iter_weight_buckets``: this process then holds one bucket at a time. Every other engine
    takes one whole state dict through ``update_weights``: this process then holds the full fp32
    weights once (what the engine's API needs), plus one bucket while reading the files; the
    ranks hold one bucket (rank 0) and one gathered parameter each. The rollout engines of
    gpu_jobs.rollout (hf, vllm) take whole dicts today: hf's load_state_dict refuses missing
    keys, and vLLM 0.32's reload_weights keeps a layer that is absent from a call but rebuilds
    one that is only partly present (a fused qkv_proj/gate_up_proj) from partial data, which is
    why buckets never split a layer."""
    partial = getattr(engine, "update_weights_partial", None)
    buckets = getattr(trainer, "iter_weight_buckets", None)
    if partial is None or buckets is None:
        engine.update_weights(trainer.gathered_state_dict())
        return 1
    n = 0
    for bucket in buckets(bucket_bytes, dtype):
        partial(dict(bucket))
        n += 1
    finish = getattr(engine, "finish_weight_update", None)
    if finish is not None:
        finish()
    return n

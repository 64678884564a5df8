"""What fences a sandbox worker (gpu_jobs.reward.sandbox) off from the process that starts it.

    >>> limits = SandboxLimits(memory_mb=2048, cpu_s=30)
    >>> ctx = SandboxContext(scrubbed_env("/tmp/rlmill-sandbox-x"))   # a multiprocessing context

A worker runs a user's reward function, tool or environment, which is code from whoever wrote
the config, the dataset's task or the file in storage. So a worker:

- starts as a fresh interpreter with an environment built from an allow-list (`scrubbed_env`):
  PATH, the locale, the thread counts and what Python and the Hugging Face caches need, HOME and
  TMPDIR a private temporary folder; nothing else of the parent's environment (AWS keys,
  RLMILL_REDIS_PASSWORD, RLMILL_EVENT_KEY, ...) reaches it, not even in /proc/self/environ;
- leads its own session and process group, so killing the group (`kill_group`) also ends what
  its code started (a forked sleeper, a shell pipeline); only a process that starts yet another
  session of its own escapes that, and then still runs under the limits below;
- runs under resource limits (`confine`, rlimits inherited by every process it starts):
  address space `memory_mb`, `open_files` descriptors, files of at most `file_size_mb` (a
  larger write fails with EFBIG instead of killing the worker), no core dumps, and per task
  `cpu_s` CPU seconds (`limit_cpu_for_task`: past it the task raises TimeoutError);
- has no network when `network` is False and the OS allows it: a network namespace of its own
  (unshare(CLONE_NEWNET), as root; a user namespace with it otherwise) holds only a loopback
  that is down, so even 127.0.0.1 (Redis, the Prefect API, moto) is unreachable. Where neither
  is permitted (a container without CAP_SYS_ADMIN and user namespaces off) the worker keeps the
  host's network and the pool logs that once per process.

A worker runs as the parent's user in the parent's filesystem: files that user can read, and
/proc/<pid>/environ of its other processes (the parent's too), stay readable; there is no mount
or PID namespace. A worker running as root stays root: these limits stop mistakes and ordinary
code, not code that sets out to undo them with root's powers. Run training as a non-root user
(the image does) for the namespace and limits to hold.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
import subprocess
from dataclasses import dataclass
from multiprocessing import context as mp_context, popen_spawn_posix, spawn, util

__all__ = ["SandboxLimits", "SandboxContext", "scrubbed_env", "confine", "limit_cpu_for_task", "kill_group"]

# Variables a worker keeps from the parent: the interpreter's, the locale's, the thread pools'
# and the model caches' (a tokenizer in a reward function reads the same cache, offline).
ENV_ALLOW = (
    "PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "LD_LIBRARY_PATH",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONNOUSERSITE", "PYTHONDONTWRITEBYTECODE", "PYTHONUTF8",
    "PYTHONIOENCODING", "PYTHONWARNINGS", "VIRTUAL_ENV",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS", "TOKENIZERS_PARALLELISM",
    "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE",
    "CUDA_VISIBLE_DEVICES",
)
# Workers are already one per core: one thread each keeps a worker's address space (every
# thread reserves a stack and a malloc arena) far inside memory_mb.
_THREAD_DEFAULTS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one worker; None leaves that limit as the parent has it.

    cpu_s None: 2 x the pool's timeout + 1 (a single-threaded task meets its wall-clock timeout
    first; threads or a busy grandchild meet this)."""

    memory_mb: int | None = 4096
    cpu_s: float | None = None
    open_files: int | None = 256
    file_size_mb: int | None = 1024
    network: bool = False
    env: tuple[str, ...] = ()  # further variable names passed through (e.g. a tool's API endpoint)


def scrubbed_env(home: str, extra: tuple[str, ...] = (), parent: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a worker starts with: the allow-listed (and `extra`) names of `parent`
    (default os.environ), HOME and TMPDIR `home`, single-threaded math libraries by default."""
    parent = os.environ if parent is None else parent
    env = {k: parent[k] for k in (*ENV_ALLOW, *extra) if k in parent}
    env.setdefault("PATH", os.defpath)
    for k, v in _THREAD_DEFAULTS.items():
        env.setdefault(k, v)
    env.update(HOME=home, TMPDIR=home)
    return env


# -------------------------------------------------------------------------------- starting
class _ScrubbedPopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn, launched through subprocess so the new interpreter gets its own
    environment and session (multiprocessing's launcher copies the parent's environment)."""

    def _launch(self, process_obj):
        # multiprocessing.popen_spawn_posix.Popen._launch (CPython 3.11), with the launch call
        # replaced; the rest is its protocol (preparation data, then the process, on a pipe).
        from multiprocessing import resource_tracker
        from multiprocessing.context import reduction, set_spawning_popen
        import io

        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        prep_data = spawn.get_preparation_data(process_obj._name)
        fp = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, fp)
            reduction.dump(process_obj, fp)
        finally:
            set_spawning_popen(None)
        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            self._fds.extend([child_r, child_w])
            self._child = subprocess.Popen(cmd, executable=spawn.get_executable(), pass_fds=self._fds,
                                           env=process_obj._sandbox_env, start_new_session=True)
            self.pid = self._child.pid
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            self.finalizer = util.Finalize(self, util.close_fds, [fd for fd in (parent_r, parent_w) if fd is not None])
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)

    def poll(self, flag=os.WNOHANG):
        # One reaper: subprocess's, so its own bookkeeping never races multiprocessing's waitpid.
        if self.returncode is None:
            self.returncode = self._child.wait() if flag == 0 else self._child.poll()
        return self.returncode


class _SandboxProcess(mp_context.SpawnProcess):
    _sandbox_env: dict[str, str] = {}

    @staticmethod
    def _Popen(process_obj):
        return _ScrubbedPopen(process_obj)


class SandboxContext(mp_context.SpawnContext):
    """A spawn context whose processes start with `env` only, each leading its own session."""

    def __init__(self, env: dict[str, str]):
        super().__init__()
        self.env = dict(env)

    def Process(self, *args, **kwargs):  # noqa: N802 (multiprocessing's name)
        process = _SandboxProcess(*args, **kwargs)
        process._sandbox_env = self.env
        return process


def kill_group(pid: int) -> None:
    """SIGKILL the process group a worker leads: the worker and everything its code started."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


# -------------------------------------------------------------------------------- in the worker
def confine(limits: SandboxLimits) -> str | None:
    """Apply `limits` to this process (a fresh worker, before any user code); returns why the
    network could not be cut off, or None when it was (or was not asked to be)."""
    reason = None if limits.network else _leave_network()
    mb = 1 << 20
    for which, value in ((resource.RLIMIT_AS, limits.memory_mb and limits.memory_mb * mb),
                         (resource.RLIMIT_NOFILE, limits.open_files),
                         (resource.RLIMIT_FSIZE, limits.file_size_mb and limits.file_size_mb * mb),
                         (resource.RLIMIT_CORE, 0)):
        if value is not None:
            _lower(which, int(value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past file_size_mb fails with EFBIG
    signal.signal(signal.SIGXCPU, _cpu_exceeded)
    return reason


def _lower(which: int, value: int) -> None:
    soft, hard = resource.getrlimit(which)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))


def _cpu_exceeded(signum, frame):
    raise TimeoutError("the task used up its CPU time limit (sandbox cpu_s)")


def limit_cpu_for_task(cpu_s: float) -> None:
    """Let the task about to run use `cpu_s` more CPU seconds: the soft limit moves with each
    task (SIGXCPU past it, raised as TimeoutError); the hard limit stays, so it can move again."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(used.ru_utime + used.ru_stime + cpu_s) + 1
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _leave_network() -> str | None:
    """Move this (single-threaded) process into a network namespace of its own."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) == 0:
        return None
    first = errno.errorcode.get(ctypes.get_errno(), "?")
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        second = errno.errorcode.get(ctypes.get_errno(), "?")
        return (f"unshare(CLONE_NEWNET) failed ({first}) and a user namespace is not permitted either ({second}): "
                "the sandbox workers keep this host's network")
    # Map our own ids into the new user namespace, so files keep their owners as seen from inside.
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return None

"""The chaos harness: real `rlmill train` processes on a tiny run, killed, resumed and audited.

    with Chaos.start(workdir) as chaos:      # a Prefect API for every run of the session
        chaos.kill_at(root, "r", "after-train:update:3")
        done = chaos.finish(root, "r")

Every run is the tiny GRPO config below (3 iterations, checkpoint every 2) on one CPU thread, so
a run that was killed and resumed must end with weights bitwise equal to the uninterrupted
reference run: an update applied twice, skipped or computed from different data shows up there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo_arith.yaml"
ITERATIONS = 3
TINY = ["data.train_batch_size=8", "rollout.n=4", "data.val_size=32", "data.train_size=600",
        "actor.ppo_mini_batch_size=4", "trainer.tensorboard=false", "trainer.samples_in_artifact=2",
        f"trainer.total_iterations={ITERATIONS}", "trainer.checkpoint_every=2", "trainer.val_every=0"]


def overrides(root: str, run_id: str, *extra: str) -> list[str]:
    return [f"root={root}", f"run_id={run_id}", *TINY, *extra]


@dataclass
class Outcome:
    """One row of the chaos table."""

    fault: str
    outcome: str
    recovered: bool | None  # None: nothing to recover (the input was refused before any write)
    data_lost: int          # committed, then gone or changed (audit.AuditReport.data_lost)
    weights: str = "-"      # "= reference", "differ", or "-" when the fault changes what is trained
    not_finished: int = 0   # stages of the run's iterations never committed (AuditReport.not_finished)


@dataclass
class Chaos:
    work: Path
    api_url: str
    timeout: float = 600.0
    _references: dict[tuple[str, ...], dict[str, Any]] = field(default_factory=dict, repr=False)

    @classmethod
    @contextlib.contextmanager
    def start(cls, work: Path):
        """A Prefect API (test harness: a local server on a temporary database) for all runs."""
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline: it only logs errors
        from prefect.settings import PREFECT_API_URL
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=180):
            yield cls(Path(work), PREFECT_API_URL.value())

    # ------------------------------------------------------------------ child processes
    def env(self, failpoint: str | None = None, marker: Path | None = None) -> dict[str, str]:
        from gpu_jobs.train.ranks.dist import child_env

        # One thread: killed-and-resumed and uninterrupted runs must do the same float arithmetic.
        env = {**child_env(), "PREFECT_API_URL": self.api_url, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
               "RLMILL_LOCK_DIR": str(self.work / "locks")}  # run locks of this session only
        env.pop("RLMILL_FAILPOINT", None)
        if failpoint:
            env.update(RLMILL_FAILPOINT=failpoint, RLMILL_FAILPOINT_MARKER=str(marker))
        return env

    def cmd(self, root: str, run_id: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "benchmarks.chaos.failpoints", "train", "--config", str(EXAMPLE),
                *overrides(root, run_id, *extra)]

    def kill_at(self, root: str, run_id: str, failpoint: str,
                while_held: Callable[[int], None] | None = None, extra: tuple[str, ...] = ()) -> int:
        """Run (with overrides `extra`) until `failpoint` is reached, then SIGKILL the run's whole
        process group; returns the killed run's pid. `while_held(pid)` runs first, while the run
        is alive at that point."""
        marker = self.work / f"marker-{time.monotonic_ns()}"
        proc = subprocess.Popen(self.cmd(root, run_id, *extra), cwd=REPO, env=self.env(failpoint, marker),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_for(marker, proc, failpoint)
            if while_held is not None:
                while_held(proc.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        return proc.pid

    def _wait_for(self, marker: Path, proc: subprocess.Popen, what: str, log: Path | None = None) -> None:
        deadline = time.monotonic() + self.timeout
        while not marker.exists():
            if proc.poll() is not None:
                data = log.read_bytes() if log is not None else proc.stdout.read()
                out = data.decode(errors="replace")[-3000:]
                raise RuntimeError(f"run exited ({proc.returncode}) before reaching {what}:\n{out}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not reached within {self.timeout:.0f} s")
            time.sleep(0.05)

    def kill_main_only(self, root: str, run_id: str, marker: Path, *extra: str, grace: float = 20.0,
                       env: dict[str, str] | None = None, drop_env: tuple[str, ...] = ()) -> list[str]:
        """Start a run in its own session; once `marker` exists (something in the run touches it),
        SIGKILL the rlmill process ALONE, as the OOM killer or `kill -9 <pid>` would, not its group.
        Returns what is still running `grace` seconds later ("pid cmdline"): any process in its
        session or carrying its environment tag (children that start their own session, like a
        torchrun group, inherit the environment), then kills that too."""
        tag = f"chaos-{time.monotonic_ns()}"
        run_env = {**self.env(), **(env or {}), "RLMILL_CHAOS_TAG": tag}
        for key in drop_env:
            run_env.pop(key, None)
        # Output to a file, not a pipe: a leftover child would hold a pipe open, and reading it to
        # its end would wait for the leftover, not for the run.
        log = self.work / f"{marker.name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(self.cmd(root, run_id, *extra), cwd=REPO, env=run_env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_for(marker, proc, f"marker {marker.name}", log)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            deadline = time.monotonic() + grace
            while (left := session_processes(proc.pid, tag)) and time.monotonic() < deadline:
                time.sleep(0.5)
            return left
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            for line in session_processes(proc.pid, tag):  # clean up whatever the fault left, by pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line.split()[0]), signal.SIGKILL)

    def finish(self, root: str, run_id: str, *extra: str) -> subprocess.CompletedProcess:
        """Run (or resume) to the end; returns the completed process (check .returncode)."""
        return subprocess.run(self.cmd(root, run_id, *extra), cwd=REPO, env=self.env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=self.timeout)

    def verify(self, root: str, run_id: str, *flags: str) -> subprocess.CompletedProcess:
        """`rlmill verify` on the run (its exit code says whether damage needing the user remains)."""
        cmd = [sys.executable, "-m", "flows.cli", "verify", *flags, "--config", str(EXAMPLE),
               *overrides(root, run_id)]
        return subprocess.run(cmd, cwd=REPO, env=self.env(), text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=self.timeout)

    # ------------------------------------------------------------------ results
    def reference_root(self, extra: tuple[str, ...] = ()) -> str:
        """Where the uninterrupted run with overrides `extra` lives (run once per session)."""
        import hashlib

        tag = hashlib.sha256("\n".join(extra).encode()).hexdigest()[:8] if extra else ""
        root = str(self.work / f"reference{'-' + tag if tag else ''}")
        if extra not in self._references:
            done = self.finish(root, "r", *extra)
            if done.returncode:
                raise RuntimeError(f"the uninterrupted reference run failed:\n{done.stdout[-3000:]}")
            self._references[extra] = final_weights(root, "r")
        return root

    def reference(self, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        """Final weights of the uninterrupted run with overrides `extra` (computed once per session)."""
        self.reference_root(extra)
        return self._references[extra]

    def same_as_reference(self, root: str, run_id: str, storage: Any = None, extra: tuple[str, ...] = ()) -> str:
        """Whether the run ended with the weights of the uninterrupted one with the same `extra`
        (an async run against an async reference with the same staleness threshold)."""
        import torch

        ref, got = self.reference(extra), final_weights(root, run_id, storage)
        same = ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref)
        return "= reference" if same else "differ"


def session_processes(sid: int, tag: str | None = None) -> list[str]:
    """'pid cmdline' of every live process in session `sid`, or whose environment holds
    RLMILL_CHAOS_TAG=`tag` (Linux /proc)."""
    out = []
    marker = f"RLMILL_CHAOS_TAG={tag}".encode() if tag else None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.getsid(int(entry.name)) != sid and not (
                    marker and marker in (entry / "environ").read_bytes().split(b"\0")):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":  # a zombie is already dead: only its parent's wait() is missing
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue
        out.append(f"{entry.name} {cmd[:160]}")
    return sorted(out)


def final_weights(root: str, run_id: str, storage: Any = None) -> dict[str, Any]:
    from storage import RunLayout, load_state_dict

    return load_state_dict(RunLayout(root, run_id, storage).policy(ITERATIONS), storage)


def layout(root: str, run_id: str, storage: Any = None):
    from storage import RunLayout

    return RunLayout(root, run_id, storage)

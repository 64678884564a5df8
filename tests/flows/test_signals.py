"""Stop means stop (issue 47): SIGINT and SIGTERM end `rlmill train` within seconds, in every
phase of an iteration, with one line saying how to resume, exit status 130 or 143, nothing of the
run's process tree left, every committed table intact, and the printed command resuming it.

    .venv/bin/python -m pytest -q tests/flows/test_signals.py --basetemp=/tmp/pt-sig

Ctrl-C is sent as a user sends it: `rlmill train` runs on a pseudo-terminal (its controlling
terminal, its process group in the foreground) and the test writes ^C (\\x03) to the pty's master;
the terminal then signals the whole foreground group. SIGTERM goes to the process group, as
`timeout`, a closing terminal or systemd send it. Each row holds the run at a named moment
(benchmarks/chaos/failpoints.py, flows/failpoints.py) and signals it there. The rows share one
run: each starts with the resume command the previous one printed (so that command is checked
to work), and the last resume completes it.

`make test` runs one row (^C during the update of a 1-iteration run) on the CLI's own ephemeral
Prefect server, then the resume and `rlmill verify`, ~1 min on 2 busy cores; `make e2e` stops every phase once, setup
under both signals and the later phases alternating them, and a SIGTERM followed by a SIGKILL inside the grace, then checks that the resumed run
ends with weights bitwise equal to an uninterrupted one (benchmarks/chaos/harness.py's check).
Both ways a user runs `rlmill train` are signalled: the setup rows on the ephemeral server the
CLI starts for itself (its server must go with it), the later rows against a running Prefect
server (the test session's, as after `make server`), which also spares each row the 10-20 s of
starting one.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.servers import alive_pids
from tests.tiny import EXAMPLE, REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pty, /proc and PR_SET_PDEATHSIG")

EXIT_BOUND_S = 30.0  # the goal is 10 s; the bound leaves room for 2 busy cores (times are printed)
TINY = ["data.train_batch_size=8", "rollout.n=4", "data.val_size=32", "data.train_size=600",
        "actor.ppo_mini_batch_size=4", "trainer.tensorboard=false", "trainer.samples_in_artifact=2",
        "trainer.total_iterations=3", "trainer.checkpoint_every=2", "trainer.val_every=2"]
LINE = re.compile(r"rlmill: run (?P<run>\S+) stopped by (?P<sig>SIG\w+) after (?P<n>\d+) committed iterations?; "
                  r"resume it: (?P<cmd>.+)")


# ---------------------------------------------------------------------------- the mechanism alone
SCRIPT = textwrap.dedent("""
    import sys, time
    from flows import stopping
    stopping.set_line(lambda s: stopping.stop_line("r1", s, 2, "rlmill run --run-id r1"), grace_s=float(sys.argv[1]))
    try:
        with stopping.stop_signals():
            print("ready", flush=True)
            time.sleep(60)
    except stopping.RunStopped as stop:
        print("stopping", stop.name, flush=True)
        time.sleep(float(sys.argv[2]))  # a slow teardown
        stopping.say_once(stop.signum)
        sys.exit(stop.exit_code)
""")


def _script(grace: float, teardown: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(grace), str(teardown)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_first_signal_stops_and_the_line_is_said_once(sig):
    proc = _script(grace=30, teardown=0)
    os.kill(proc.pid, sig)
    out, _ = proc.communicate(timeout=30)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig
    assert out.splitlines() == [f"stopping {name}", f"rlmill: run r1 stopped by {name} after 2 committed "
                                "iterations; resume it: rlmill run --run-id r1"]


def test_a_second_ctrl_c_ends_a_slow_stop_at_once():
    proc = _script(grace=30, teardown=60)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.stdout.readline().strip() == "stopping SIGINT"
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 5 and proc.returncode == 130
    assert out.count("stopped by SIGINT") == 1


def test_a_stop_past_its_grace_ends_the_process():
    proc = _script(grace=1, teardown=60)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert 0.9 < time.monotonic() - t0 < 10 and proc.returncode == 143
    assert "took longer than 1 s" in out and out.count("stopped by SIGTERM after 2 committed") == 1


def test_the_outage_guard_never_waits_for_a_run_told_to_stop(monkeypatch):
    """A ConnectError during a stop (the server went with the signal) ends the run, no API wait."""
    import httpx

    from flows import stopping
    from flows.training import OutageGuard

    guard = OutageGuard(600, None, "r")
    guard.api_url = "http://127.0.0.1:9/api"  # nothing listens: an outage, were the run not stopping

    def step():
        raise httpx.ConnectError("refused", request=httpx.Request("GET", "http://127.0.0.1:9/api/flow_runs"))

    monkeypatch.setattr("flows.training.wait_for_api", lambda *a: pytest.fail("waited for the API"))
    monkeypatch.setattr(stopping._STOP, "signum", signal.SIGTERM)
    with pytest.raises(httpx.ConnectError):
        guard("iteration 1", step)


def test_the_resume_command_leaves_out_credentials_and_the_old_run_id():
    from flows.cli import _plain_overrides

    assert _plain_overrides(["root=s3://b/x", "storage.key=AKIA", "run_id=old", "rollout.n=8",
                             "storage.secret=s"]) == ["root=s3://b/x", "rollout.n=8"]


RUN_STOPPED = textwrap.dedent("""
    import os, signal, sys, time
    import flows.cli as cli
    import flows.training as training

    cli._start_ephemeral_api = lambda: None

    def rl_training(config, overrides):  # Ctrl-C in the middle of the run
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)

    training.rl_training = rl_training
    cli.main(["run", "--run-id", "r9", "root=" + sys.argv[1], "trainer.total_iterations=2"])
""")


def test_rlmill_run_prints_its_own_resume_command(tmp_path):
    """`rlmill run`'s line names `rlmill run --run-id` with the user's overrides (the embedded
    config is not the user's to repeat); the real runs below check `rlmill train`'s."""
    done = subprocess.run([sys.executable, "-c", RUN_STOPPED, str(tmp_path / "root")], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "RLMILL_LOCK_DIR": str(tmp_path / "locks")},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert done.returncode == 130, done.stdout[-3000:]
    assert [ln for ln in done.stdout.splitlines() if "stopped by" in ln] == [
        f"rlmill: run r9 stopped by SIGINT after 0 committed iterations; resume it: rlmill run --run-id r9 "
        f"root={tmp_path / 'root'} trainer.total_iterations=2"]


# ---------------------------------------------------------------------------- real runs, signalled
@dataclass
class Row:
    phase: str
    failpoint: str
    sig: int
    how: str  # "pty": ^C on the terminal; "group": kill(-pgid)
    kill_after_s: float | None = None  # then SIGKILL the group that long after the signal (a grace)
    ephemeral: bool = False  # the CLI's own Prefect server, not the session's running one


# The phases of an iteration of the shared 3-iteration run, in the order the run reaches them.
# Setup under both signals (the CLI's own server must go with it either way); after that the
# signals alternate (^C on the terminal, SIGTERM to the group), so each phase is stopped once:
# one handler serves both signals in the process, and a row costs a process start (~20 s), so
# the matrix of every phase by both signals (11 rows) paid twice the time for the same paths.
FULL = [Row("setup", "run:setup", signal.SIGINT, "pty", ephemeral=True),
        Row("setup", "run:setup", signal.SIGTERM, "group", ephemeral=True),
        Row("rollout", "before-commit:rollout:1", signal.SIGTERM, "group"),
        Row("update", "after-train:update:1", signal.SIGINT, "pty"),
        Row("commit", "before-manifest:commit:1", signal.SIGTERM, "group"),
        # The validation after iteration 2 (trainer.val_every=2), which the next start runs first.
        Row("validation", "before-commit:validate:2", signal.SIGINT, "pty"),
        # A SIGTERM, then a SIGKILL 0.3 s later (a worker or pod whose grace ran out mid-stop).
        Row("update (SIGKILL 0.3 s after)", "after-train:update:3", signal.SIGTERM, "group", kill_after_s=0.3)]
QUICK = [Row("update", "after-train:update:1", signal.SIGINT, "pty", ephemeral=True)]


def _env(work: Path, failpoint: str | None, marker: Path, ephemeral: bool = False) -> dict[str, str]:
    from gpu_jobs.train.ranks.dist import child_env

    dropped = ("PREFECT_API_URL", "RLMILL_FAILPOINT") if ephemeral else ("RLMILL_FAILPOINT",)
    env = {k: v for k, v in child_env().items() if k not in dropped}
    env.update(PYTHONPATH=str(REPO), PREFECT_HOME=str(work / "prefect"), OMP_NUM_THREADS="1",
               RLMILL_LOCK_DIR=str(work / "locks"), PREFECT_SERVER_ANALYTICS_ENABLED="false", TERM="dumb")
    if failpoint:
        env.update(RLMILL_FAILPOINT=failpoint, RLMILL_FAILPOINT_MARKER=str(marker))
    return env


def _argv(command: list[str]) -> list[str]:
    """A printed `rlmill ...` command as this interpreter runs it (failpoints installable)."""
    assert command[0] == "rlmill", command
    return [sys.executable, "-m", "benchmarks.chaos.failpoints", *command[1:]]


def _tree(pid: int) -> dict[int, str]:
    import psutil

    root = psutil.Process(pid)
    out = {}
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            out[p.pid] = " ".join(p.cmdline())[:120]
    return out


class Terminal:
    """A process on a new pseudo-terminal (its controlling terminal; its group in the foreground),
    its output collected from the master side."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        import fcntl
        import termios

        self.master, slave = os.openpty()

        def controlling_tty():
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True, preexec_fn=controlling_tty)
        os.close(slave)
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every holder of the slave side is gone
                return
            if not data:
                return
            self.chunks.append(data)

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def output(self) -> str:
        return b"".join(self.chunks).decode(errors="replace").replace("\r\n", "\n")

    def close(self) -> None:
        self.reader.join(5)
        with contextlib.suppress(OSError):
            os.close(self.master)


class Logged:
    """A process in a session of its own, its output in a file."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        pass


def _committed(root: Path, run_id: str) -> int:
    from gpu_jobs.stages import last_committed
    from storage import RunLayout

    return last_committed(RunLayout(str(root), run_id), "commit", 3)


def _signal_at(row: Row, command: list[str], work: Path, root: Path, run_id: str, i: int) -> tuple[list[str], dict]:
    """Start `command` with `row`'s failpoint armed, signal it there, check how it ended; returns
    the resume command it printed and the row's measurements."""
    from gpu_jobs.stages.verify import verify_run
    from storage import RunLayout

    marker = work / f"held-{i}"
    env = _env(work, row.failpoint, marker, row.ephemeral)
    run = (Terminal(_argv(command), env) if row.how == "pty"
           else Logged(_argv(command), env, work / f"row-{i}.log"))
    proc = run.proc
    try:
        deadline = time.monotonic() + 600
        while not (marker.exists() and marker.read_text()):
            assert proc.poll() is None, f"{row}: exited {proc.returncode} before the failpoint:\n{run.output()[-4000:]}"
            assert time.monotonic() < deadline, f"{row}: failpoint not reached in 600 s:\n{run.output()[-4000:]}"
            time.sleep(0.1)
        time.sleep(0.3)  # the holder is asleep in its loop (not a test artefact: any moment is fair)
        tree = _tree(proc.pid)
        before = _committed(root, run_id)
        t0 = time.monotonic()
        if row.how == "pty":
            run.ctrl_c()
        else:
            os.killpg(proc.pid, row.sig)
        if row.kill_after_s is not None:
            time.sleep(row.kill_after_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=EXIT_BOUND_S + 30)
        exit_s = time.monotonic() - t0
        while alive_pids(tree) and time.monotonic() - t0 < EXIT_BOUND_S + 30:
            time.sleep(0.05)
        gone_s = time.monotonic() - t0
        left = {p: tree[p] for p in alive_pids(tree)}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        run.close()
    out = run.output()
    name = signal.Signals(row.sig).name
    measured = {"phase": row.phase, "signal": name, "how": row.how, "exit_s": round(exit_s, 2),
                "tree_gone_s": round(gone_s, 2), "rc": proc.returncode}
    print(f"[signals] {measured}")
    assert not left, f"{row}: still running {gone_s:.0f} s after the signal: {left}"
    assert not verify_run(RunLayout(str(root), run_id)), f"{row}: committed data damaged"
    if row.kill_after_s is not None:  # killed inside its stop: no promise of a line or a status
        assert proc.returncode in (128 + row.sig, -signal.SIGKILL), (proc.returncode, out[-3000:])
        return command, measured
    assert proc.returncode == 128 + row.sig, f"{row}: exit status {proc.returncode}\n{out[-4000:]}"
    assert exit_s < EXIT_BOUND_S and gone_s < EXIT_BOUND_S, measured
    lines = [m for m in map(LINE.search, out.splitlines()) if m]
    assert len(lines) == 1, f"{row}: {len(lines)} stop lines\n{out[-4000:]}"
    line = lines[0]
    assert (line["run"], line["sig"], int(line["n"])) == (run_id, name, _committed(root, run_id)), line.group(0)
    assert int(line["n"]) >= before
    assert "Traceback" not in out and "Crash detected" not in out, out[-4000:]
    return shlex.split(line["cmd"]), measured


def _matrix(rows: list[Row], work: Path, iterations: int = 3) -> tuple[Path, str, list[dict]]:
    root, run_id = work / "root", "sig"
    command = ["rlmill", "train", "--config", str(EXAMPLE), f"root={root}", *TINY,
               f"trainer.total_iterations={iterations}", f"run_id={run_id}"]
    measured = []
    for i, row in enumerate(rows):
        command, m = _signal_at(row, command, work, root, run_id, i)
        measured.append(m)
    done = subprocess.run(_argv(command), cwd=REPO, env=_env(work, None, work / "none"), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:]
    assert _committed(root, run_id) == iterations
    verify = subprocess.run([sys.executable, "-m", "flows.cli", "verify", "--config", str(EXAMPLE), f"root={root}",
                             *TINY, f"trainer.total_iterations={iterations}", f"run_id={run_id}"],
                            cwd=REPO, env=_env(work, None, work / "none"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert verify.returncode == 0 and "intact" in verify.stdout, verify.stdout[-3000:]
    print("[signals] worst exit", max(m["exit_s"] for m in measured), "s; worst tree gone",
          max(m["tree_gone_s"] for m in measured), "s")
    return root, run_id, measured


@pytest.mark.slow
@pytest.mark.prefect
def test_ctrl_c_during_the_update_stops_the_run_and_its_resume_completes(tmp_path):
    _matrix(QUICK, tmp_path, iterations=1)  # the resume finishes iteration 1, and the run


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.prefect
def test_every_phase_stopped_then_the_resume_is_bitwise_equal(tmp_path):
    import torch

    from storage import RunLayout, load_state_dict

    from storage import committed

    root, run_id, _ = _matrix(FULL, tmp_path)
    # Stopped during it, the validation after iteration 2 is run by the next start, not skipped.
    assert committed(RunLayout(str(root), run_id).stage(2, "validate"))
    ref_root = tmp_path / "reference"
    ref = subprocess.run(_argv(["rlmill", "train", "--config", str(EXAMPLE), f"root={ref_root}", *TINY,
                                f"run_id={run_id}"]), cwd=REPO, env=_env(tmp_path, None, tmp_path / "none"),
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    assert ref.returncode == 0, ref.stdout[-4000:]
    got = load_state_dict(RunLayout(str(root), run_id).policy(3))
    want = load_state_dict(RunLayout(str(ref_root), run_id).policy(3))
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)

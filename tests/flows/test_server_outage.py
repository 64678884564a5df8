"""A run survives its Prefect server being stopped for 30 s in the middle of an iteration.

A real `prefect server start` (own PREFECT_HOME, free port) serves an rl-training flow run in a
child process. Once iteration 1's reward stage has committed, the server is stopped; the run then
fails its next API call, waits for the API (tasks.api_outage_budget_seconds), and when the server
is back on the same database it runs iteration 1 again in the same process: the stages that had
committed are not recomputed (each stage directory is written exactly once), the cut-off subflow
run is marked Crashed, and the run completes. ~90 s on 2 busy cores.

    .venv/bin/python -m pytest -q tests/flows/test_server_outage.py
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from tests.servers import free_port
from tests.tiny import EXAMPLE, REPO, tiny_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.prefect]

OUTAGE_S = 30  # the scenario of issue 18: a server restart that keeps the API away for 30 s

DRIVER = '''
import os, sys, time
from pathlib import Path

import torch

torch.set_num_threads(1)
import gpu_jobs.stages.shell as shell

real_write, log = shell.write_table, Path(os.environ["OUTAGE_COMMITS"])
marker, go = Path(os.environ["OUTAGE_MARKER"]), Path(os.environ["OUTAGE_GO"])


def write_table(dest, table, *a, **kw):
    """Record every stage that computes and commits; hold after iteration 1's reward commits."""
    uri = real_write(dest, table, *a, **kw)
    with open(log, "a") as f:
        f.write(dest.rstrip("/") + "\\n")
    if dest.rstrip("/").endswith("iterations/1/reward") and not marker.exists():
        marker.write_text(str(os.getpid()))
        while not go.exists():
            time.sleep(0.1)
    return uri


shell.write_table = write_table
from flows.training import rl_training

summary = rl_training(config=sys.argv[1], overrides=sys.argv[2:])
print("RLMILL-DONE", summary["run_id"], summary["iterations"], flush=True)
'''


def _wait(what: str, ok, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:] if log else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:.0f} s:\n{log.read_text()[-4000:] if log else ''}")
        time.sleep(0.2)


def _healthy(api: str) -> bool:
    try:
        urllib.request.urlopen(f"{api}/health", timeout=5).read()
        return True
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (uvicorn included), SIGKILL after 15 s."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
            return


class Server:
    def __init__(self, home: Path, logs: Path):
        self.port, self.home, self.logs, self.proc, self.starts = free_port(), home, logs, None, 0
        self.api = f"http://127.0.0.1:{self.port}/api"
        from gpu_jobs.train.ranks.dist import child_env

        # child_env: not this process's MASTER_PORT, which its own process group (an earlier test's
        # DeepSpeed) still listens on.
        self.env = {**child_env(), "PREFECT_HOME": str(home), "PREFECT_API_URL": self.api, "OMP_NUM_THREADS": "1",
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
                    "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}"}
        self.env.pop("PREFECT_PROFILE", None)

    def start(self) -> None:
        self.starts += 1
        log = self.logs / f"server-{self.starts}.log"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(["prefect", "server", "start", "--host", "127.0.0.1", "--port",
                                          str(self.port)], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        _wait("healthy server", lambda: _healthy(self.api), 180, self.proc, log)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path / "prefect-home", tmp_path)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _flow_runs(api: str):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def go():
        with temporary_settings(updates={PREFECT_API_URL: api}):
            async with get_client() as client:
                return await client.read_flow_runs()

    return asyncio.run(go())


def test_run_rides_out_a_30s_server_outage_mid_iteration(server, tmp_path):
    driver, out = tmp_path / "driver.py", tmp_path / "run.log"
    driver.write_text(textwrap.dedent(DRIVER))
    commits, marker, go = tmp_path / "commits.txt", tmp_path / "held", tmp_path / "go"
    # Prefect's client retries each API call ~60 s on its own (PREFECT_CLIENT_MAX_RETRIES=5, backoff
    # 2..32 s), which already carries a 30 s outage at some calls and not at others; with 1 retry the
    # outage reaches rlmill's guard at the first call, as a longer outage (minutes) does.
    env = {**server.env, "PYTHONPATH": str(REPO), "RLMILL_LOCK_DIR": str(tmp_path / "locks"),
           "PREFECT_CLIENT_MAX_RETRIES": "1",
           "OUTAGE_COMMITS": str(commits), "OUTAGE_MARKER": str(marker), "OUTAGE_GO": str(go)}
    args = tiny_overrides(str(tmp_path / "root"), "run_id=outage", "trainer.total_iterations=2",
                          "trainer.val_every=0", "data.val_size=16")
    with open(out, "wb") as log:
        run = subprocess.Popen([sys.executable, str(driver), str(EXAMPLE), *args], cwd=REPO, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait("reward of iteration 1 committed", marker.exists, 300, run, out)
        server.stop()
        down = time.monotonic()
        go.touch()
        _wait("'waiting for it to come back' in the run's log",
              lambda: b"waiting for it to come back" in out.read_bytes(), 120, run, out)
        assert run.poll() is None, out.read_text()[-3000:]
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down)))  # the outage itself, not a wait for a result
        server.start()
        run.wait(timeout=300)
    finally:
        _stop(run)
    text = out.read_text()
    assert run.returncode == 0 and "RLMILL-DONE outage 2" in text, text[-4000:]
    assert "answers again" in text, text[-4000:]

    written = collections.Counter(commits.read_text().split())
    stages = {d for d in written if "/iterations/1/" in d}
    assert {"rollout", "reward", "commit"} <= {d.rsplit("/", 1)[1] for d in stages}, written
    assert all(n == 1 for n in written.values()), f"a stage computed twice: {written}"

    runs = _flow_runs(server.api)
    training = [r for r in runs if r.name and "iter-" not in r.name and "run:outage" in r.tags]
    assert [r.state_type.value for r in training] == ["COMPLETED"], [(r.name, r.state_name, r.tags) for r in runs]
    first = sorted((r.state_type.value for r in runs if r.name == "iter-0001"))
    assert first == ["COMPLETED", "CRASHED"], [(r.name, r.state_name) for r in runs]

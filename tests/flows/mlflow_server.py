"""A real `mlflow server` for the tracker tests: SQLite store and local artifacts in a folder,
127.0.0.1, a free port, stopped by PID. Either the client environment's (mlflow-skinny, no web
UI: tests/flows/test_trackers.py) or the full server with its UI that
scripts/ensure_mlflow_server.sh builds (tests/flows/test_mlflow_ui.py).

    with mlflow_server(Path(sys.executable).parent / "mlflow", tmp) as url:
        client, runs = mlflow_runs(url, "trk")
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.servers import free_port, stop_group

REPO = Path(__file__).resolve().parents[2]
ENSURE_SERVER = REPO / "scripts" / "ensure_mlflow_server.sh"
EXPERIMENT = "rlmill"  # flows.trackers.PROJECT: where a run lands without MLFLOW_EXPERIMENT_NAME


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    """Until `url` answers 200; raises naming what it waited for, with the server's log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"mlflow server: {url} did not answer 200 within {timeout:.0f} s "
                       f"(exit code {proc.poll()}):\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def mlflow_server(exe: str | os.PathLike, where: Path):
    """`exe server` on a free port, its SQLite store and artifacts under `where`; yields its URL."""
    url, log = f"http://127.0.0.1:{free_port()}", where / "server.log"
    cmd = [str(exe), "server", "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
           "--backend-store-uri", f"sqlite:///{where}/mlflow.db", "--artifacts-destination", str(where / "artifacts"),
           "--workers", "1"]
    # The job runner (huey; not in mlflow-skinny) runs GenAI jobs, not needed for tracking.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(f"{url}/health", proc, log)
        yield url
    finally:
        stop_group(proc)


def ensure_full_server(timeout: float = 600.0) -> str:
    """The `mlflow` of the full server (web UI included), built once per machine by
    scripts/ensure_mlflow_server.sh (~50 s on 2 cores the first time; then instant)."""
    done = subprocess.run(["bash", str(ENSURE_SERVER)], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{ENSURE_SERVER.name} failed (exit code {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def mlflow_runs(url: str, run_id: str):
    """(client, the runs tagged rlmill.run_id=run_id in the rlmill experiment)."""
    import mlflow

    client = mlflow.MlflowClient(url)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    return client, client.search_runs([experiment.experiment_id], f"tags.`rlmill.run_id` = '{run_id}'")

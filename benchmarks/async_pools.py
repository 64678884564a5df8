"""Two local process work pools for disaggregated async RL: the update's (`rl-stage/gpu`, and the
manual deployment) and the rollout's (`rl-stage/rollout`), each with its own worker, on a real
`prefect server`, started the way `make server/deploy/worker` do (scripts/prefect_local.sh) and
stopped by PID. Used by `benchmarks/bench_async.py --disaggregated` and
tests/deployments/test_async_pools.py.

    with TwoPools(Path("/tmp/pools")) as pools:      # server, deploy, both pools, both workers
        env = pools.env                              # PREFECT_API_URL etc. for a flow process
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from gpu_jobs.train.ranks.dist import free_port
from tests.servers import wait_for_api

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "prefect_local.sh"
PREFECT = REPO / ".venv" / "bin" / "prefect"
ROLLOUT_DEPLOYMENT = "rl-stage/rollout"


def _cli(args: list[str], env: dict[str, str], timeout: float = 400) -> str:
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{' '.join(map(str, args))} failed ({done.returncode}): "
                           f"{done.stdout[-1500:]} {done.stderr[-1500:]}")
    return done.stdout


def move_rollout_to_pool(env: dict[str, str], pool: str) -> None:
    """Create process pool `pool` (if missing) and deploy rl-stage/rollout on it alone: the
    deployments read their pool from RLMILL_WORK_POOL at deploy time (deployments/prefect.yaml)."""
    with contextlib.suppress(RuntimeError):  # exists already
        _cli([str(PREFECT), "work-pool", "create", pool, "--type", "process"], env, timeout=120)
    _cli([str(PREFECT), "--no-prompt", "deploy", "--name", ROLLOUT_DEPLOYMENT, "--prefect-file",
          "deployments/prefect.yaml"], {**env, "RLMILL_WORK_POOL": pool})


def start_worker(env: dict[str, str], pool: str, log: Path) -> subprocess.Popen:
    """A process worker on `pool`, in a session of its own (stop it with `stop`)."""
    with open(log, "wb") as out:
        return subprocess.Popen([str(PREFECT), "worker", "start", "--pool", pool, "--type", "process"], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to the process group we started, SIGKILL after `grace` s (a process worker may
    ignore SIGTERM); by PID, never by name."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)


class TwoPools:
    """`prefect server` on a free port with its own PREFECT_HOME under `work`, every deployment on
    pool `update_pool`, rl-stage/rollout moved to `rollout_pool`, one worker per pool."""

    def __init__(self, work: Path, update_pool: str = "update", rollout_pool: str = "rollout"):
        self.work, self.pools = work, (update_pool, rollout_pool)
        work.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.api = f"http://127.0.0.1:{port}/api"
        self.env = {**os.environ, "PREFECT_HOME": str(work / "home"), "PORT": str(port), "PREFECT_API_URL": self.api,
                    "RLMILL_WORK_POOL": update_pool, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}",
                    "PREFECT_WORKER_QUERY_SECONDS": "2",  # default 10 s: the wait before every stage run starts
                    "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        for key in ("PREFECT_PROFILE", "PREFECT_UI_API_URL"):
            self.env.pop(key, None)
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "TwoPools":
        try:
            with open(self.work / "server.log", "wb") as out:
                self.procs.append(subprocess.Popen(["bash", str(SCRIPT), "server"], cwd=REPO, env=self.env,
                                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            wait_for_api(self.api, self.work / "server.log", timeout=180, proc=self.procs[0])
            _cli(["bash", str(SCRIPT), "deploy"], self.env)
            move_rollout_to_pool(self.env, self.pools[1])
            for pool in self.pools:
                self.procs.append(start_worker(self.env, pool, self.work / f"worker-{pool}.log"))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):
            stop(proc)


async def stage_flow_runs(client, run_id: str) -> list:
    """Every rl-stage flow run of rlmill run `run_id` (deployment runs carry its `run:<id>` tag)."""
    from prefect.client.schemas import filters as F

    runs, offset = [], 0
    flt = F.FlowRunFilter(tags=F.FlowRunFilterTags(all_=[f"run:{run_id}"]))
    while page := await client.read_flow_runs(flow_run_filter=flt, limit=200, offset=offset):
        runs += page
        offset += len(page)
    return [r for r in runs if r.parameters.get("stage")]

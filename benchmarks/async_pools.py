"""Two local process work pools for disaggregated async RL: the update's (`rl-stage/gpu`, and the
manual deployment) and the rollout's (`rl-stage/rollout`), each with its own worker, on a real
`prefect server`, started the way `make server/deploy/worker` do (tests.servers.LocalPrefect)
and stopped by PID. Used by `benchmarks/bench_async.py --disaggregated` and
tests/deployments/test_async_pools.py.

    with TwoPools(Path("/tmp/pools")) as pools:      # server, deploy, both pools, both workers
        env = pools.env                              # PREFECT_API_URL etc. for a flow process
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from tests.servers import REPO, LocalPrefect

PREFECT = str(REPO / ".venv" / "bin" / "prefect")
ROLLOUT_DEPLOYMENT = "rl-stage/rollout"


def move_rollout_to_pool(prefect: LocalPrefect, pool: str) -> None:
    """Create process pool `pool` (if missing) and deploy rl-stage/rollout on it alone: the
    deployments read their pool from RLMILL_WORK_POOL at deploy time (deployments/prefect.yaml)."""
    with contextlib.suppress(RuntimeError):  # exists already
        prefect.cli([PREFECT, "work-pool", "create", pool, "--type", "process"], timeout=120)
    prefect.cli([PREFECT, "--no-prompt", "deploy", "--name", ROLLOUT_DEPLOYMENT, "--prefect-file",
                 "deployments/prefect.yaml"], timeout=400, RLMILL_WORK_POOL=pool)


class TwoPools(LocalPrefect):
    """A local Prefect (tests.servers.LocalPrefect) with every deployment on pool `update_pool`,
    rl-stage/rollout moved to `rollout_pool`, and one worker per pool."""

    def __init__(self, work: Path, update_pool: str = "update", rollout_pool: str = "rollout", db: str | None = None):
        super().__init__(work, update_pool, db=db)
        self.rollout_pool = rollout_pool

    def __enter__(self) -> "TwoPools":
        super().__enter__()  # the server, healthy
        try:
            self.deploy()
            move_rollout_to_pool(self, self.rollout_pool)
            self.start_worker()
            self.start_worker(self.rollout_pool)
        except BaseException:
            self.close()
            raise
        return self


async def stage_flow_runs(client, run_id: str) -> list:
    """Every rl-stage flow run of rlmill run `run_id` (deployment runs carry its `run:<id>` tag)."""
    from prefect.client.schemas import filters as F

    runs, offset = [], 0
    flt = F.FlowRunFilter(tags=F.FlowRunFilterTags(all_=[f"run:{run_id}"]))
    while page := await client.read_flow_runs(flow_run_filter=flt, limit=200, offset=offset):
        runs += page
        offset += len(page)
    return [r for r in runs if r.parameters.get("stage")]

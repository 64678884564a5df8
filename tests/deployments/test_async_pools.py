"""Disaggregated async RL through two work pools on a real local Prefect (see conftest): the
rl-training deployment run, with async_training.staleness_threshold=1, sends rollouts to
rl-stage/rollout on a pool of its own and the trainer's stages to rl-stage/gpu, and ends with the
weights of the same run made colocated in this process. ~3-6 minutes on two busy cores.

    .venv/bin/python -m pytest -q tests/deployments/test_async_pools.py
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.prefect, pytest.mark.deepspeed]

ROLLOUT_POOL = "rlmill-test-rollout"
RUN_TIMEOUT_S = 900  # ~10 stage runs of a few seconds each, each a fresh process started by a worker
ASYNC = ["async_training.staleness_threshold=1", "actor.recompute_old_logprobs=true",
         "algorithm.rollout_correction.rollout_is=token", "trainer.checkpoint_every=1"]


@pytest.fixture(scope="module")
def rollout_worker(prefect_worker, tools):
    """rl-stage/rollout moved to its own pool, with a second worker polling it."""
    from benchmarks.async_pools import move_rollout_to_pool
    from tests.servers import stop_group

    move_rollout_to_pool(tools.prefect, ROLLOUT_POOL)
    proc = tools.prefect.start_worker(ROLLOUT_POOL)
    try:
        yield proc
    finally:
        stop_group(proc)


def _colocated_policy(root, run_id: str, tiny: list[str]) -> str:
    """The same run, colocated in this process; returns its final policy folder."""
    from flows.config import load_run_config
    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
    from tests.tiny import EXAMPLE

    cfg = load_run_config(EXAMPLE, [f"root={root}", f"run_id={run_id}", *tiny, *ASYNC, "trainer.total_iterations=2"])
    run, roles = open_warm(cfg)
    try:
        for k in (1, 2):
            run_iteration(DirectCalls(run, roles), cfg, k)
        return run.layout.policy(2)
    finally:
        roles.close()


def test_async_run_samples_on_the_rollout_pool_and_matches_colocated_bitwise(rollout_worker, api, tools, tmp_path):
    from benchmarks.async_pools import stage_flow_runs
    from storage import RunLayout, committed, load_state_dict

    run_id = "async-pools"
    t0 = time.monotonic()
    flow_run_id = tools.trigger("rl-training/manual", {"iterations": 2, "overrides": [
        f"root={tmp_path / 'pools'}", f"run_id={run_id}", *tools.tiny, *ASYNC, "trainer.placement=remote",
        "trainer.rollout_deployment=rl-stage/rollout", "tasks.auto_resumes=0"]})
    run = tools.wait_final(api, flow_run_id, RUN_TIMEOUT_S, None)
    assert run.state.is_completed(), f"{run.state} after {time.monotonic() - t0:.0f} s"

    layout = RunLayout(str(tmp_path / "pools"), run_id)
    for k in (1, 2):
        assert committed(layout.stage(k, "commit")), k
    runs = api(lambda c: stage_flow_runs(c, run_id))
    deployments = {d: api(lambda c, d=d: c.read_deployment_by_name(d)).id for d in ("rl-stage/gpu", "rl-stage/rollout")}
    where = {r.name: next(n for n, i in deployments.items() if i == r.deployment_id) for r in runs}
    assert len(where) == len(runs), sorted(r.name for r in runs)  # no stage of an iteration ran twice
    assert all(r.state.is_completed() for r in runs), [(r.name, r.state_name) for r in runs]
    assert {n: d for n, d in where.items() if n.startswith(("rollout", "validate"))} == {
        "rollout-0001": "rl-stage/rollout", "rollout-0002": "rl-stage/rollout",
        "validate-0000": "rl-stage/rollout", "validate-0002": "rl-stage/rollout"}
    assert {n: d for n, d in where.items() if n.startswith(("update", "logprobs"))} == {
        "update-0001": "rl-stage/gpu", "update-0002": "rl-stage/gpu",
        "logprobs-0001": "rl-stage/gpu", "logprobs-0002": "rl-stage/gpu"}
    assert all(r.work_pool_name == ROLLOUT_POOL for r in runs if where[r.name] == "rl-stage/rollout")

    got = load_state_dict(layout.policy(2))
    expected = load_state_dict(_colocated_policy(tmp_path / "colocated", run_id, tools.tiny))
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name


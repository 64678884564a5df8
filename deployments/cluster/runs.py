"""A run across the cluster's hosts, checked: triggered like `prefect deployment run`, verified
with `rlmill verify`, its final weights compared with the same config trained on one box, and
what it moved through storage counted.

    python -m deployments.cluster run --compare
"""

from __future__ import annotations

import os
import time

from deployments.cluster.control import BUCKET, MODEL_URL, _cli, operator_env
from deployments.cluster.hosts import REPO, Cluster, ClusterError
from deployments.cluster.services import API_PORT, RANK_PORT

EXAMPLE = REPO / "examples" / "grpo_arith.yaml"
ROOT = f"s3://{BUCKET}/runs"
# Two nodes x one rank against one node x two ranks: the same ranks and data split, but another
# launcher and gloo's pairs over a bridge in place of loopback; the reductions may be ordered
# differently. tests/train/test_group.py bounds the same comparison by REORDER_REL.
WEIGHTS_REL = 1e-5


def run_overrides(cluster: Cluster, run_id: str, iterations: int, extra: list[str]) -> list[str]:
    """The tiny run on the cluster's S3, remote placement, one rank group of two nodes x one rank
    (node 0 on train0, node 1 joining from train1)."""
    from tests.tiny import TINY

    return [f"root={ROOT}", f"run_id={run_id}", f"model.path={MODEL_URL}", *TINY, "trainer.placement=remote",
            "trainer.checkpoint_every=1", "trainer.rollout_deployment=rl-stage/rollout", "trainer.nnodes=2",
            "trainer.n_gpus_per_node=1", f"trainer.master_addr={cluster.addr('train0')}",
            f"trainer.master_port={RANK_PORT}", f"trainer.total_iterations={iterations}", *extra]


def _use_cluster(cluster: Cluster) -> None:
    """This process talks to the cluster's API and S3 (the operator's shell)."""
    os.environ.update({k: v for k, v in operator_env(cluster).items() if k.startswith(("PREFECT_", "AWS_"))})


def trigger_and_wait(cluster: Cluster, overrides: list[str], iterations: int, timeout: float) -> tuple[str, float]:
    """A run of rl-training/manual (what `prefect deployment run 'rl-training/manual' -p ...` makes,
    with an idempotency key against a create sent twice); returns its final state's name and the
    flow run's seconds from start to end."""
    import asyncio
    import uuid

    _use_cluster(cluster)
    from prefect.client.orchestration import get_client

    async def go() -> tuple[str, float]:
        async with get_client() as client:
            deployment = await client.read_deployment_by_name("rl-training/manual")
            run = await client.create_flow_run_from_deployment(
                deployment.id, parameters={"iterations": iterations, "overrides": overrides},
                idempotency_key=uuid.uuid4().hex)
            print(f"flow run {run.name}: http://{cluster.addr('api')}:{API_PORT}/runs/flow-run/{run.id}", flush=True)
            deadline = time.monotonic() + timeout
            while True:
                run = await client.read_flow_run(run.id)
                if run.state and run.state.is_final():
                    took = (run.end_time - run.start_time).total_seconds() if run.start_time and run.end_time else 0.0
                    return run.state.name, took
                if time.monotonic() > deadline:
                    raise ClusterError(f"flow run {run.id} is still {run.state.name if run.state else '?'} after "
                                       f"{timeout:.0f} s")
                await asyncio.sleep(2)

    return asyncio.run(go())


def one_box_policy(overrides: list[str], iterations: int, root: str) -> str:
    """The same run trained in this process alone (colocated, one node of two ranks; remote
    placement gives a colocated run's weights bitwise: tests/flows/test_remote.py); returns the
    final policy's URL."""
    from flows.config import load_run_config
    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration

    cluster_only = ("root=", "trainer.placement=", "trainer.rollout_deployment=", "trainer.nnodes=",
                    "trainer.master_addr=", "trainer.master_port=")
    local = [o for o in overrides if not o.startswith(cluster_only)]
    cfg = load_run_config(EXAMPLE, [*local, f"root={root}", "trainer.nnodes=1", "trainer.n_gpus_per_node=2"])
    run, roles = open_warm(cfg)
    try:
        for k in range(1, iterations + 1):
            run_iteration(DirectCalls(run, roles), cfg, k)
        return run.layout.policy(iterations)
    finally:
        roles.close()


def weights_gap(a_url: str, b_url: str) -> float:
    """max over tensors of |a - b|_max / |b|_max (0.0: bitwise equal)."""
    import torch

    from storage import load_state_dict

    a, b = load_state_dict(a_url), load_state_dict(b_url)
    if a.keys() != b.keys():
        raise ClusterError(f"the two policies hold different tensors: {sorted(a.keys() ^ b.keys())[:5]}")
    gap = 0.0
    for name in a:
        diff = (a[name].float() - b[name].float()).abs().max().item()
        gap = max(gap, diff / max(b[name].float().abs().max().item(), 1e-12))
    return gap if not all(torch.equal(a[n], b[n]) for n in a) else 0.0


def stored_bytes(root: str, run_id: str, iterations: int) -> dict[str, int]:
    """Bytes each stage committed to storage over the run's iterations (its manifest's files),
    and the checkpoints (what each pool stage reads back from the stage before it)."""
    from storage import RunLayout, committed, read_manifest
    from storage.fs import url_to_fs

    layout = RunLayout(root, run_id)
    out: dict[str, int] = {}
    for k in range(1, iterations + 1):
        fs, path = url_to_fs(layout.iteration(k))
        for stage_dir in fs.ls(path, detail=False):
            name = stage_dir.rstrip("/").rsplit("/", 1)[-1]
            url = layout.stage(k, name)
            if committed(url):
                out[name] = out.get(name, 0) + sum(f.size for f in read_manifest(url).files)
    for k in range(1, iterations + 1):
        fs, path = url_to_fs(layout.checkpoint(k))
        out["checkpoints"] = out.get("checkpoints", 0) + fs.du(path)
    return out


def cluster_run(cluster: Cluster, run_id: str, iterations: int, extra: list[str], timeout: float,
                compare: bool = False) -> int:
    overrides = run_overrides(cluster, run_id, iterations, extra)
    state, seconds = trigger_and_wait(cluster, overrides, iterations, timeout)
    print(f"run {run_id}: {state} in {seconds:.0f} s")
    if state != "Completed":
        return 1
    print(_cli(cluster, "rlmill", "verify", "--config", str(EXAMPLE), f"root={ROOT}", f"run_id={run_id}").strip())
    for stage, size in sorted(stored_bytes(ROOT, run_id, iterations).items()):
        print(f"  {stage:14} {size / 1e6:8.2f} MB committed over {iterations} iterations")
    if compare:
        from storage import RunLayout

        local = one_box_policy(overrides, iterations, str(cluster.state / "operator" / "one-box"))
        gap = weights_gap(RunLayout(ROOT, run_id).policy(iterations), local)
        print(f"final weights against one box (1 node x 2 ranks): max relative gap {gap:.2e} "
              f"({'bitwise equal' if gap == 0 else f'bound {WEIGHTS_REL:.0e}'})")
        if gap > WEIGHTS_REL:
            return 1
    return 0

"""A run across the cluster's hosts, checked: triggered like `prefect deployment run`, verified
with `rlmill verify`, its final weights compared with the same config trained on one box, and
what it moved through storage counted.

    python -m deployments.cluster run --compare
"""

from __future__ import annotations

import contextlib
import os
import time

from deployments.cluster.control import BUCKET, _cli, api_url, s3_endpoint, s3_env
from deployments.cluster.hosts import REPO, Cluster, ClusterError
from deployments.cluster.services import API_PORT, RANK_PORT

EXAMPLE = REPO / "examples" / "grpo_arith.yaml"
ROOT = f"s3://{BUCKET}/runs"
# Two nodes x one rank against one node x two ranks: the same ranks and data split, but another
# launcher and gloo's pairs over a bridge in place of loopback; the reductions may be ordered
# differently. tests/train/test_group.py bounds the same comparison by REORDER_REL.
WEIGHTS_REL = 1e-5
# A run small enough that an iteration takes seconds (the size of tests/tiny.py's).
SMALL = ["data.train_batch_size=8", "rollout.n=4", "data.val_size=32", "data.train_size=600",
         "actor.ppo_mini_batch_size=4", "trainer.tensorboard=false", "trainer.samples_in_artifact=2"]


def run_overrides(master_addr: str, run_id: str, iterations: int, extra: list[str], master_port: int = RANK_PORT,
                  bucket: str = BUCKET) -> list[str]:
    """The small run on S3 (bucket `bucket`), remote placement, one rank group of two nodes x one
    rank (node 0 where the update runs, listening at master_addr:master_port; node 1 joining)."""
    return [f"root=s3://{bucket}/runs", f"run_id={run_id}", f"model.path=s3://{bucket}/models/builtin", *SMALL,
            "trainer.placement=remote", "trainer.checkpoint_every=1", "trainer.rollout_deployment=rl-stage/rollout",
            "trainer.nnodes=2", "trainer.n_gpus_per_node=1", f"trainer.master_addr={master_addr}",
            f"trainer.master_port={master_port}", f"trainer.total_iterations={iterations}", *extra]


@contextlib.contextmanager
def s3_of(cluster: Cluster):
    """This process reaches the cluster's S3 through the AWS_* environment, as every host does
    (credentials never go into a run's config), for the `with` block."""
    env = s3_env(s3_endpoint(cluster))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def _client_call(url: str, fn):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url}):  # whatever this process's API is
        async with get_client() as client:
            return await fn(client)


def api(where: Cluster | str, fn):
    """`await fn(client)` with a client of the cluster's Prefect API (or the API at URL `where`)."""
    import asyncio

    return asyncio.run(_client_call(where if isinstance(where, str) else api_url(where), fn))


def trigger(cluster: Cluster, overrides: list[str], iterations: int) -> str:
    """A run of rl-training/manual (what `prefect deployment run 'rl-training/manual' -p ...` makes,
    with an idempotency key against a create sent twice); returns the flow run's id."""
    import uuid

    async def create(client):
        deployment = await client.read_deployment_by_name("rl-training/manual")
        run = await client.create_flow_run_from_deployment(
            deployment.id, parameters={"iterations": iterations, "overrides": overrides},
            idempotency_key=uuid.uuid4().hex)
        print(f"flow run {run.name}: http://{cluster.addr('api')}:{API_PORT}/runs/flow-run/{run.id}", flush=True)
        return str(run.id)

    return api(cluster, create)


def wait_final(cluster: Cluster | str, flow_run_id: str, timeout: float) -> tuple[str, float]:
    """The flow run's final state's name and its seconds from start to end. The API may be away
    for a while (the api host restarted): that is waited out within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            run = api(cluster, lambda c: c.read_flow_run(flow_run_id))
        except Exception as exc:  # noqa: BLE001 - the API down or restarting: ask again
            run, last = None, exc
        if run is not None and run.state and run.state.is_final():
            took = (run.end_time - run.start_time).total_seconds() if run.start_time and run.end_time else 0.0
            return run.state.name, took
        if time.monotonic() > deadline:
            now = run.state.name if run is not None and run.state else f"unknown ({last})"
            raise ClusterError(f"flow run {flow_run_id} is still {now} after {timeout:.0f} s")
        time.sleep(2)


def _stage_runs(cluster: Cluster, run_id: str, name: str) -> list:
    from prefect.client.schemas import filters as F

    flt = F.FlowRunFilter(tags=F.FlowRunFilterTags(all_=[f"run:{run_id}"]), name=F.FlowRunFilterName(any_=[name]))
    return api(cluster, lambda c: c.read_flow_runs(flow_run_filter=flt))


def stage_attempts(cluster: Cluster, run_id: str, name: str) -> list[str]:
    """The final states of every flow run of stage `name` (e.g. update-0001) of rlmill run `run_id`."""
    return [r.state_name for r in sorted(_stage_runs(cluster, run_id, name), key=lambda r: r.created)]


def stage_running(cluster: Cluster, run_id: str, name: str, timeout: float) -> None:
    """Wait until the stage flow run `name` (e.g. update-0001) of rlmill run `run_id` is Running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.state_name == "Running" for r in _stage_runs(cluster, run_id, name)):
            return
        time.sleep(0.5)
    raise ClusterError(f"stage {name} of run {run_id} did not start running within {timeout:.0f} s")


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


def one_box_reference(cluster: Cluster, overrides: list[str], iterations: int) -> str:
    """The final policy of the cluster run's config trained on this machine alone (made once per
    cluster state: the same config gives the same weights)."""
    from storage import committed

    root = str(cluster.state / "operator" / "one-box")
    cfg_key = [o for o in overrides if not o.startswith("run_id=")]
    marker = cluster.state / "operator" / "one-box.key"
    policy = None
    if marker.exists() and marker.read_text() == repr(cfg_key):
        policy = marker.with_suffix(".policy").read_text()
    if policy is None or not committed(policy, name="model.safetensors.index.json"):
        with s3_of(cluster):
            policy = one_box_policy([*cfg_key, f"run_id=one-box-{time.strftime('%H%M%S')}"], iterations, root)
        marker.with_suffix(".policy").write_text(policy)
        marker.write_text(repr(cfg_key))
    return policy


def weights_gap(cluster: Cluster, run_id: str, iterations: int, reference: str) -> float:
    """max over tensors of |a - b|_max / |b|_max between run `run_id`'s final policy and
    `reference` (0.0: bitwise equal)."""
    from storage import RunLayout, load_state_dict

    with s3_of(cluster):
        a = load_state_dict(RunLayout(ROOT, run_id).policy(iterations))
        b = load_state_dict(reference)
    if a.keys() != b.keys():
        raise ClusterError(f"the two policies hold different tensors: {sorted(a.keys() ^ b.keys())[:5]}")
    gap = 0.0
    for name in a:
        diff = (a[name].float() - b[name].float()).abs().max().item()
        gap = max(gap, diff / max(b[name].float().abs().max().item(), 1e-12))
    return gap


def iteration_seconds(where: Cluster | str, run_id: str) -> dict[int, float]:
    """k -> seconds of iteration k's subflow run (iter-000k) of rlmill run `run_id`."""
    from prefect.client.schemas import filters as F

    flt = F.FlowRunFilter(name=F.FlowRunFilterName(like_="iter-"))
    out = {}
    for r in api(where, lambda c: c.read_flow_runs(flow_run_filter=flt, limit=200)):
        if r.parameters.get("run_id") == run_id and r.start_time and r.end_time and r.state_name == "Completed":
            out[int(r.name.split("-")[1])] = (r.end_time - r.start_time).total_seconds()
    return dict(sorted(out.items()))


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
        fs, path = url_to_fs(layout.checkpoint(k))
        out["checkpoints"] = out.get("checkpoints", 0) + fs.du(path)
    return out


def cluster_run(cluster: Cluster, run_id: str, iterations: int, extra: list[str], timeout: float,
                compare: bool = False) -> int:
    overrides = run_overrides(cluster.addr("train0"), run_id, iterations, extra)
    state, seconds = wait_final(cluster, trigger(cluster, overrides, iterations), timeout)
    print(f"run {run_id}: {state} in {seconds:.0f} s")
    if state != "Completed":
        return 1
    print(_cli(cluster, "rlmill", "verify", "--config", str(EXAMPLE), f"root={ROOT}", f"run_id={run_id}").strip())
    with s3_of(cluster):
        for stage, size in sorted(stored_bytes(ROOT, run_id, iterations).items()):
            print(f"  {stage:14} {size / 1e6:8.2f} MB committed over {iterations} iterations")
    if compare:
        gap = weights_gap(cluster, run_id, iterations, one_box_reference(cluster, overrides, iterations))
        print(f"final weights against one box (1 node x 2 ranks): max relative gap {gap:.2e} "
              f"({'bitwise equal' if gap == 0 else f'bound {WEIGHTS_REL:.0e}'})")
        if gap > WEIGHTS_REL:
            return 1
    return 0

"""What crossing hosts costs: the same run (remote placement, a rank group of two nodes x one
rank, model and root on S3) on one box and across the cluster of deployments/cluster, same day,
same machine. Prints seconds per iteration (each iteration's own subflow run in Prefect) and the
ratio, and what each stage committed to storage per iteration. Needs root (the cluster).

    .venv/bin/python -m benchmarks.bench_cluster                 # 3 iterations each (~8 min on 2 cores)
    make bench-cluster ARGS="--iterations 4"

One box: a Prefect server on PostgreSQL (as on the api host), the two pools' workers, moto and node 1's join loop as
processes of this machine on 127.0.0.1 (benchmarks/async_pools.TwoPools: the deployment tests'
stack). The cluster: the same services, each on its own host, talking over the bridge.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deployments.cluster import runs
from deployments.cluster.control import down, s3_env, up, upload_model
from deployments.cluster.hosts import Cluster


def _node1_loop(master_port: int, env: dict[str, str], workdir: Path) -> subprocess.Popen:
    """Node 1 on this machine: the join command, run again after each group (as host train1 does)."""
    from gpu_jobs.train.ranks.launch import NodeLayout

    join = NodeLayout(2, 2, "127.0.0.1", master_port).join_command(1).split()[1:] + ["--workdir", str(workdir)]
    code = (f"import os, sys; from deployments.cluster.services import Supervisor; "
            f"sys.exit(Supervisor({{'node1': [sys.executable, *{join!r}]}}, dict(os.environ), "
            f"logs={str(workdir / 'logs')!r}).run())")
    return subprocess.Popen([sys.executable, "-c", code], cwd=runs.REPO, env=env, start_new_session=True)


def one_box(work: Path, run_id: str, iterations: int) -> dict[int, float]:
    """The run with every service a process of this machine; k -> seconds of iteration k."""
    from benchmarks.async_pools import TwoPools
    from tests.servers import MotoServer, free_port, stop_group

    with MotoServer() as s3:
        s3.new_bucket("rlmill")
        os.environ.update(s3_env(s3.endpoint_url))
        upload_model(s3.endpoint_url)
        port = free_port()
        with TwoPools(work / "prefect", db="postgres") as pools:  # the server's database as on the api host
            node1 = _node1_loop(port, pools.env, work / "node1")
            try:
                overrides = runs.run_overrides("127.0.0.1", run_id, iterations, [], master_port=port)
                flow_run = pools.trigger("rl-training/manual", {"iterations": iterations, "overrides": overrides})
                state, _ = runs.wait_final(pools.api, flow_run, 1800)
                if state != "Completed":
                    raise RuntimeError(f"the one-box run ended {state}; see {work / 'prefect'}")
                return runs.iteration_seconds(pools.api, run_id)
            finally:
                stop_group(node1)


def across_hosts(cluster: Cluster, run_id: str, iterations: int) -> tuple[dict[int, float], dict[str, int]]:
    flow_run = runs.trigger(cluster, runs.run_overrides(cluster.addr("train0"), run_id, iterations, []), iterations)
    state, _ = runs.wait_final(cluster, flow_run, 1800)
    if state != "Completed":
        raise RuntimeError(f"the cluster run ended {state}; python -m deployments.cluster logs train0")
    with runs.s3_of(cluster):
        moved = runs.stored_bytes(runs.ROOT, run_id, iterations)
    return runs.iteration_seconds(cluster, run_id), moved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=3)
    args = p.parse_args(argv)
    run_id = f"bench-{time.strftime('%H%M%S')}"
    cluster = Cluster(Path(f"/var/tmp/rlmill-bench-cluster-{os.getpid()}"), prefix="rlmb", subnet="10.233.0")
    try:
        with tempfile.TemporaryDirectory(prefix="rlmill-bench-cluster-") as tmp:
            box = one_box(Path(tmp), run_id, args.iterations)
        up(cluster)
        hosts, moved = across_hosts(cluster, run_id, args.iterations)
    finally:
        down(cluster)
    print(f"\nrlmill bench-cluster, {time.strftime('%Y-%m-%d')}, {args.iterations} iterations of the small run "
          f"(8 prompts x 4, remote placement, 2 nodes x 1 rank), seconds per iteration (its subflow run):\n")
    print("| iteration | one box | 5 hosts | ratio |\n|---:|---:|---:|---:|")
    for k in sorted(box):
        print(f"| {k} | {box[k]:.1f} | {hosts.get(k, float('nan')):.1f} | {hosts.get(k, float('nan')) / box[k]:.2f} |")
    for name, stat in (("mean", statistics.mean), ("median", statistics.median)):
        b, h = stat(box.values()), stat(hosts.values())
        print(f"| {name} | {b:.1f} | {h:.1f} | {h / b:.2f} |")
    print(f"| spread (stdev) | {statistics.pstdev(box.values()):.1f} | {statistics.pstdev(hosts.values()):.1f} | |\n")
    print("| committed to storage per iteration | MB |\n|---|---:|")
    for stage, size in sorted(moved.items()):
        print(f"| {stage} | {size / 1e6 / args.iterations:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

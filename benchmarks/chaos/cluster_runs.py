"""Faults between hosts: chaos rows on the cluster of deployments/cluster (five hosts sharing
nothing but the network; needs root). Each row starts a 2-iteration run across the hosts, waits
until the stage it aims at is running (read from the Prefect API, not a clock), does the fault,
and waits for the run to end with no operator: every iteration committed once, everything
committed before the fault unchanged, the final weights those of the same config on one box.

The cluster is booted by the first row (its own bridge and addresses, so a `make cluster` of
your own is left alone) and taken down when the chaos run exits.

    .venv/bin/python -m benchmarks.chaos --only cluster-run,cluster-kill-train1
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path
from typing import Callable

from .audit import audit, snapshot
from .harness import Outcome, layout
from .scenarios import _result, scenario

ITERATIONS = 2
RUN_TIMEOUT_S = 900.0
_SESSION: dict = {}


def _cluster():
    """The chaos session's cluster, booted on first use."""
    from deployments.cluster.control import down, up
    from deployments.cluster.hosts import Cluster

    if "cluster" not in _SESSION:
        cluster = Cluster(Path(f"/var/tmp/rlmill-chaos-cluster-{os.getpid()}"), prefix="rlmx", subnet="10.232.0")
        _SESSION["cluster"] = cluster
        atexit.register(down, cluster)
        up(cluster)
    return _SESSION["cluster"]


def _row(name: str, fault: str, stage: str | None, inject: Callable[..., str]) -> Outcome:
    """Run `name` across the cluster; `inject(cluster)` (the fault; returns what it did) once
    stage flow run `stage` is running."""
    from deployments.cluster import runs
    from deployments.cluster.hosts import ClusterError, preflight

    try:
        preflight()
    except ClusterError as exc:  # not root, not Linux: the row cannot run here, and says why
        return Outcome(fault, f"not run: {exc}", None, 0)
    cluster = _cluster()
    overrides = runs.run_overrides(cluster.addr("train0"), name, ITERATIONS, [])
    reference = runs.one_box_reference(cluster, overrides, ITERATIONS)
    flow_run = runs.trigger(cluster, overrides, ITERATIONS)
    before, did = {}, "no fault"
    if stage is not None:
        runs.stage_running(cluster, name, stage, RUN_TIMEOUT_S)
        with runs.s3_of(cluster):
            before = snapshot(layout(runs.ROOT, name))
        did = inject(cluster)
    state, took = runs.wait_final(cluster, flow_run, RUN_TIMEOUT_S)
    with runs.s3_of(cluster):
        report = audit(layout(runs.ROOT, name), before, ITERATIONS)
    ok = state == "Completed"
    weights = "-"
    if ok:
        gap = runs.weights_gap(cluster, name, ITERATIONS, reference)
        weights = "= reference" if gap == 0 else ("differ" if gap > runs.WEIGHTS_REL else f"within {gap:.0e}")
    tries = f"; {stage}: {', '.join(runs.stage_attempts(cluster, name, stage))}" if stage else ""
    return _result(fault, f"{did}; run {state} in {took:.0f} s ({len(before)} manifests committed before{tries})",
                   ok, report, weights)


def _kill_and_boot(host: str, down_s: float) -> Callable[..., str]:
    def inject(cluster) -> str:
        from deployments.cluster.control import host_env

        cluster.kill(host)  # SIGKILL of the host's PID 1: every process on it dies at once
        time.sleep(down_s)
        cluster.start(host, host_env(cluster))  # the machine comes back, as a node or pod would
        return f"{host} SIGKILLed, booted {down_s:.0f} s later"
    return inject


def _cut(host: str, seconds: float) -> Callable[..., str]:
    def inject(cluster) -> str:
        cluster.set_link(host, up=False)
        try:
            time.sleep(seconds)
        finally:
            cluster.set_link(host, up=True)
        return f"{host} off the network for {seconds:.0f} s"
    return inject


# name, fault (the table's first column), the stage flow run the fault waits for, the fault.
ROWS = (
    ("cluster-run", "none: a run across 5 hosts sharing no disk (2 nodes x 1 rank)", None, str),
    ("cluster-kill-train1", "train1 (rank group node 1) SIGKILLed during update 1", "update-0001",
     _kill_and_boot("train1", 5)),
    ("cluster-restart-api", "api host (Prefect server + PostgreSQL) SIGKILLed and rebooted during update 1",
     "update-0001", _kill_and_boot("api", 1)),
    ("cluster-cut-rollout", "rollout host off the network for 30 s during rollout 1", "rollout-0001",
     _cut("rollout", 30)),
    ("cluster-cut-s3", "s3 host off the network for 30 s during update 1 (its checkpoint upload)", "update-0001",
     _cut("s3", 30)),
    ("cluster-restart-s3", "s3 host SIGKILLed during update 1 and rebooted 5 s later (its objects kept on its disk)",
     "update-0001", _kill_and_boot("s3", 5)),
)


def _register(name: str, fault: str, stage: str | None, inject: Callable[..., str]) -> None:
    scenario(name, fault)(lambda chaos: _row(name, fault, stage, inject))


for _args in ROWS:
    _register(*_args)

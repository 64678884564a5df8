"""A cluster on one machine: five hosts that share nothing but the network (deployments/cluster).

    python -m deployments.cluster up          # boot api, s3, rollout, train0, train1; deploy; upload the model
    python -m deployments.cluster run         # an rl-training/manual run across them; verify it (--compare: and
                                              # compare its weights with the same run on one box)
    python -m deployments.cluster status      # each host, its address, what it runs, whether it is up
    python -m deployments.cluster kill HOST   # SIGKILL every process of HOST (boot it: restart HOST)
    python -m deployments.cluster restart HOST
    python -m deployments.cluster cut HOST SECONDS   # HOST off the network for SECONDS
    python -m deployments.cluster logs HOST   # the tail of each service log on HOST's disk
    python -m deployments.cluster down        # stop every host, remove the network and the hosts' disks

`make cluster` is `up` then `run --compare`; `make cluster-down` is `down`. Runs as root
(namespaces and mounts). The operator (this shell) reaches the hosts on the bridge: the UI is at
http://10.231.0.10:4200, the S3 endpoint at http://10.231.0.11:5000.
"""

from __future__ import annotations

import argparse
import sys
import time

from deployments.cluster.hosts import HOSTS, Cluster, ClusterError
from deployments.cluster.control import STATE, down, host_env, logs, status, up


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.cluster", description=__doc__.split("\n")[0])
    p.add_argument("--state", default=STATE, help="the hosts' disks and PID files (default $RLMILL_CLUSTER_DIR or "
                                                  "/var/tmp/rlmill-cluster; not under /tmp)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up")
    r = sub.add_parser("run")
    r.add_argument("--run-id", default=f"cluster-{time.strftime('%Y%m%d-%H%M%S')}")
    r.add_argument("--iterations", type=int, default=2)
    r.add_argument("--timeout", type=float, default=1200.0)
    r.add_argument("--compare", action="store_true",
                   help="also train the same config on this machine alone (2 ranks, one node) and compare weights")
    r.add_argument("overrides", nargs="*", help="more config overrides (key=value)")
    sub.add_parser("status")
    d = sub.add_parser("down")
    d.add_argument("--keep-disks", action="store_true")
    for name in ("kill", "restart", "logs"):
        sub.add_parser(name).add_argument("host", choices=list(HOSTS))
    c = sub.add_parser("cut")
    c.add_argument("host", choices=list(HOSTS))
    c.add_argument("seconds", type=float)
    args = p.parse_args(argv)
    try:
        cluster = Cluster(args.state)
        if args.cmd == "up":
            up(cluster)
        elif args.cmd == "down":
            down(cluster, args.keep_disks)
        elif args.cmd == "status":
            return status(cluster)
        elif args.cmd == "logs":
            logs(cluster, args.host)
        elif args.cmd == "kill":
            cluster.kill(args.host)
        elif args.cmd == "restart":
            cluster.kill(args.host)
            cluster.start(args.host, host_env(cluster))
        elif args.cmd == "cut":
            cluster.set_link(args.host, up=False)
            try:
                time.sleep(args.seconds)
            finally:
                cluster.set_link(args.host, up=True)
        elif args.cmd == "run":
            from deployments.cluster.runs import cluster_run

            return cluster_run(cluster, args.run_id, args.iterations, args.overrides, args.timeout,
                               compare=args.compare)
    except ClusterError as exc:
        print(f"rlmill cluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

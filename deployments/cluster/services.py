"""What each host of the cluster runs, and the supervisor that runs it as the host's PID 1.

    python -m deployments.cluster.services HOST     # inside the host (deployments.cluster.hosts starts it)

The supervisor starts the host's services, restarts one that exits (after a pause that grows to
10 s while it keeps failing, as systemd's Restart=always would), reaps every orphan of the host,
and on SIGTERM stops them all. Each service logs to /tmp/logs/<service>.log on the host's own disk.
Everything a service needs comes from the environment the operator booted the host with
(deployments.cluster.__main__.host_env) and from the image (the code and the virtual environment).
"""

from __future__ import annotations

import os
import signal
import sys
import time

API_PORT, S3_PORT, RANK_PORT = 4200, 5000, 29400
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def address(host: str, env: dict[str, str]) -> str:
    from deployments.cluster.hosts import HOSTS

    return f"{env['RLMILL_CLUSTER_SUBNET']}.{HOSTS[host].octet}"


# Prefect and S3 listen on their host's cluster address only (not 0.0.0.0): what reaches them is
# the cluster's own bridge, never another interface the machine might give the namespace later.
def _server(env: dict[str, str]) -> dict[str, list[str]]:
    env.update({"RLMILL_SERVER_HOST": address("api", env), "PORT": str(API_PORT), "RLMILL_PREFECT_DB": "postgres",
                "RLMILL_PG_DIR": "/tmp/postgres", "PREFECT_UI_API_URL": env["PREFECT_API_URL"]})
    env.pop("PREFECT_API_URL")  # the server's own CLI must not call itself before it listens
    return {"prefect-server": ["bash", "scripts/prefect_local.sh", "server"]}


def _s3(env: dict[str, str]) -> dict[str, list[str]]:
    # moto with a journal on the host's disk (deployments/cluster/s3_store.py): a rebooted s3 host
    # serves what it had stored, as a persistent S3 would.
    return {"s3": [sys.executable, "-m", "deployments.cluster.s3_store", "--host", address("s3", env), "--port", str(S3_PORT),
                   "--journal", "/tmp/s3/journal.jsonl"]}


def _worker(pool: str):
    def services(env: dict[str, str]) -> dict[str, list[str]]:
        env["RLMILL_WORK_POOL"] = pool
        return {f"worker-{pool}": ["bash", "scripts/prefect_local.sh", "worker"]}
    return services


def _node1(env: dict[str, str]) -> dict[str, list[str]]:
    # The documented join command (docs/guide/ranks.md), once per rank group: with placement
    # remote every update is a run of its own that starts a new group, so node 1 joins again
    # whenever a group ends (the supervisor restarts the command).
    return {"node1": [sys.executable, "-m", "gpu_jobs.train.ranks.launch", "--nnodes", "2", "--node-rank", "1",
                      "--nproc-per-node", "1", "--master-addr", address("train0", env), "--master-port",
                      str(RANK_PORT), "--workdir", "/tmp/node1"]}


SERVICES = {"api": _server, "s3": _s3, "rollout": _worker("rollout"), "train0": _worker("update"), "train1": _node1}


class Supervisor:
    """Run `services` (name -> argv) with `env`, each restarted when it exits, until SIGTERM."""

    def __init__(self, services: dict[str, list[str]], env: dict[str, str], logs: str = "/tmp/logs"):
        self.services, self.env, self.logs = services, env, logs
        self.pids: dict[int, str] = {}
        self.failures = dict.fromkeys(services, 0)
        self.stopping = False
        os.makedirs(logs, exist_ok=True)

    def spawn(self, name: str) -> None:
        with open(os.path.join(self.logs, f"{name}.log"), "ab") as log:
            log.write(f"\n--- {time.strftime('%H:%M:%S')} start {' '.join(self.services[name])}\n".encode())
            log.flush()
            pid = os.fork()
            if pid == 0:  # the child: its own session, output to the log
                os.setsid()
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                os.chdir(REPO)
                try:
                    os.execvpe(self.services[name][0], self.services[name], self.env)
                finally:
                    os._exit(127)
        self.pids[pid] = name

    def stop(self, *_: object) -> None:
        self.stopping = True
        for pid in list(self.pids):
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        for name in self.services:
            self.spawn(name)
        restart_at: dict[str, float] = {}
        deadline = None
        while self.pids or (restart_at and not self.stopping):
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid:
                name = self.pids.pop(pid, None)  # None: an orphan this PID 1 reaped
                if name and not self.stopping:
                    self.failures[name] = 0 if os.waitstatus_to_exitcode(status) == 0 else self.failures[name] + 1
                    restart_at[name] = time.monotonic() + min(10.0, 1.0 * 2 ** self.failures[name] - 1)
                continue
            now = time.monotonic()
            for name, at in list(restart_at.items()):
                if at <= now and not self.stopping:
                    del restart_at[name]
                    self.spawn(name)
            if self.stopping:
                deadline = deadline or now + 20
                if now > deadline:  # a service that ignores SIGTERM
                    for p in list(self.pids):
                        try:
                            os.killpg(p, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            time.sleep(0.2)
        return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in SERVICES:
        print(f"usage: python -m deployments.cluster.services {{{','.join(SERVICES)}}}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    os.makedirs(env.get("HOME", "/tmp/home"), exist_ok=True)
    services = SERVICES[argv[0]](env)
    return Supervisor(services, env).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Separate hosts on one Linux machine: network namespaces on a bridge, each with its own mount and
PID namespace, sharing no writable folder.

A host is one process tree started as

    ip netns exec <ns> unshare --mount --pid --uts --fork --mount-proc --kill-child ... -- bash -c MOUNTS

whose first process (PID 1 of the host) sets up the host's file system and then runs the host's
supervisor (deployments.cluster.services). The host's file system is the machine's, with:

- `/` read-only: the code, the virtual environment and the Python installation are the host's
  image, the same on every host, and nothing can be handed over through them;
- `/tmp` its own disk (a folder of the cluster's state, `<state>/<host>/disk`, kept across a
  restart of the host like a real disk, removed by `down`); HOME, PREFECT_HOME and every cache
  live there;
- `/root/.cache` (the machine's model cache), `/dev/shm` and the cluster's state folder (the other
  hosts' disks) hidden under empty in-memory file systems.

So two hosts reach each other only over the network: the bridge `<prefix>0` and the addresses of
HOSTS below; the operator (this machine's own namespace) reaches every host on the bridge too.

Killing a host is SIGKILL of its PID 1: the kernel kills every process of its PID namespace. Cutting
a host off the network is taking its end of the veth pair down.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    octet: int  # the host's address is <subnet>.<octet>
    runs: str  # what it runs, for `status` and the docs


HOSTS = {h.name: h for h in (
    Host("api", 10, "PostgreSQL and the Prefect server (API + UI) on it, port 4200"),
    Host("s3", 11, "the S3 server (moto, its objects journaled to its disk: cluster/s3_store.py), port 5000"),
    Host("rollout", 12, "a Prefect process worker on pool `rollout` (rl-stage/rollout: rollout, validation)"),
    Host("train0", 13, "a Prefect process worker on pool `update` (rl-training flow runs, rl-stage/gpu: the "
                       "update, node 0 of its rank group)"),
    Host("train1", 14, "node 1 of every update's rank group: the join command, run again after each group"),
)}

_MOUNTS = r"""
set -eu
state="$1"; host="$2"; n="$3"; shift 3
image=(); for _ in $(seq "$n"); do image+=("$1"); shift; done
disk="$state/$host/disk"; stage="$state/$host/image"
i=0; for p in "${image[@]}"; do     # the image's folders, still reachable once their parents are hidden
  mkdir -p "$stage/$i"; mount --bind "$p" "$stage/$i"; i=$((i+1)); done
for d in /root/.cache /dev/shm; do [ -d "$d" ] && mount -t tmpfs -o size=4g tmpfs "$d"; done
mount --bind "$disk" /tmp
i=0; for p in "${image[@]}"; do     # back in place, read-only (a checkout under /tmp: on the host's disk)
  mkdir -p "$p"; mount --bind "$stage/$i" "$p"; mount -o remount,bind,ro "$p"; i=$((i+1)); done
mount -t tmpfs -o size=1m tmpfs "$state"      # the other hosts' disks
mount -o remount,bind,ro /                    # the rest of the machine: the same on every host, read-only
hostname "$host"
exec "$@"
"""


def image_paths() -> list[str]:
    """The folders every host gets read-only as its image: the checkout and the environment its
    .venv builds on (scripts/ensure_venv.sh keeps the shared one under ~/.cache/rlmill/venvs, which
    hosts otherwise do not see)."""
    paths = [str(REPO)]
    for pth in (REPO / ".venv").glob("lib/python*/site-packages/*.pth"):
        for line in pth.read_text().splitlines():
            site = Path(line.strip())
            if line.startswith("/") and site.is_dir() and REPO not in site.parents:
                venv = next((p for p in site.parents if (p / "pyvenv.cfg").exists()), site)
                paths.append(str(venv))
    return list(dict.fromkeys(paths))


class ClusterError(RuntimeError):
    """A cluster operation that cannot be done; the message says why and what to do."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode:
        raise ClusterError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done


def preflight() -> None:
    """Refuse early where hosts cannot be made: not Linux, not root, a tool missing."""
    if not sys.platform.startswith("linux"):
        raise ClusterError("a cluster on one machine needs Linux network and mount namespaces")
    if os.geteuid() != 0:
        raise ClusterError("making network namespaces and mounts needs root: run it as root (sudo make cluster)")
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            raise ClusterError(f"`{tool}` is not installed: apt-get install iproute2 util-linux")


class Cluster:
    """The hosts of one cluster: names are prefixed with `prefix` (netns `<prefix>-<host>`, bridge
    `<prefix>0`), addresses are `<subnet>.<octet>`, each host's disk is under `state`."""

    def __init__(self, state: str | os.PathLike, prefix: str = "rlmc", subnet: str = "10.231.0"):
        self.state, self.prefix, self.subnet = Path(state).resolve(), prefix, subnet
        if self.state == Path("/tmp") or Path("/tmp") in self.state.parents:
            raise ClusterError(f"the cluster's state {self.state} is under /tmp, which every host replaces by its "
                               f"own disk: give a folder outside /tmp (e.g. /var/tmp/rlmill-cluster)")
        if len(f"{prefix}-rollout") > 15:
            raise ClusterError(f"prefix {prefix!r} is too long: interface names hold 15 characters")

    # names and addresses
    def addr(self, host: str) -> str:
        return f"{self.subnet}.{HOSTS[host].octet}"

    def netns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}0"

    def disk(self, host: str) -> Path:
        return self.state / host / "disk"

    def _pidfile(self, host: str) -> Path:
        return self.state / host / "pid"

    # the network
    def make_network(self) -> None:
        """The bridge (the operator's address is <subnet>.1) and one namespace per host, wired to it."""
        if _run("ip", "link", "show", self.bridge, check=False).returncode:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for host in HOSTS:
            ns = self.netns(host)
            if _run("ip", "netns", "exec", ns, "true", check=False).returncode == 0:
                continue
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", ns, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", ns, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def remove_network(self) -> None:
        for host in HOSTS:
            _run("ip", "link", "del", self.netns(host), check=False)
            _run("ip", "netns", "del", self.netns(host), check=False)
        _run("ip", "link", "del", self.bridge, check=False)

    def set_link(self, host: str, up: bool) -> None:
        """Connect (up) or cut off (down) `host` from the network: its end of the veth pair on the bridge."""
        _run("ip", "link", "set", self.netns(host), "up" if up else "down")

    # hosts
    def start(self, host: str, env: dict[str, str]) -> int:
        """Boot `host` (its disk kept from a previous boot); returns the PID of its launcher here."""
        if self.pid(host):
            raise ClusterError(f"host {host} is running already")
        self.disk(host).mkdir(parents=True, exist_ok=True)
        self.disk(host).chmod(0o1777)  # the host's /tmp
        image = image_paths()
        log = open(self.state / host / "boot.log", "ab")
        argv = ["ip", "netns", "exec", self.netns(host), "unshare", "--mount", "--pid", "--uts", "--fork", "--mount-proc",
                "--kill-child", "--propagation", "private", "--", "bash", "-c", _MOUNTS, "mounts",
                str(self.state), host, str(len(image)), *image, sys.executable, "-m", "deployments.cluster.services", host]
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self._pidfile(host).write_text(str(proc.pid))
        return proc.pid

    def pid(self, host: str) -> int | None:
        """The launcher's PID of a running host (a process in the host's network namespace), else None."""
        try:
            pid = int(self._pidfile(host).read_text())
            return pid if os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{self.netns(host)}").st_ino \
                else None
        except (OSError, ValueError):
            return None

    def init_pid(self, host: str) -> int | None:
        """PID (as this machine sees it) of the host's PID 1, the child of its launcher."""
        pid = self.pid(host)
        if pid is None:
            return None
        for task in Path(f"/proc/{pid}/task").iterdir():
            children = (task / "children").read_text().split()
            if children:
                return int(children[0])
        return None

    def kill(self, host: str, sig: int = signal.SIGKILL, wait_s: float = 30.0) -> None:
        """Stop `host`: `sig` to its PID 1 (SIGKILL: every process of the host dies at once;
        SIGTERM: its supervisor stops its services first), SIGKILL after `wait_s`."""
        launcher = self.pid(host)
        if launcher is None:
            return
        init = self.init_pid(host)
        os.kill(init or launcher, sig)
        deadline = time.monotonic() + wait_s
        while self.pid(host) and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.pid(host):
            os.kill(launcher, signal.SIGKILL)  # --kill-child: its PID 1 and with it the whole host
            while self.pid(host):
                time.sleep(0.2)

    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        """`argv` run inside a running host (its network, mounts and processes)."""
        init = self.init_pid(host)
        if init is None:
            raise ClusterError(f"host {host} is not running: `python -m deployments.cluster up` boots it")
        return ["nsenter", f"--target={init}", "--net", "--mount", "--pid", "--", *argv]

    def remove_state(self) -> None:
        if self.state.exists():
            shutil.rmtree(self.state)

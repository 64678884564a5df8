"""Prefect's Docker work pool on this machine: podman's Docker-compatible API, a `docker` pool, and
the rl-training/docker deployment that runs each flow run in its own container of rlmill's image.

    python -m deployments.docker_pool up       # podman's API service, the pool, rl-training/docker
    python -m deployments.docker_pool worker   # a Prefect docker worker polling the pool (foreground)
    python -m deployments.docker_pool status   # the service, its socket, the image
    python -m deployments.docker_pool down     # stop the API service (images and runs stay)

`make docker-pool` is `up`, `make docker-worker` is `worker`. The image is `make image`'s
(localhost/rlmill:<version>); a team with a registry and Docker sets RLMILL_IMAGE and skips the
podman service (docs/guide/docker-pool.md). Needs a Prefect server (`make server`) at
PREFECT_API_URL and, for the service, root and podman (`apt-get install -y podman runc`).

Settings (environment): RLMILL_DOCKER_POOL (docker), RLMILL_IMAGE (localhost/rlmill:<version>),
RLMILL_PODMAN_DIR (.rlmill/podman: the service's socket, PID file, log and containers.conf).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREFECT_FILE = REPO / "deployments" / "docker.yaml"
SERVICE_WAIT_S = 30.0


class DockerPoolError(RuntimeError):
    """A setup problem, said in one line with its fix."""


def default_image() -> str:
    """RLMILL_IMAGE, else `make image`'s tag for the installed rlmill."""
    return os.environ.get("RLMILL_IMAGE") or f"localhost/rlmill:{metadata.version('rlmill')}"


@dataclass(frozen=True)
class DockerPool:
    """Where the service keeps its files, the pool's name and the image its containers run."""

    state: Path = field(default_factory=lambda: Path(os.environ.get("RLMILL_PODMAN_DIR") or REPO / ".rlmill" / "podman"))
    pool: str = field(default_factory=lambda: os.environ.get("RLMILL_DOCKER_POOL") or "docker")
    image: str = field(default_factory=default_image)

    @property
    def socket(self) -> Path:
        return self.state / "podman.sock"

    @property
    def docker_host(self) -> str:
        """What DOCKER_HOST is for the worker (and the `docker` CLI): the service's socket."""
        return f"unix://{self.socket}"

    @property
    def pid_file(self) -> Path:
        return self.state / "service.pid"


def containers_conf(nofile: int, runtime: str | None) -> str:
    """podman's containers.conf for the containers the API creates: what a nested sandbox needs
    (docs/guide/image.md), as scripts/image/run.sh passes it on the command line. The Docker API has
    no per-call runtime, and Prefect's worker asks for no ulimits, so both are the service's defaults:
    podman would raise the open-files limit to 1048576, above what a process without
    CAP_SYS_RESOURCE may set ("setrlimit RLIMIT_NOFILE: Operation not permitted"); crun 1.8 refuses
    a hybrid cgroup mount where runc works."""
    lines = ["[containers]", f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc=4096:4096"]']
    if runtime:
        lines += ["", "[engine]", f'runtime = "{runtime}"']
    return "\n".join(lines) + "\n"


def service_pid(pool: DockerPool) -> int | None:
    """The running service's PID from its PID file, None when it is not running."""
    try:
        pid = int(pool.pid_file.read_text())
        with contextlib.suppress(ChildProcessError):  # started by this process (a test): reap it once it exits
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return None
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def ping(pool: DockerPool) -> str | None:
    """The Docker API version the socket answers with, None when nothing answers."""
    import docker

    try:
        client = docker.DockerClient(base_url=pool.docker_host, timeout=5)
        try:
            return client.version().get("ApiVersion") if client.ping() else None
        finally:
            client.close()
    except Exception:  # no socket, refused, a half-started service: not answering
        return None


def start_service(pool: DockerPool) -> int:
    """`podman system service` on the pool's socket, in its own session (it outlives this command;
    `down` stops it); returns its PID once the socket answers the Docker API."""
    if (pid := service_pid(pool)) is not None and ping(pool):
        return pid
    if shutil.which("podman") is None:
        raise DockerPoolError("podman is not installed: apt-get install -y podman runc (or point DOCKER_HOST at "
                              "a Docker daemon and skip the service: docs/guide/docker-pool.md)")
    if os.geteuid() != 0:
        raise DockerPoolError("the podman service is started as root here (rootless podman needs subuid ranges): "
                              "run as root, or point DOCKER_HOST at a Docker daemon")
    pool.state.mkdir(parents=True, exist_ok=True)
    pool.socket.unlink(missing_ok=True)
    conf = pool.state / "containers.conf"
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = 1048576 if hard == resource.RLIM_INFINITY else hard  # podman's own default where nothing caps it
    conf.write_text(containers_conf(nofile, "runc" if shutil.which("runc") else None))
    with open(pool.state / "service.log", "ab") as log:
        proc = subprocess.Popen(["podman", "system", "service", "--time=0", pool.docker_host],
                                env={**os.environ, "CONTAINERS_CONF": str(conf)}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    pool.pid_file.write_text(str(proc.pid))
    deadline = time.monotonic() + SERVICE_WAIT_S
    while not ping(pool):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_service(pool)
            tail = (pool.state / "service.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise DockerPoolError(f"podman system service did not answer on {pool.socket} within {SERVICE_WAIT_S:.0f} s: "
                                  + (" | ".join(tail) or "no output"))
        time.sleep(0.3)
    return proc.pid


def stop_service(pool: DockerPool, grace: float = 10.0) -> bool:
    """Stop the service (SIGTERM, SIGKILL after `grace`); True when one was running."""
    pid = service_pid(pool)
    if pid is None:
        pool.pid_file.unlink(missing_ok=True)
        return False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while service_pid(pool) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        if service_pid(pool) is not None:
            os.killpg(pid, signal.SIGKILL)
    pool.pid_file.unlink(missing_ok=True)
    pool.socket.unlink(missing_ok=True)
    return True


def image_present(pool: DockerPool) -> bool:
    import docker

    client = docker.DockerClient(base_url=pool.docker_host, timeout=30)
    try:
        client.images.get(pool.image)
        return True
    except docker.errors.ImageNotFound:
        return False
    finally:
        client.close()


def prefect_env(pool: DockerPool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of `prefect` commands for this pool: `base` (default this process's) with the
    repo's venv first, the deploy file's settings, and DOCKER_HOST at the service unless one is set."""
    base = dict(os.environ if base is None else base)
    env = {**base, "RLMILL_DOCKER_POOL": pool.pool, "RLMILL_IMAGE": pool.image,
           "PATH": f"{REPO / '.venv' / 'bin'}:{base.get('PATH', '')}"}
    env.setdefault("DOCKER_HOST", pool.docker_host)
    return env


def _prefect(pool: DockerPool, *args: str, base: dict[str, str] | None = None, timeout: float = 300.0) -> str:
    done = subprocess.run(["prefect", *args], cwd=REPO, env=prefect_env(pool, base), capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode:
        raise DockerPoolError(f"prefect {' '.join(args[:3])} failed: {(done.stdout + done.stderr).strip()[-800:]}")
    return done.stdout


def need_api(base: dict[str, str] | None = None) -> None:
    if not (os.environ if base is None else base).get("PREFECT_API_URL"):
        raise DockerPoolError("PREFECT_API_URL is not set: start a server (make server) and export "
                              "PREFECT_API_URL=http://127.0.0.1:4200/api")


def deploy(pool: DockerPool, base: dict[str, str] | None = None) -> None:
    """The `docker` work pool (if missing) and rl-training/docker on it (deployments/docker.yaml),
    on the server `base`'s (default this process's) PREFECT_API_URL names."""
    need_api(base)
    try:
        _prefect(pool, "work-pool", "inspect", pool.pool, base=base)
    except DockerPoolError:  # missing: its base job template comes from prefect-docker's worker
        _prefect(pool, "work-pool", "create", pool.pool, "--type", "docker", base=base)
    _prefect(pool, "--no-prompt", "deploy", "--all", "--prefect-file", str(PREFECT_FILE.relative_to(REPO)), base=base)


def up(pool: DockerPool) -> None:
    need_api()  # before the service starts: nothing to undo
    if "DOCKER_HOST" not in os.environ:
        pid = start_service(pool)
        print(f"podman API service (PID {pid}) on {pool.docker_host}")
        if not image_present(pool):
            raise DockerPoolError(f"no image {pool.image} in podman's storage: build it with make image "
                                  "(or set RLMILL_IMAGE to one the worker can pull)")
    deploy(pool)
    print(f"work pool {pool.pool!r} (type docker) and deployment rl-training/docker (image {pool.image})\n"
          f"start a worker: DOCKER_HOST={prefect_env(pool)['DOCKER_HOST']} prefect worker start --pool {pool.pool} --type docker\n"
          f"           (or: make docker-worker)\n"
          f"run:  prefect deployment run 'rl-training/docker' -p iterations=2 --watch")


def worker_argv(pool: DockerPool) -> list[str]:
    return ["prefect", "worker", "start", "--pool", pool.pool, "--type", "docker"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.docker_pool", description=__doc__.split("\n")[0])
    p.add_argument("cmd", choices=["up", "worker", "status", "down"])
    args = p.parse_args(argv)
    pool = DockerPool()
    try:
        if args.cmd == "up":
            up(pool)
        elif args.cmd == "worker":
            env = prefect_env(pool)
            if "DOCKER_HOST" not in os.environ and ping(pool) is None:
                raise DockerPoolError(f"nothing answers on {pool.docker_host}: run make docker-pool first")
            os.execvpe("prefect", worker_argv(pool), env)
        elif args.cmd == "status":
            version = ping(pool)
            print(f"service   {'up, Docker API ' + version if version else 'down'} ({pool.docker_host})")
            if version:
                print(f"image     {pool.image}: {'present' if image_present(pool) else 'missing (make image)'}")
            return 0 if version else 1
        else:
            print("stopped the podman API service" if stop_service(pool) else "no podman API service was running")
    except DockerPoolError as exc:
        print(f"rlmill: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The operator's side of the cluster (this machine's own namespace, like an engineer's shell):
boot and stop the hosts, deploy to the cluster's Prefect, put the model in its S3, show status and
logs. The commands are in deployments/cluster/__main__.py."""


from __future__ import annotations

import os
import signal
import time
import urllib.request

from deployments.cluster.hosts import HOSTS, REPO, Cluster, ClusterError, preflight
from deployments.cluster.services import API_PORT, S3_PORT

STATE = os.environ.get("RLMILL_CLUSTER_DIR", "/var/tmp/rlmill-cluster")
BUCKET = "rlmill"
MODEL_URL = f"s3://{BUCKET}/models/builtin"
KEY = SECRET = "cluster"  # the S3 server's credentials (moto takes any)
BOOT_TIMEOUT_S = 300.0


def api_url(cluster: Cluster) -> str:
    return f"http://{cluster.addr('api')}:{API_PORT}/api"


def s3_endpoint(cluster: Cluster) -> str:
    return f"http://{cluster.addr('s3')}:{S3_PORT}"


def s3_env(endpoint: str) -> dict[str, str]:
    """The AWS_* variables that point a process at the S3 server at `endpoint` (credentials never go
    into a run's config)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1"}


def host_env(cluster: Cluster) -> dict[str, str]:
    """The environment every host boots with: where the API and S3 are, the image's tools first,
    every writable place on the host's own disk (/tmp)."""
    return {
        "PATH": f"{REPO / '.venv' / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/tmp/home", "PREFECT_HOME": "/tmp/prefect", "MPLCONFIGDIR": "/tmp/home/.config/matplotlib",
        "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false", "RLMILL_CLUSTER_SUBNET": cluster.subnet,
        "PREFECT_API_URL": api_url(cluster), "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "GX_ANALYTICS_ENABLED": "false",
        "RLMILL_NIGHTLY_TZ": "UTC",
        **s3_env(s3_endpoint(cluster)),
        # Each host's name resolves to 127.0.0.1 (the machine's /etc/hosts): gloo would advertise
        # that to the other node. Name the interface, as on any multi-node cluster with several.
        "GLOO_SOCKET_IFNAME": "eth0",
    }


def operator_env(cluster: Cluster) -> dict[str, str]:
    """This shell's environment pointed at the cluster (the CLI commands it runs: deploy, verify)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_"))}
    env.update({k: v for k, v in host_env(cluster).items() if k.startswith(("PREFECT_", "AWS_"))})
    env["PREFECT_HOME"] = str(cluster.state / "operator" / "prefect")
    os.makedirs(env["PREFECT_HOME"], exist_ok=True)
    env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '')}"
    return env


def wait_http(url: str, what: str, timeout: float, cluster: Cluster, host: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).read()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise ClusterError(f"{what} at {url} did not answer within {timeout:.0f} s ({exc}); its logs: "
                                   f"python -m deployments.cluster logs {host}") from None
            if cluster.pid(host) is None:
                raise ClusterError(f"host {host} stopped while booting; see {cluster.state / host / 'boot.log'}")
            time.sleep(1)


def _cli(cluster: Cluster, *argv: str, timeout: float = 600, **extra: str) -> str:
    import subprocess

    done = subprocess.run(argv, cwd=REPO, env={**operator_env(cluster), **extra}, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode:
        raise ClusterError(f"`{' '.join(argv)}` failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def deploy(cluster: Cluster) -> None:
    """Every deployment on pool `update`, rl-stage/rollout moved to pool `rollout` (as
    docs/guide/ranks.md's disaggregated placement does by hand)."""
    _cli(cluster, "bash", "scripts/prefect_local.sh", "deploy", RLMILL_WORK_POOL="update")
    if _cli_ok(cluster, "prefect", "work-pool", "inspect", "rollout") is False:
        _cli(cluster, "prefect", "work-pool", "create", "rollout", "--type", "process")
    _cli(cluster, "prefect", "--no-prompt", "deploy", "--name", "rl-stage/rollout", "--prefect-file",
         "deployments/prefect.yaml", RLMILL_WORK_POOL="rollout")


def _cli_ok(cluster: Cluster, *argv: str) -> bool:
    try:
        _cli(cluster, *argv, timeout=120)
        return True
    except ClusterError:
        return False


def upload_model(endpoint: str) -> str:
    """The built-in model, from this machine's cache, to the S3 at `endpoint` (bucket `rlmill`):
    the hosts' caches are empty, so every host loads it from storage."""
    import boto3

    from gpu_jobs.models import load_model
    from storage import StorageConfig, committed, save_checkpoint

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY,
                          aws_secret_access_key=SECRET, region_name="us-east-1")
    if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=BUCKET)
    storage = StorageConfig(endpoint_url=endpoint, key=KEY, secret=SECRET)
    if not committed(MODEL_URL, storage, name="model.safetensors.index.json"):
        model, tokenizer = load_model("builtin")
        save_checkpoint(MODEL_URL, model.state_dict(), config=model.config, tokenizer=tokenizer, storage=storage)
    return MODEL_URL


def up(cluster: Cluster, timeout: float = BOOT_TIMEOUT_S) -> None:
    preflight()
    cluster.make_network()
    env = host_env(cluster)
    for host in HOSTS:
        if cluster.pid(host) is None:
            cluster.start(host, env)
    wait_http(s3_endpoint(cluster), "the S3 server", timeout, cluster, "s3")
    wait_http(api_url(cluster) + "/health", "the Prefect API", timeout, cluster, "api")
    deploy(cluster)
    upload_model(s3_endpoint(cluster))
    print(f"rlmill cluster up: UI http://{cluster.addr('api')}:{API_PORT}, S3 {s3_endpoint(cluster)}")
    status(cluster)


def down(cluster: Cluster, keep_disks: bool = False) -> None:
    for host in reversed(list(HOSTS)):
        cluster.kill(host, signal.SIGTERM, wait_s=25)
    cluster.remove_network()
    if not keep_disks:
        cluster.remove_state()
    print("rlmill cluster down: no host, namespace or bridge left" + ("" if keep_disks else ", disks removed"))


def status(cluster: Cluster) -> int:
    down_hosts = 0
    for name, host in HOSTS.items():
        up_ = cluster.pid(name) is not None
        down_hosts += not up_
        print(f"  {name:8} {cluster.addr(name):13} {'up  ' if up_ else 'down'}  {host.runs}")
    return 1 if down_hosts else 0


def logs(cluster: Cluster, host: str, lines: int = 30) -> None:
    folder = cluster.disk(host) / "logs"
    for log in sorted(folder.glob("*.log")) if folder.exists() else []:
        print(f"==> {host}:/tmp/logs/{log.name} <==")
        print("\n".join(log.read_text(errors="replace").splitlines()[-lines:]))



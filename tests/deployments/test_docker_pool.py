"""Prefect's Docker work pool (deployments/docker_pool.py): rl-training/docker deployed to a `docker`
pool, a prefect-docker worker starting each flow run as a container of rlmill's image through
podman's Docker API, the run Completed with its iterations committed to S3 and verified from the
host, and a container killed mid-run
makes its flow run Crashed. Skipped, saying why, without root, podman or the image
(make image: ~8 min and 10 GB, so a bare CI machine skips it, as tests/test_image.py does).
~2-3 minutes once the image is built.

    .venv/bin/python -m pytest -q tests/deployments/test_docker_pool.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest

from deployments.docker_pool import (DockerPool, DockerPoolError, containers_conf, default_image, deploy, image_present,
                                     prefect_env, start_service, stop_service, worker_argv)

RUN_TIMEOUT_S = 900
POOL = "rlmill-test-docker"


def test_containers_conf_keeps_the_hard_open_files_limit_and_names_the_runtime():
    conf = containers_conf(20000, "runc")
    assert 'default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]' in conf
    assert '[engine]\nruntime = "runc"' in conf
    assert "[engine]" not in containers_conf(1024, None)  # no runc: podman's own default runtime


def test_deploy_without_a_server_says_how_to_start_one(tmp_path):
    with pytest.raises(DockerPoolError, match="PREFECT_API_URL is not set: start a server"):
        deploy(DockerPool(state=tmp_path), base={"PATH": os.environ["PATH"]})


def test_cli_mistakes_and_a_missing_service_end_in_one_line(tmp_path):
    env = {**os.environ, "RLMILL_PODMAN_DIR": str(tmp_path / "podman")}
    env.pop("DOCKER_HOST", None)
    env.pop("PREFECT_API_URL", None)
    for args, rc, says in ((["frobnicate"], 2, "invalid choice"), (["status"], 1, "service   down"),
                           (["up"], 2, "rlmill: PREFECT_API_URL is not set: start a server"),
                           (["worker"], 2, "rlmill: nothing answers on unix://"), (["down"], 0, "no podman API service")):
        done = subprocess.run([".venv/bin/python", "-m", "deployments.docker_pool", *args], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == rc, (args, done.stdout, done.stderr)
        assert says in done.stdout + done.stderr, (args, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the podman API service runs as root here"
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install -y podman runc)"
    return None


def _podman(*args: str) -> str:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
    """podman's Docker API service on a socket of its own, with rlmill's image present."""
    if reason := _skip_reason():
        pytest.skip(reason)
    pool = DockerPool(state=tmp_path_factory.mktemp("podman"), pool=POOL, image=default_image())
    start_service(pool)
    try:
        if not image_present(pool):
            pytest.skip(f"no image {pool.image}: build it with make image")
        yield pool
    finally:
        stop_service(pool)


@pytest.fixture(scope="module")
def docker_worker(podman, prefect_server, local_prefect, tmp_path_factory):
    """The docker pool and rl-training/docker deployed to the session's server, a docker worker polling it."""
    from tests.servers import stop_group

    deploy(podman, base=local_prefect.env)
    log = tmp_path_factory.mktemp("docker-worker") / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(worker_argv(podman), env=prefect_env(podman, local_prefect.env), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield log
    finally:
        stop_group(proc)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.prefect
def test_a_run_on_the_docker_pool_completes_in_a_container_and_verifies(podman, docker_worker, api, tools, s3_endpoint):
    from tests.conftest import make_bucket

    bucket = f"docker-{uuid.uuid4().hex[:8]}"
    make_bucket(s3_endpoint, bucket)
    root, run_id = f"s3://{bucket}/rl", "docker-pool"
    aws = {"AWS_ENDPOINT_URL": s3_endpoint["endpoint_url"], "AWS_ACCESS_KEY_ID": s3_endpoint["key"],
           "AWS_SECRET_ACCESS_KEY": s3_endpoint["secret"], "AWS_DEFAULT_REGION": "us-east-1"}
    flow_run_id = tools.trigger("rl-training/docker", {"iterations": 2, "overrides": [
        f"root={root}", f"run_id={run_id}", *tools.tiny, "tasks.auto_resumes=0"]},
        job_variables={"env": {**aws, "OMP_NUM_THREADS": "1"}})
    run = tools.wait_final(api, flow_run_id, RUN_TIMEOUT_S, docker_worker)
    worker_log = docker_worker.read_text(errors="replace")
    assert run.state.is_completed(), f"{run.state}\n{worker_log[-3000:]}"

    # It ran in a container of the image, through the pool's docker worker, and exited 0.
    assert run.work_pool_name == POOL
    assert (run.infrastructure_pid or "").startswith("http+docker://"), run.infrastructure_pid  # <docker url>:<container>
    container_id = run.infrastructure_pid.rsplit(":", 1)[1]
    assert "Creating Docker container" in worker_log, worker_log[-3000:]
    assert _podman("inspect", container_id, "--format", "{{.ImageName}}") == podman.image
    assert _podman("wait", container_id) == "0"  # its process ends a moment after it reports Completed
    _podman("rm", container_id)

    # Both iterations committed on S3, and the audit from this side of the container boundary is clean.
    from storage import RunLayout, StorageConfig, committed

    storage = StorageConfig(endpoint_url=s3_endpoint["endpoint_url"], key=s3_endpoint["key"], secret=s3_endpoint["secret"])
    layout = RunLayout(root, run_id)
    assert all(committed(layout.stage(k, "commit"), storage) for k in (1, 2))
    done = subprocess.run([".venv/bin/rlmill", "verify", "--config", "examples/grpo_arith.yaml", f"root={root}",
                           f"run_id={run_id}"], env={**os.environ, **aws}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "is intact" in done.stdout, done.stdout + done.stderr


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.prefect
def test_a_container_killed_mid_run_leaves_its_flow_run_crashed(podman, docker_worker, api, tools, tmp_path):
    """SIGKILL of the container (what an OOM kill does): the worker reads exit status 137 and the run
    ends Crashed, which the auto-resume automation (deployments/resume.py) acts on."""
    flow_run_id = tools.trigger("rl-training/docker", {"iterations": 50, "overrides": [
        "run_id=docker-killed", *tools.tiny, "tasks.auto_resumes=0"]})
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (run := api(lambda c: c.read_flow_run(flow_run_id))).state.is_running():
        assert time.monotonic() < deadline and not run.state.is_final(), run.state
        time.sleep(1)
    container_id = run.infrastructure_pid.rsplit(":", 1)[1]
    _podman("kill", "--signal", "KILL", container_id)
    run = tools.wait_final(api, flow_run_id, 120, docker_worker)
    assert run.state.is_crashed(), run.state
    assert "137" in (run.state.message or ""), run.state.message
    _podman("rm", container_id)

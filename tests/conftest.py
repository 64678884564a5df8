"""Shared pytest fixtures: a moto S3 server on loopback, fresh buckets, and `storage_root`,
which parametrises a test over local disk, memory:// and s3:// (moto).

Other test folders may use `s3_endpoint`, `s3_bucket_url`, `storage_config_s3` and
`storage_root` directly: pytest finds this root conftest for every test under tests/.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import pytest

# Telemetry off before any library that reads these is imported.
os.environ["GX_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"

try:  # 2 shared cores: one intra-op thread per test process keeps the machine usable
    import torch

    torch.set_num_threads(1)
except ImportError:  # torch-less environments can still run the storage tests that need no torch
    pass


def pytest_configure(config):
    """One Prefect API server for the whole pytest run, started here in the controlling process
    (with pytest-xdist its workers inherit PREFECT_API_URL), so that every `rlmill train` a test
    starts, and every flow a test runs in-process without a harness of its own, talks to it
    instead of starting an ephemeral server of its own (10-20 s each on 2 cores). A run that
    sets PREFECT_API_URL itself keeps it; RLMILL_TEST_EPHEMERAL_PREFECT=1 keeps ephemeral mode.
    The server starts while the tests are collected: each process that runs tests waits for it
    once collection is done (pytest_collection_finish), not before."""
    if (hasattr(config, "workerinput") or config.option.collectonly or os.environ.get("PREFECT_API_URL")
            or os.environ.get("RLMILL_TEST_EPHEMERAL_PREFECT")):
        return
    import tempfile

    from tests.servers import PrefectServer

    server = PrefectServer(tempfile.mkdtemp(prefix="rlmill-test-prefect-")).start(wait=False)
    os.environ["PREFECT_API_URL"] = server.api_url
    os.environ[_STARTING] = str(server.home / "server.log")  # xdist workers inherit it
    config._rlmill_prefect_server = server


_STARTING = "RLMILL_TEST_PREFECT_STARTING"  # the session server's log while it may still be starting


def pytest_collection_finish(session):
    """Wait for the session's Prefect server before the first test of this process."""
    log = os.environ.pop(_STARTING, None)
    if log is None or session.config.option.collectonly:
        return
    from pathlib import Path

    from tests.servers import wait_for_api

    server = getattr(session.config, "_rlmill_prefect_server", None)
    if server is not None:  # this process started it (no xdist)
        server.wait_healthy()
    else:
        wait_for_api(os.environ["PREFECT_API_URL"], Path(log), timeout=180.0)


def pytest_unconfigure(config):
    server = getattr(config, "_rlmill_prefect_server", None)
    if server is not None:
        import shutil

        server.stop()
        shutil.rmtree(server.home, ignore_errors=True)
        os.environ.pop("PREFECT_API_URL", None)


# The longest modules first (measured: minutes each, most of it one process at a time), then
# the other slow ones, then the rest: `make test` hands whole modules to its workers in this
# order (--no-loadscope-reorder), so no long module starts last and runs alone at the end.
LONGEST_FIRST = (
    "tests/test_examples.py",  # make e2e: ~330 s
    "tests/deployments/",  # make test: ~450 s (one scope); make e2e: two work pools, ~330 s
    "tests/test_readme_walkthrough.py",  # make e2e: ~320 s
    "tests/chaos/",  # make e2e: two classes, ~270 s and ~150 s
)


def pytest_collection_modifyitems(config, items):
    """Order modules for the workers (see LONGEST_FIRST); a module's own tests keep their order."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def rank(item) -> int:
        module = item.nodeid.split("::")[0]
        first = [i for i, prefix in enumerate(LONGEST_FIRST) if module.startswith(prefix)]
        return first[0] if first else len(LONGEST_FIRST) + (0 if module in slow else 1)

    items.sort(key=rank)  # stable


# Folders whose modules share one worker (one xdist scope): their session fixtures are costly, so
# a second worker running some of their modules would build them all again. tests/deployments:
# a Prefect server with the UI, `make deploy` and a process worker (35-110 s on 2 busy cores).
ONE_WORKER_FOLDERS = ("tests/deployments/",)


def pytest_xdist_make_scheduler(config, log):
    """--dist loadscope, with each ONE_WORKER_FOLDERS folder one scope (xdist's own scope is a
    module, or a class where a module has them)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FolderScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            folder = next((f for f in ONE_WORKER_FOLDERS if nodeid.startswith(f)), None)
            return folder or super()._split_scope(nodeid)

    return FolderScopes(config, log)


def _start_moto(extra_env=None):
    from tests.servers import moto_server_exe, start_moto_server

    if moto_server_exe() is None:
        pytest.skip("moto_server not installed (pip install 'moto[server]')")
    return start_moto_server(extra_env)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server for the whole session: {'endpoint_url', 'key', 'secret'}."""
    from tests.servers import MOTO_KEY, MOTO_SECRET, stop_process

    proc, endpoint = _start_moto()
    try:
        yield {"endpoint_url": endpoint, "key": MOTO_KEY, "secret": MOTO_SECRET}
    finally:
        stop_process(proc)


@pytest.fixture(scope="session")
def storage_config_s3(s3_endpoint):
    from storage import StorageConfig

    return StorageConfig(
        endpoint_url=s3_endpoint["endpoint_url"], key=s3_endpoint["key"], secret=s3_endpoint["secret"]
    )


def make_bucket(s3_endpoint: dict, name: str) -> None:
    import boto3

    client = boto3.client(
        "s3", endpoint_url=s3_endpoint["endpoint_url"], aws_access_key_id=s3_endpoint["key"],
        aws_secret_access_key=s3_endpoint["secret"], region_name="us-east-1",
    )
    client.create_bucket(Bucket=name)


@pytest.fixture
def s3_bucket_url(s3_endpoint) -> str:
    """A fresh, empty bucket on the session's moto server: 's3://bucket-<hex>'."""
    name = f"bucket-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, name)
    return f"s3://{name}"


@dataclass(frozen=True)
class StorageRoot:
    """A fresh storage root URL and the StorageConfig to reach it (None off S3)."""

    backend: str
    url: str
    storage: object = None


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def storage_root(request, tmp_path) -> StorageRoot:
    """One fresh root per test, on each backend in turn: local tmp dir, memory://, moto S3."""
    if request.param == "local":
        yield StorageRoot("local", str(tmp_path / "root"))
    elif request.param == "memory":
        prefix = f"memory://rlmill-test-{uuid.uuid4().hex[:12]}"
        yield StorageRoot("memory", prefix)
        import fsspec

        fs = fsspec.filesystem("memory")
        if fs.exists(prefix):
            fs.rm(prefix, recursive=True)
    else:
        url = request.getfixturevalue("s3_bucket_url")
        yield StorageRoot("s3", f"{url}/root", request.getfixturevalue("storage_config_s3"))


@pytest.fixture(scope="session")
def moto_server_factory():
    """Start extra moto servers (e.g. with auth on: {'INITIAL_NO_AUTH_ACTION_COUNT': '0'});
    each is stopped by PID at the end of the session. Returns start(extra_env) -> endpoint."""
    from tests.servers import stop_process

    procs = []

    def start(extra_env: dict[str, str] | None = None) -> str:
        proc, endpoint = _start_moto(extra_env)
        procs.append(proc)
        return endpoint

    yield start
    for proc in procs:
        stop_process(proc)

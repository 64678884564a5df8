"""Fixtures for tests/serve: a real redis-server on a free port, the built-in model loaded once,
and an rlmill server run by uvicorn on a free port in a thread."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time

import pytest

from tests.servers import free_port, stop_process


@contextlib.contextmanager
def redis_server(tmp_path):
    """A redis-server on 127.0.0.1:<free port>, no persistence; yields its URL; stopped by PID."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed: bash scripts/ensure_test_tools.sh installs it")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        import redis

        client, deadline = redis.Redis.from_url(url), time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {port} did not start") from None
                time.sleep(0.05)
        yield url
    finally:
        stop_process(proc)


@pytest.fixture
def redis_url(tmp_path):
    with redis_server(tmp_path) as url:
        yield url


@pytest.fixture(scope="module")
def served():
    import torch

    from gpu_jobs.online.model import load_served_model

    torch.set_num_threads(1)  # two cores shared with other test sessions
    model = load_served_model(None)
    yield model
    model.close()


@contextlib.contextmanager
def running(server):
    """The app of `server` under uvicorn on a free port, in a thread; yields its base URL."""
    import uvicorn

    from gpu_jobs.online.app import create_app

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(10)


@pytest.fixture
def run_app():
    """`with run_app(server) as base_url:` the server under uvicorn (see `running`)."""
    return running


class Capture:
    """An event publisher that keeps what it is given (serve's publisher, without a broker)."""

    def __init__(self):
        self.events: list[dict] = []

    async def publish_async(self, event: dict, wait_s: float) -> str:
        self.events.append(event)
        return "logged"

    def stats(self) -> dict:
        return {"queued": 0}

    def close(self, timeout_s: float = 5.0) -> None:
        pass

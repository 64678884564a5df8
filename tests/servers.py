"""Test servers for tests and benchmarks: a real S3 endpoint on loopback via `moto_server`.

    with MotoServer() as s3:
        cfg = s3.config()          # StorageConfig for it
        url = s3.new_bucket()      # 's3://bucket-<hex>'

Lives in tests/, not in the product packages; it needs `moto[server]` installed. Benchmarks import
it as `tests.servers` (they run as `python -m benchmarks...` from the repository root).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from storage import StorageConfig

__all__ = ["MotoServer", "free_port", "start_moto_server", "stop_process"]

MOTO_KEY = "rlmill-test-key"
MOTO_SECRET = "rlmill-test-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moto_server_exe() -> str | None:
    """The moto_server beside this interpreter (the venv's bin dir), else on PATH."""
    exe = Path(sys.executable).parent / "moto_server"
    return str(exe) if exe.exists() else shutil.which("moto_server")


def start_moto_server(extra_env: dict[str, str] | None = None, timeout: float = 30.0):
    """Start `moto_server -H 127.0.0.1 -p <free port>`; returns (Popen, endpoint_url) once it answers."""
    exe = moto_server_exe()
    if exe is None:
        raise FileNotFoundError("moto_server not found: pip install 'moto[server]'")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(extra_env or {})},
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).read()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process(proc)
                raise RuntimeError(f"moto_server did not answer on {endpoint} within {timeout}s") from None
            time.sleep(0.1)


def stop_process(proc: subprocess.Popen) -> None:
    """Stop a process we started, by its PID: SIGTERM, then SIGKILL after 5 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


class MotoServer:
    """A moto S3 server subprocess for the life of a `with` block.

    Example:
        >>> with MotoServer() as s3:  # doctest: +SKIP
        ...     url = s3.new_bucket()
    """

    def __init__(self, extra_env: dict[str, str] | None = None):
        self.extra_env = extra_env
        self.proc: subprocess.Popen | None = None
        self.endpoint_url = ""
        self.key, self.secret = MOTO_KEY, MOTO_SECRET

    def __enter__(self) -> "MotoServer":
        self.proc, self.endpoint_url = start_moto_server(self.extra_env)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def config(self) -> StorageConfig:
        return StorageConfig(endpoint_url=self.endpoint_url, key=self.key, secret=self.secret)

    def new_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh random name by default); returns its s3:// URL."""
        import boto3

        name = name or f"bucket-{uuid.uuid4().hex[:12]}"
        client = boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.key,
                              aws_secret_access_key=self.secret, region_name="us-east-1")
        client.create_bucket(Bucket=name)
        return f"s3://{name}"

"""Transient storage faults are waited out (exponential backoff, full jitter, one budget); faults
that cannot heal fail at once. The outage tests stop a real moto S3 server and start it again on
the same port while a write or read is under way."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import threading

import fsspec
import pyarrow as pa
import pytest

from storage import (
    CredentialsError,
    ManifestExistsError,
    NotCommittedError,
    StorageConfig,
    commit,
    read_manifest,
    read_table,
    url_to_fs,
    write_files,
    write_table,
)
from storage.errors import StorageUnavailableError
from storage.fs import create_only
from storage.retry import RetryPolicy, backoff_delays, is_transient


# ------------------------------------------------------------------------------ the schedule
def test_backoff_is_seeded_full_jitter_within_the_budget():
    policy = RetryPolicy(budget_s=300, max_delay_s=30, base_delay_s=0.5)
    a = list(backoff_delays(policy, random.Random(7)))
    assert a == list(backoff_delays(policy, random.Random(7)))  # seeded: reproducible
    assert a != list(backoff_delays(policy, random.Random(8)))  # jittered: not lockstep
    assert sum(a) == pytest.approx(300) and sum(a) <= 300 + 1e-9  # the budget, all of it, no more
    for n, d in enumerate(a):  # the n-th wait is uniform in [0, min(max, base * 2**n)]
        assert 0 <= d <= min(30, 0.5 * 2 ** n)
    assert max(a) > 15  # the cap is reached, not just the first doublings
    # Full jitter: over many seeds the n-th wait averages half its cap.
    firsts = [list(backoff_delays(policy, random.Random(s)))[:8] for s in range(400)]
    for n in range(8):
        mean = sum(f[n] for f in firsts) / len(firsts)
        assert mean == pytest.approx(min(30, 0.5 * 2 ** n) / 2, rel=0.15)


def test_backoff_budget_zero_means_no_retry_and_short_budgets_are_cut_to_fit():
    assert list(backoff_delays(RetryPolicy(budget_s=0))) == []
    d = list(backoff_delays(RetryPolicy(budget_s=1.0, max_delay_s=30, base_delay_s=0.5), random.Random(1)))
    assert sum(d) == pytest.approx(1.0) and all(x >= 0 for x in d)


def test_storage_config_budget_defaults_and_validation():
    cfg = StorageConfig()
    assert cfg.retry_budget_seconds == 300 and cfg.retry_max_delay_seconds == 30
    assert RetryPolicy.of(cfg) == RetryPolicy(300, 30)
    assert "5 minutes" in StorageConfig.model_fields["retry_budget_seconds"].description
    with pytest.raises(ValueError):
        StorageConfig(retry_budget_seconds=-1)
    with pytest.raises(ValueError):
        StorageConfig(retry_max_delay_seconds=0)


# ------------------------------------------------------------------------------ classification
def _client_error(code: str, status: int, op: str = "PutObject"):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, op)


def _translated(err):
    from s3fs.errors import translate_boto_error

    return translate_boto_error(err)


@pytest.mark.parametrize("code,status,transient", [
    ("SlowDown", 503, True), ("ServiceUnavailable", 503, True), ("InternalError", 500, True),
    ("BadGateway", 502, True), ("TooManyRequests", 429, True), ("RequestTimeout", 400, True),
    ("Throttling", 400, True),
    ("AccessDenied", 403, False), ("InvalidAccessKeyId", 403, False), ("SignatureDoesNotMatch", 403, False),
    ("NoSuchBucket", 404, False), ("NoSuchKey", 404, False), ("PreconditionFailed", 412, False),
    ("InvalidArgument", 400, False),
])
def test_http_errors_are_sorted_by_whether_they_heal(code, status, transient):
    err = _client_error(code, status)
    assert is_transient(err) is transient
    assert is_transient(_translated(err)) is transient  # as s3fs raises it (OSError with the cause)


def test_connection_faults_are_transient_and_final_errors_are_not():
    from botocore.exceptions import (ConnectionClosedError, EndpointConnectionError, NoCredentialsError,
                                     ReadTimeoutError)

    for err in (EndpointConnectionError(endpoint_url="http://x"), ConnectionClosedError(endpoint_url="http://x"),
                ReadTimeoutError(endpoint_url="http://x"), ConnectionRefusedError(), ConnectionResetError(),
                TimeoutError()):
        assert is_transient(err), err
    for err in (NoCredentialsError(), FileNotFoundError("k"), PermissionError("403"), FileExistsError("k"),
                CredentialsError("bad key"), StorageUnavailableError("gave up"), ValueError("bug")):
        assert not is_transient(err), err


# ------------------------------------------------------------------------------ a real outage
_CONTROLLED_MOTO = r"""
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
port = int(sys.argv[1])
server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
server.start()
print("up", flush=True)
for line in sys.stdin:
    if line.strip() == "stop":
        server.stop()
        print("down", flush=True)
    elif line.strip() == "start":
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        print("up", flush=True)
"""


class RestartableMoto:
    """A moto S3 server in a subprocess that can be stopped and started again on the same port,
    keeping its buckets and objects (its backend lives in the subprocess, not in the server)."""

    def __init__(self):
        from tests.servers import MOTO_KEY, MOTO_SECRET, free_port

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.key, self.secret = MOTO_KEY, MOTO_SECRET
        self.proc = subprocess.Popen([sys.executable, "-c", _CONTROLLED_MOTO, str(self.port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("up")

    def _expect(self, word: str) -> None:
        line = self.proc.stdout.readline().strip()
        if line != word:
            raise RuntimeError(f"controlled moto server said {line!r}, expected {word!r}")

    def _send(self, cmd: str, reply: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        self._expect(reply)

    def stop(self) -> None:
        self._send("stop", "down")

    def start(self) -> None:
        self._send("start", "up")

    def start_after(self, seconds: float) -> threading.Thread:
        """Start the server again `seconds` from now, from another thread."""
        t = threading.Timer(seconds, self.start)
        t.start()
        return t

    def config(self, **retry) -> StorageConfig:
        return StorageConfig(endpoint_url=self.endpoint, key=self.key, secret=self.secret, **retry)

    def new_bucket(self, name: str) -> str:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key,
                     aws_secret_access_key=self.secret, region_name="us-east-1").create_bucket(Bucket=name)
        return f"s3://{name}"

    def close(self) -> None:
        from tests.servers import stop_process

        if self.proc.stdin:
            self.proc.stdin.close()
        stop_process(self.proc)


@pytest.fixture
def moto():
    from tests.servers import moto_server_exe

    if moto_server_exe() is None:
        pytest.skip("moto[server] not installed")
    server = RestartableMoto()
    try:
        yield server
    finally:
        server.close()


def _retries_logged(caplog) -> tuple[int, int]:
    failed = sum("failed (" in r.getMessage() for r in caplog.records if r.name == "rlmill.storage")
    recovered = sum("answered again" in r.getMessage() for r in caplog.records if r.name == "rlmill.storage")
    return failed, recovered


@pytest.mark.s3
def test_a_commit_started_during_an_outage_completes_when_the_endpoint_returns(moto, caplog):
    caplog.set_level(logging.INFO, logger="rlmill.storage")
    cfg = moto.config()  # the default budget: 5 minutes
    root = moto.new_bucket("outage-write")
    before = write_table(f"{root}/before", pa.table({"x": [1, 2]}), storage=cfg)  # bucket checked, endpoint known
    moto.stop()
    restart = moto.start_after(3.0)
    try:
        # Both start while nothing listens on the port; neither may fail.
        uri = write_table(f"{root}/during", pa.table({"x": [1, 2, 3]}), storage=cfg, rows_per_shard=1)
        assert read_table(uri, storage=cfg).column("x").to_pylist() == [1, 2, 3]
        assert read_table(before, storage=cfg).num_rows == 2  # committed before the outage: intact
    finally:
        restart.join()
    failed, recovered = _retries_logged(caplog)
    assert failed >= 1 and recovered >= 1  # the outage was real and was waited out


@pytest.mark.s3
def test_a_read_started_during_an_outage_completes(moto, caplog):
    caplog.set_level(logging.INFO, logger="rlmill.storage")
    cfg = moto.config()
    root = moto.new_bucket("outage-read")
    files = write_files(f"{root}/c", {"a.bin": b"x" * 100}, cfg)
    uri = commit(f"{root}/c", files, kind="test", storage=cfg)
    moto.stop()
    restart = moto.start_after(3.0)
    try:
        m = read_manifest(uri, cfg)
        fs, _ = url_to_fs(uri, cfg)
        assert [f.path for f in m.files] == ["a.bin"]
        assert fs.ls(f"{root.removeprefix('s3://')}/c")  # listing too
    finally:
        restart.join()
    assert _retries_logged(caplog)[0] >= 1


@pytest.mark.s3
def test_an_outage_longer_than_the_budget_fails_with_storage_unavailable(moto, caplog):
    caplog.set_level(logging.INFO, logger="rlmill.storage")
    cfg = moto.config(retry_budget_seconds=2, retry_max_delay_seconds=1)
    root = moto.new_bucket("outage-budget")
    url_to_fs(root, cfg)  # the bucket check, while the endpoint answers
    moto.stop()
    with pytest.raises(StorageUnavailableError, match=r"retry_budget_seconds=2\b") as e:
        write_table(f"{root}/t", pa.table({"x": [1]}), storage=cfg)
    assert _retries_logged(caplog)[0] >= 1  # it waited the outage out, then gave up at the budget
    assert "\n" not in str(e.value) and cfg.secret.get_secret_value() not in str(e.value)


@pytest.mark.s3
def test_a_missing_object_fails_at_once_whatever_the_budget(moto, caplog):
    caplog.set_level(logging.INFO, logger="rlmill.storage")
    cfg = moto.config()  # 5 minutes for transient faults
    root = moto.new_bucket("missing-key")
    with pytest.raises(NotCommittedError):
        read_manifest(f"{root}/nothing-here", cfg)
    assert _retries_logged(caplog) == (0, 0)  # an answer, not a fault to wait out


@pytest.fixture(scope="module")
def auth_moto(moto_server_factory):
    """A moto server that checks credentials (no IAM user exists, so all keys are bad): 403."""
    return moto_server_factory({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})


@pytest.mark.s3
def test_403_fails_at_once_whatever_the_budget(auth_moto, caplog):
    caplog.set_level(logging.INFO, logger="rlmill.storage")
    cfg = StorageConfig(endpoint_url=auth_moto, key="AKIAWRONGWRONGWRONG", secret="S3CRETVALUE")
    assert cfg.retry_budget_seconds == 300
    with pytest.raises(CredentialsError, match="rejected the credentials"):
        url_to_fs("s3://some-bucket/x", cfg)
    unchecked = cfg.model_copy(update={"check_bucket": False})
    with pytest.raises(PermissionError):  # every request, not only the bucket check
        write_table("s3://some-bucket/t", pa.table({"x": [1]}), storage=unchecked)
    assert _retries_logged(caplog) == (0, 0)  # a refusal, not a fault to wait out


# ------------------------------------------------------------------------------ create-only
class _FlakyClient:
    """Patch one method of the filesystem's botocore client: `fail(n, real)` decides, per call n,
    whether to raise before the request, after it (the answer lost), or not at all."""

    def __init__(self, fs, method: str, fault):
        self.fs, self.method, self.fault, self.calls = fs, method, fault, 0

    def __enter__(self):
        s3 = fsspec.asyn.sync(self.fs.loop, self.fs.get_s3)
        real = getattr(s3, self.method)

        async def patched(**kwargs):
            self.calls += 1
            return await self.fault(self.calls, real, kwargs)

        patched.__name__ = self.method  # s3fs filters kwargs by the method's name
        setattr(s3, self.method, patched)
        self.s3 = s3
        return self

    def __exit__(self, *exc):
        delattr(self.s3, self.method)


def _answer_lost_once(exc_factory):
    async def fault(n, real, kwargs):
        out = await real(**kwargs)  # the PUT lands...
        if n == 1:
            raise exc_factory()  # ...and its answer is lost
        return out

    return fault


@pytest.mark.s3
def test_a_retried_create_that_finds_its_own_manifest_succeeds(s3_bucket_url, storage_config_s3):
    from botocore.exceptions import ConnectionClosedError

    cfg = storage_config_s3
    dest = f"{s3_bucket_url}/own"
    files = write_files(dest, {"a.bin": b"abc"}, cfg)
    fs, _ = url_to_fs(dest, cfg)
    with _FlakyClient(fs, "put_object", _answer_lost_once(lambda: ConnectionClosedError(endpoint_url="x"))) as c:
        uri = commit(dest, files, kind="test", metrics={"n": 1}, storage=cfg)
    assert c.calls == 2  # the retry met 412 on its own bytes: success, not a conflict
    assert read_manifest(uri, cfg).metrics == {"n": 1}
    with pytest.raises(ManifestExistsError):  # a later, different commit is still refused
        commit(dest, files, kind="test", metrics={"n": 2}, storage=cfg)


@pytest.mark.s3
def test_a_retried_create_that_finds_someone_elses_object_is_a_conflict(s3_bucket_url, storage_config_s3):
    cfg = storage_config_s3
    fs, root = url_to_fs(s3_bucket_url, cfg)
    path = f"{root}/theirs.json"

    async def fault(n, real, kwargs):
        if n == 1:  # while our PUT fails, another writer creates the object
            await real(**{**kwargs, "Body": b"someone else"})
            raise _client_error("SlowDown", 503)
        return await real(**kwargs)

    with _FlakyClient(fs, "put_object", fault):
        with pytest.raises(FileExistsError):
            create_only(fs, path, b"mine", url=f"{s3_bucket_url}/theirs.json")
    assert fs.cat_file(path) == b"someone else"


@pytest.mark.s3
def test_throttling_is_waited_out(s3_bucket_url, storage_config_s3, caplog):
    caplog.set_level(logging.INFO, logger="rlmill.storage")
    cfg = storage_config_s3
    fs, root = url_to_fs(s3_bucket_url, cfg)

    async def fault(n, real, kwargs):
        if n <= 2:
            raise _client_error("SlowDown", 503) if n == 1 else _client_error("TooManyRequests", 429)
        return await real(**kwargs)

    with _FlakyClient(fs, "put_object", fault) as c:
        fs.pipe_file(f"{root}/t.bin", b"data")
    assert c.calls == 3 and fs.cat_file(f"{root}/t.bin") == b"data"
    assert _retries_logged(caplog) == (1, 1)

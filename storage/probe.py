"""Can a run use its storage root? One quick check before anything starts.

    from storage.probe import check_root
    check_root("s3://bucket/prefix", StorageConfig(endpoint_url="http://127.0.0.1:9000"))
    check_root(".rlmill")          # raises StorageCheckError: one line naming the problem and the fix

`rlmill train`/`rlmill run` call it before the Prefect API starts, and the rl-training flow
first thing (`storage.check_bucket=false` turns the S3 part off, with storage's own bucket check), so that a wrong endpoint, a missing bucket, rejected credentials or a read-only
folder is one line in seconds instead of an error from deep inside a stage after the models
have loaded. It writes nothing that stays: locally it creates and removes an empty folder where
the root's first folder would be created; on S3 it sends HEAD bucket, then PUTs and DELETEs an
empty object under the root's prefix (so credentials that can read but not write are caught).

Its retry budget is short on purpose (STARTUP_CHECK_BUDGET_S, not storage's multi-minute
`retry_budget_seconds`): an endpoint that does not answer when a run starts is a typo or a
server that is not running far more often than an outage, and a user waits for the answer.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from contextlib import contextmanager

from .config import StorageConfig
from .errors import CredentialsError, StorageError, StorageUnavailableError

__all__ = ["check_root", "StorageCheckError", "STARTUP_CHECK_BUDGET_S"]

# Seconds the check keeps retrying an endpoint that does not answer (connection refused, DNS,
# 5xx), with storage's jittered backoff; a wrong endpoint_url is reported this long after start.
STARTUP_CHECK_BUDGET_S = 10.0
# Per request: a blackholed address would otherwise hold one attempt for botocore's 60 s default.
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 5, 10
PROBE_NAME = ".rlmill-write-check-"


class StorageCheckError(StorageError):
    """The storage root cannot be used (unreachable, no bucket, credentials refused, read-only);
    the message is one line naming the root, the problem and the fix."""


def check_root(root: str, storage: StorageConfig | None = None, *, write: bool = True,
               budget_s: float | None = None) -> None:
    """Raise StorageCheckError unless `root` (a local folder, file://, memory:// or s3:// URL)
    can be read, and written unless write=False, with `storage`'s settings; leaves nothing behind.
    An endpoint that does not answer is retried for `budget_s` (default STARTUP_CHECK_BUDGET_S)."""
    from .fs import _scheme, redact_url, url_to_fs

    scheme = _scheme(root)
    if scheme in ("", "file", "local"):
        if write:  # reading a local folder needs no check: a missing run is reported by name
            _check_local(root, url_to_fs(root)[1])
    elif scheme in ("s3", "s3a"):
        storage = storage or StorageConfig()
        if redact_url(root) != root:
            raise StorageCheckError(f"storage root {redact_url(root)}: credentials inside the URL are not accepted: "
                                    "set storage.key/storage.secret or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
        if storage.check_bucket:  # off: credentials that may not HEAD the bucket or delete objects
            _check_s3(root, storage, write, STARTUP_CHECK_BUDGET_S if budget_s is None else budget_s)
    elif scheme != "memory":  # memory:// is this process's own: nothing to check
        try:
            url_to_fs(root, storage)
        except StorageError as e:  # an unsupported scheme
            raise StorageCheckError(f"storage root {redact_url(root)}: {e}") from e


def _check_local(root: str, path: str) -> None:
    existing = path
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)  # the nearest folder that exists: rlmill creates the rest
    if not os.path.isdir(existing):
        raise StorageCheckError(
            f"storage root {root}: {existing} is a file, not a folder: set root= to a folder (created if missing)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=PROBE_NAME, dir=existing))
    except OSError as e:
        raise StorageCheckError(
            f"storage root {root} is not writable ({existing}: {e.strerror or e}): set root= to a folder "
            f"you can write to, or make it writable (e.g. chmod u+w {existing})") from e


def _check_s3(root: str, storage: StorageConfig, write: bool, budget_s: float) -> None:
    import fsspec.asyn

    from .fs import redact_url
    from .retry import RetryPolicy, _retrying_s3_class

    opts = storage.s3fs_options()
    endpoint = opts.get("client_kwargs", {}).get("endpoint_url")
    config_kwargs = {"retries": {"total_max_attempts": 1, "mode": "standard"},
                     "connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S}
    # A private instance (not fsspec's cache): its short timeouts must not leak into the run's.
    fs = _retrying_s3_class()(use_listings_cache=False, skip_instance_cache=True, config_kwargs=config_kwargs,
                              rlmill_retry=RetryPolicy.of(storage).limited_to(budget_s).as_tuple(), **opts)
    bucket, _, prefix = fs._strip_protocol(root).partition("/")
    shown = redact_url(root)
    if not bucket:
        raise StorageCheckError(f"storage root {shown} has no bucket: use s3://<bucket>/<prefix>")
    key = "/".join(p for p in (prefix.strip("/"), f"{PROBE_NAME}{uuid.uuid4().hex}") if p)
    start = time.monotonic()
    step = "read"
    try:
        with _retry_warnings_off():
            fsspec.asyn.sync(fs.loop, fs._call_s3, "head_bucket", Bucket=bucket)
            if not write:
                return
            step = "write"
            fsspec.asyn.sync(fs.loop, fs._call_s3, "put_object", Bucket=bucket, Key=key, Body=b"")
            step = "delete"
            fsspec.asyn.sync(fs.loop, fs._call_s3, "delete_object", Bucket=bucket, Key=key)
    except Exception as e:  # noqa: BLE001 - every failure becomes one line with its fix
        raise _s3_problem(e, shown, bucket, endpoint, step, time.monotonic() - start, key) from e


@contextmanager
def _retry_warnings_off():
    """Storage logs each retry of a request; here the one-line answer says it was retried, so
    the per-attempt warnings would only turn that one line into several."""
    storage_log = logging.getLogger("rlmill.storage")

    def drop(record: logging.LogRecord) -> bool:
        return False

    storage_log.addFilter(drop)
    try:
        yield
    finally:
        storage_log.removeFilter(drop)


def _s3_problem(e: Exception, root: str, bucket: str, endpoint: str | None, step: str,
                elapsed: float, key: str) -> StorageCheckError:
    from .fs import _translate_s3_error

    where = f"at {endpoint}" if endpoint else "on AWS S3"
    if isinstance(e, StorageUnavailableError):
        last = str(e).rsplit("): ", 1)[-1][:200]
        return StorageCheckError(
            f"storage root {root}: no answer from S3 {where} (retried for {elapsed:.0f} s; last error: {last}): "
            "check storage.endpoint_url / AWS_ENDPOINT_URL and that the S3 server is running")
    problem = _translate_s3_error(e, bucket, endpoint)
    if step == "write" and isinstance(problem, CredentialsError):
        return StorageCheckError(
            f"storage root {root}: S3 {where} lets these credentials read bucket '{bucket}' but not write to it "
            "(PutObject refused): use credentials that may write there, or another root")
    if step == "delete" and isinstance(problem, CredentialsError):
        return StorageCheckError(
            f"storage root {root}: S3 {where} took an empty test object but refused to delete it "
            f"(s3://{bucket}/{key}, left there): allow DeleteObject, or set storage.check_bucket=false "
            "to skip this check")
    return StorageCheckError(f"storage root {root}: {problem}")

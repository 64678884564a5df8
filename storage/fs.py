"""URL -> (filesystem, path), plus the two write disciplines everything else builds on.

- `write_once`: create-only. Locally a temp file is hard-linked into place (os.link fails if the
  name exists); on S3 a single PUT with `If-None-Match: *`; on memory:// check-then-write under a
  process lock (memory:// is one process's, so that is enough).
- `overwrite`: replace a file whole (a pointer such as LATEST or CURRENT, a report). Locally
  write-new-then-os.replace; on S3 a single PUT, which readers see whole or not at all.

Every S3 request is retried through transient faults on one budget: `storage.retry`.
"""

from __future__ import annotations

import os
import threading
import uuid
from contextlib import suppress
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .config import StorageConfig
from .errors import (
    BucketNotFoundError,
    CredentialsError,
    ObjectExistsError,
    StorageError,
    StorageUnavailableError,
    UnsupportedURLError,
)
from .retry import RetryPolicy, _error_code, _retrying_s3_class

__all__ = [
    "url_to_fs",
    "join",
    "redact_url",
    "is_local",
    "is_s3",
    "exists",
    "write_once",
    "overwrite",
    "write_pointer",
    "read_pointer",
    "create_only",
]

_S3_SCHEMES = ("s3", "s3a")
_SUPPORTED = ("a local path", "file://", "memory://", "s3://")

# Buckets already checked in this process, keyed by (endpoint, key id, bucket): the check costs
# one HEAD request, paid once per bucket rather than on every call.
_checked_buckets: set[tuple[Any, ...]] = set()
# Endpoints that answered a bucket check in this process: a later check there is a request like
# any other (full retry budget); a first contact fails fast (a wrong endpoint_url, not an outage).
_answered_endpoints: set[Any] = set()
FIRST_CONTACT_BUDGET_S = 15.0
_checked_lock = threading.Lock()
# memory:// has no atomic create; serialise check-then-write within the (only) process.
_memory_lock = threading.Lock()


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "s3" in protocol


def redact_url(url: str) -> str:
    """The URL without any `user:password@` part, safe to log or store in a manifest.

    >>> redact_url("s3://KEY:se/cret@bucket/x"), redact_url("s3://bucket/a@b")
    ('s3://bucket/x', 's3://bucket/a@b')
    """
    if "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    try:
        parts = urlsplit(url)
        netloc, port_ok = parts.netloc, _port_ok(parts)
    except ValueError:  # e.g. an unbalanced '[' inside a password
        netloc, port_ok = "", False
    if "@" in netloc:
        return urlunsplit(parts._replace(netloc=netloc.rsplit("@", 1)[1]))
    # A password holding '/', '?' or '#' (AWS secrets often hold '/') ends urlsplit's netloc
    # early: "s3://KEY:se/cret@bucket/x" parses as host "KEY", port "se". A port that is not a
    # number, or any ':' in an S3 bucket name (never legal), means credentials: drop everything
    # up to the first '@'.
    if (not port_ok or (scheme.lower() in _S3_SCHEMES and ":" in netloc)) and "@" in rest:
        return f"{scheme}://{rest.split('@', 1)[1]}"
    return url


def _port_ok(parts) -> bool:
    try:
        parts.port
    except ValueError:
        return False
    return True


def join(url: str, *parts: str) -> str:
    """Join URL path segments with '/', keeping the scheme.

    >>> join("s3://bucket/root/", "runs", "r1")
    's3://bucket/root/runs/r1'
    """
    out = url.rstrip("/") if url.rstrip("/") else url
    for part in parts:
        part = str(part).strip("/")
        if part:
            out = f"{out}/{part}" if not out.endswith("/") else out + part
    return out


def url_to_fs(url: str, storage: StorageConfig | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve any supported URL to an fsspec filesystem and the path inside it.

    Local paths and file:// give a LocalFileSystem that creates parent folders on write;
    s3:// uses `storage` (else the AWS env vars). The first S3 use of a bucket in this process
    checks it exists and the credentials work (one HEAD request).

    >>> fs, path = url_to_fs("memory://rlmill-doc/x")
    >>> path
    '/rlmill-doc/x'
    """
    if not isinstance(url, str) or not url:
        raise UnsupportedURLError(f"storage URL must be a non-empty string, got {url!r}")
    scheme = _scheme(url)
    if scheme in ("", "file", "local"):
        path = url.split("://", 1)[1] if scheme else url
        return LocalFileSystem(auto_mkdir=True), os.path.abspath(os.path.expanduser(path))
    if scheme == "memory":
        fs = fsspec.filesystem("memory")
        return fs, fs._strip_protocol(url)
    if scheme in _S3_SCHEMES:
        return _s3_fs(url, storage or StorageConfig())
    raise UnsupportedURLError(
        f"unsupported URL scheme '{scheme}://' in {redact_url(url)!r}: "
        f"use {', '.join(_SUPPORTED)}"
    )


def _s3_fs(url: str, storage: StorageConfig) -> tuple[fsspec.AbstractFileSystem, str]:
    if redact_url(url) != url:
        raise UnsupportedURLError(
            f"credentials inside the URL {redact_url(url)!r} are not accepted: "
            "put them in the config keys storage.key / storage.secret, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        )
    opts = storage.s3fs_options()
    policy = RetryPolicy.of(storage)
    # Listings are not cached: another process may commit a manifest at any time, and a stale
    # cached listing would hide it (or resurrect a deleted shard). botocore's own retries are off
    # (RetryingS3FileSystem retries every request, on one budget; see the module docstring).
    config_kwargs = {"retries": {"total_max_attempts": 1, "mode": "standard"}}
    fs = _retrying_s3_class()(use_listings_cache=False, config_kwargs=config_kwargs,
                              rlmill_retry=policy.as_tuple(), **opts)
    path = fs._strip_protocol(url)
    bucket = path.split("/", 1)[0]
    if not bucket:
        raise UnsupportedURLError(f"S3 URL {redact_url(url)!r} has no bucket: use s3://<bucket>/<prefix>")
    if storage.check_bucket:
        _check_bucket_once(fs, bucket, opts, policy)
    return fs, path


def _check_bucket_once(fs: Any, bucket: str, opts: dict[str, Any], policy: "RetryPolicy") -> None:
    endpoint = opts.get("client_kwargs", {}).get("endpoint_url")
    cache_key = (endpoint, opts.get("key"), opts.get("secret"), bucket)
    with _checked_lock:
        if cache_key in _checked_buckets:
            return
        answered = endpoint in _answered_endpoints
    if not answered:  # first contact: a wrong endpoint_url is a typo to report, not an outage to wait out
        policy = policy.limited_to(FIRST_CONTACT_BUDGET_S)
    try:
        fsspec.asyn.sync(fs.loop, fs._call_s3_with, policy, "head_bucket", Bucket=bucket)
    except Exception as e:  # noqa: BLE001 - translated into one actionable line below
        raise _translate_s3_error(e, bucket, endpoint) from e
    with _checked_lock:
        _checked_buckets.add(cache_key)
        _answered_endpoints.add(endpoint)


def _translate_s3_error(e: BaseException, bucket: str, endpoint: str | None) -> StorageError:
    where = f"at {endpoint}" if endpoint else "on AWS S3"
    if isinstance(e, StorageUnavailableError):
        return StorageUnavailableError(
            f"cannot reach S3 bucket '{bucket}' {where} ({str(e).splitlines()[0][:300]}): "
            "check endpoint_url and that the server is running")
    code = _error_code(e)
    names = {type(x).__name__ for x in (e, e.__cause__, e.__context__) if x is not None}
    if code in ("404", "NoSuchBucket") or isinstance(e, FileNotFoundError):
        return BucketNotFoundError(
            f"S3 bucket '{bucket}' does not exist {where}: create it first "
            f"(e.g. `aws s3 mb s3://{bucket}`) or fix the URL/endpoint_url"
        )
    if "NoCredentialsError" in names:  # botocore found none: nothing was sent, nothing was rejected
        return CredentialsError(
            f"no S3 credentials were given for bucket '{bucket}' {where}: set the config keys storage.key and "
            "storage.secret (or the overrides storage.key=... storage.secret=...), or export "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    if (code in ("403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                 "InvalidToken", "ExpiredToken", "InvalidClientTokenId")
            or isinstance(e, PermissionError)):
        return CredentialsError(
            f"S3 {where} rejected the credentials for bucket '{bucket}' ({code or type(e).__name__}): "
            "fix the config keys storage.key / storage.secret, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        )
    return StorageError(
        f"cannot use S3 bucket '{bucket}' {where} ({type(e).__name__}: {str(e).splitlines()[0][:200]}): "
        "check endpoint_url and that the server is running"
    )


def _write_local_temp(path: str, data: bytes) -> str:
    """Write `data` durably to a fresh temp name beside `path`; the caller links or renames it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def create_only(fs: fsspec.AbstractFileSystem, path: str, data: bytes, *, url: str | None = None) -> None:
    """Write `data` at `path` only if nothing is there; else raise ObjectExistsError.

    On S3 the PUT is retried through transient faults like every request; a retry that finds an
    object holding exactly `data` (the earlier attempt landed, its answer was lost) succeeds."""
    shown = redact_url(url or path)
    exists = ObjectExistsError(f"{shown} already exists; create-only writes never overwrite it")
    if is_local(fs):
        tmp = _write_local_temp(path, data)
        try:
            os.link(tmp, path)  # atomic, and fails if the name exists: the commit point
        except FileExistsError:
            raise exists from None
        finally:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
    elif is_s3(fs):
        try:
            fs.pipe_file(path, data, mode="create")  # If-None-Match: *
        except FileExistsError:  # moto
            raise exists from None
        except OSError as e:  # AWS/MinIO: 412 PreconditionFailed
            if _error_code(e) in ("PreconditionFailed", "412") or "PreconditionFailed" in str(e):
                raise exists from None
            raise
    else:
        with _memory_lock:
            if fs.exists(path):
                raise exists
            fs.pipe_file(path, data)


def write_once(url: str, data: bytes | str, storage: StorageConfig | None = None) -> str:
    """Create a small file that must never be overwritten (e.g. run.json); returns the URL.

    >>> write_once("memory://rlmill-doc/once.txt", "v1")
    'memory://rlmill-doc/once.txt'
    """
    fs, path = url_to_fs(url, storage)
    create_only(fs, path, data.encode() if isinstance(data, str) else data, url=url)
    return url


def overwrite(url: str, data: bytes | str, storage: StorageConfig | None = None) -> str:
    """Replace the file at `url` whole, or create it (and its folders); returns the URL. Readers
    see the old bytes or the new ones, never part of either.

    >>> overwrite("memory://rlmill-doc/report.json", b"{}")
    'memory://rlmill-doc/report.json'
    """
    fs, path = url_to_fs(url, storage)
    data = data.encode() if isinstance(data, str) else data
    if is_local(fs):
        tmp = _write_local_temp(path, data)
        os.replace(tmp, path)  # readers see the old or the new file, never half of one
    else:
        fs.pipe_file(path, data)  # one PUT: atomic on S3
    return url


def write_pointer(url: str, text: str, storage: StorageConfig | None = None) -> None:
    """Atomically replace a small pointer file such as LATEST or CURRENT."""
    overwrite(url, text, storage)


def exists(url: str, storage: StorageConfig | None = None) -> bool:
    """Whether a file or folder is at `url`.

    >>> url = overwrite("memory://rlmill-doc/seen.txt", "x")
    >>> exists(url), exists("memory://rlmill-doc/none")
    (True, False)
    """
    fs, path = url_to_fs(url, storage)
    return fs.exists(path)


def read_pointer(url: str, storage: StorageConfig | None = None) -> str | None:
    """The stripped text of a pointer file, or None if it does not exist."""
    fs, path = url_to_fs(url, storage)
    try:
        return fs.cat_file(path).decode().strip()
    except FileNotFoundError:
        return None

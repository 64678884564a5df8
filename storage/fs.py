"""URL -> (filesystem, path), plus the two write disciplines everything else builds on.

- `write_once`: create-only. Locally a temp file is hard-linked into place (os.link fails if the
  name exists); on S3 a single PUT with `If-None-Match: *`; on memory:// check-then-write under a
  process lock (memory:// is one process's, so that is enough).
- `write_pointer`: overwrite atomically (LATEST, CURRENT). Locally write-new-then-os.replace;
  on S3 a single PUT, which readers see whole or not at all.

Transient faults: every request rlmill (or anything holding a filesystem from `url_to_fs`) sends
to S3 goes through one choke point, `RetryingS3FileSystem._call_s3`, which retries transient
faults (connection refused/reset/timed out, HTTP 5xx, 429 and 503 SlowDown throttling) with
exponential backoff and full jitter for up to `StorageConfig.retry_budget_seconds`, then raises
StorageUnavailableError. Faults that cannot heal fail at once with their usual error: 403 and bad
credentials (PermissionError -> CredentialsError), a missing bucket or key (FileNotFoundError ->
BucketNotFoundError / NotCommittedError / CorruptShardError), a create-only conflict. A
create-only PUT (`If-None-Match: *`) that is retried after a fault and then finds an object with
exactly its own bytes is a success (the first attempt landed, its answer was lost); any other
object there stays a conflict. botocore's and s3fs's own request retries are turned off so that
this is the only place a request is sent again. Local and memory:// storage have no transient
faults and are not retried.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Iterator
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

__all__ = [
    "url_to_fs",
    "join",
    "redact_url",
    "is_local",
    "is_s3",
    "write_once",
    "write_pointer",
    "read_pointer",
    "create_only",
    "RetryPolicy",
    "backoff_delays",
    "is_transient",
]

log = logging.getLogger("rlmill.storage")

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


def _error_code(e: BaseException) -> str:
    for err in (e, e.__cause__, e.__context__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))
    return ""


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


# ------------------------------------------------------------------------ transient faults
_BASE_DELAY_S = 0.5  # the first retry waits up to this long; each later one up to twice as long
_LOG_EVERY_S = 30.0  # while a request keeps failing, one "still failing" warning this often


@dataclass(frozen=True)
class RetryPolicy:
    """How one storage request retries transient faults: for `budget_s` seconds in all, with
    full-jitter exponential backoff from `base_delay_s`, no single wait over `max_delay_s`."""

    budget_s: float = 300.0
    max_delay_s: float = 30.0
    base_delay_s: float = _BASE_DELAY_S

    @classmethod
    def of(cls, storage: StorageConfig) -> "RetryPolicy":
        return cls(storage.retry_budget_seconds, storage.retry_max_delay_seconds)

    def as_tuple(self) -> tuple[float, float, float]:
        return (self.budget_s, self.max_delay_s, self.base_delay_s)

    def limited_to(self, budget_s: float) -> "RetryPolicy":
        return RetryPolicy(min(self.budget_s, budget_s), self.max_delay_s, self.base_delay_s)


def backoff_delays(policy: RetryPolicy, rng: random.Random | None = None) -> Iterator[float]:
    """The waits between attempts. The n-th (n = 0, 1, ...) is uniform in
    [0, min(max_delay_s, base_delay_s * 2**n)] ("full jitter": clients that failed together do not
    come back together), and the waits end when they add up to the budget (the last is cut to fit).

    >>> d = list(backoff_delays(RetryPolicy(budget_s=10, max_delay_s=4, base_delay_s=1), random.Random(0)))
    >>> sum(d) <= 10 and all(x <= 4 for x in d), list(backoff_delays(RetryPolicy(budget_s=0)))
    (True, [])
    """
    rng = rng or random.Random()
    spent, n = 0.0, 0
    while spent < policy.budget_s:
        cap = min(policy.max_delay_s, policy.base_delay_s * 2.0 ** min(n, 60))
        delay = min(rng.uniform(0.0, cap), policy.budget_s - spent)
        spent += delay
        n += 1
        yield delay


# S3 error codes that mean "try again later" whatever their HTTP status (AWS, MinIO, Ceph).
_TRANSIENT_CODES = frozenset({
    "SlowDown", "SlowDownRead", "SlowDownWrite", "Throttling", "ThrottlingException", "ThrottledException",
    "RequestThrottled", "RequestThrottledException", "TooManyRequests", "TooManyRequestsException",
    "RequestLimitExceeded", "BandwidthLimitExceeded", "ServiceUnavailable", "InternalError",
    "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete", "OperationAborted",
    "ConditionalRequestConflict", "XMinioServerNotInitialized", "XMinioReadQuorum", "XMinioWriteQuorum",
    "429", "500", "502", "503", "504",
})
# Never transient, whatever they wrap: a missing bucket/key, 403, a create-only conflict, rlmill's own.
_PERMANENT_TYPES = (StorageError, FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError,
                    NotADirectoryError)


def _transient_type(err: BaseException) -> bool:
    try:
        from botocore import exceptions as bx
    except ImportError:  # pragma: no cover - s3fs always brings botocore
        bx = None
    if bx is not None:
        if isinstance(err, bx.SSLError) and "certificate" in str(err).lower():
            return False  # a certificate that does not verify will not start verifying
        retryable = tuple(getattr(bx, n) for n in ("ConnectionError", "HTTPClientError", "IncompleteReadError",
                                                   "ResponseStreamingError", "ResponseParserError")
                          if hasattr(bx, n))
        if isinstance(err, retryable):
            return True
    try:
        import aiohttp

        if isinstance(err, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)):
            return True
    except ImportError:  # pragma: no cover
        pass
    import http.client

    # ConnectionError: refused/reset/aborted/broken pipe; TimeoutError: socket and asyncio timeouts.
    return isinstance(err, (ConnectionError, TimeoutError, http.client.IncompleteRead))


def is_transient(e: BaseException) -> bool:
    """Whether a failed storage request may succeed when sent again a little later: connection
    refused/reset/timed out, HTTP 5xx, 429 or 503 SlowDown. Not: 403/credentials, 404, 412
    create-only conflicts, other 4xx, or any rlmill StorageError (already final)."""
    err: BaseException | None = e
    for _ in range(6):  # the error, then what it was translated from (s3fs sets __cause__)
        if err is None or isinstance(err, _PERMANENT_TYPES):
            return False
        response = getattr(err, "response", None)
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            code = str(response["Error"].get("Code", ""))
            try:
                status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            except (TypeError, ValueError):
                status = 0
            return code in _TRANSIENT_CODES or status == 429 or status >= 500
        if _transient_type(err):
            return True
        err = err.__cause__
    return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _create_conflict(method: str, kwargs: dict[str, Any], e: BaseException) -> bool:
    """A create-only PUT (If-None-Match: *) refused because the key exists (412 PreconditionFailed)."""
    if method != "put_object" or kwargs.get("IfNoneMatch") != "*":
        return False
    return (isinstance(e, FileExistsError) or _error_code(e) in ("PreconditionFailed", "412")
            or "PreconditionFailed" in str(e))


_retrying_class: Any = None


def _retrying_s3_class() -> type:
    """RetryingS3FileSystem, built on first use so `import storage` does not import s3fs."""
    global _retrying_class
    if _retrying_class is not None:
        return _retrying_class
    import s3fs
    from fsspec.asyn import sync_wrapper
    from s3fs.core import _error_wrapper

    class RetryingS3FileSystem(s3fs.S3FileSystem):
        """s3fs whose every request (`_call_s3`: reads, writes, listings, HEADs, multipart parts,
        the create-only PUT) retries transient faults on one budget; see the module docstring."""

        def __init__(self, *args: Any, rlmill_retry: tuple[float, float, float] = RetryPolicy().as_tuple(),
                     **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.rlmill_policy = RetryPolicy(*rlmill_retry)

        async def _call_s3(self, method, *akwarglist, **kwargs):
            return await self._call_s3_with(self.rlmill_policy, method, *akwarglist, **kwargs)

        call_s3 = sync_wrapper(_call_s3)  # S3File's requests (fs.open) come through here

        async def _call_s3_once(self, method, *akwarglist, **kwargs):
            # s3fs's own _call_s3, with its retry loop cut to one try: retrying is ours alone.
            await self.set_session()
            s3 = await self.get_s3(kwargs.get("Bucket"))
            bound = getattr(s3, method)
            call_kwargs = self._get_s3_method_kwargs(bound, *akwarglist, **kwargs)
            return await _error_wrapper(bound, kwargs=call_kwargs, retries=1)

        async def _holds(self, kwargs: dict[str, Any]) -> bool:
            """Whether the object a create-only PUT was refused on holds exactly that PUT's bytes."""
            body = kwargs.get("Body")
            if not isinstance(body, (bytes, bytearray, memoryview)):
                return False
            try:
                return await self._cat_file(f"{kwargs['Bucket']}/{kwargs['Key']}") == bytes(body)
            except FileNotFoundError:
                return False

        async def _call_s3_with(self, policy: RetryPolicy, method, *akwarglist, **kwargs):
            delays = backoff_delays(policy)
            start = last_log = time.monotonic()
            failures = 0
            endpoint = self.client_kwargs.get("endpoint_url") or "AWS S3"
            target = "s3://" + "/".join(str(kwargs[k]) for k in ("Bucket", "Key") if kwargs.get(k))
            while True:
                try:
                    out = await self._call_s3_once(method, *akwarglist, **kwargs)
                except Exception as e:  # noqa: BLE001 - sorted into transient / final below
                    if failures and _create_conflict(method, kwargs, e) and await self._holds(kwargs):
                        # An earlier attempt landed and only its answer was lost: our own object.
                        log.warning("storage: %s %s: found this write's own object after %d failed attempts; "
                                    "it landed, done", method, target, failures)
                        return {"rlmill_own_object": True}
                    if not is_transient(e):
                        if failures:
                            self._log_recovery(method, target, endpoint, failures, start)
                        raise
                    failures += 1
                    elapsed = time.monotonic() - start
                    delay = next(delays, None)
                    if delay is None or elapsed >= policy.budget_s:
                        raise StorageUnavailableError(
                            f"S3 {method} {target} at {endpoint} still failing after {elapsed:.0f} s and "
                            f"{failures} attempts (storage.retry_budget_seconds={policy.budget_s:g}): "
                            f"{_first_line(e)}") from e
                    delay = min(delay, policy.budget_s - elapsed)
                    now = time.monotonic()
                    if failures == 1 or now - last_log >= _LOG_EVERY_S:
                        last_log = now
                        log.warning("storage: %s %s at %s failed (%s); retrying for up to %.0f s more "
                                    "(attempt %d, next in %.1f s)", method, target, endpoint, _first_line(e),
                                    policy.budget_s - elapsed, failures + 1, delay)
                    await asyncio.sleep(delay)
                    continue
                if failures:
                    self._log_recovery(method, target, endpoint, failures, start)
                return out

        @staticmethod
        def _log_recovery(method: str, target: str, endpoint: str, failures: int, start: float) -> None:
            log.warning("storage: %s %s at %s answered again after %d failed attempts over %.1f s",
                        method, target, endpoint, failures, time.monotonic() - start)

    RetryingS3FileSystem.__module__ = __name__
    RetryingS3FileSystem.__qualname__ = "RetryingS3FileSystem"
    _retrying_class = RetryingS3FileSystem
    return RetryingS3FileSystem


def __getattr__(name: str) -> Any:
    # `storage.fs.RetryingS3FileSystem` (pickle finds the class by that name), built lazily.
    if name == "RetryingS3FileSystem":
        return _retrying_s3_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def write_pointer(url: str, text: str, storage: StorageConfig | None = None) -> None:
    """Atomically replace a small pointer file such as LATEST or CURRENT."""
    fs, path = url_to_fs(url, storage)
    data = text.encode()
    if is_local(fs):
        tmp = _write_local_temp(path, data)
        os.replace(tmp, path)  # readers see the old or the new pointer, never half of one
    else:
        fs.pipe_file(path, data)  # one PUT: atomic on S3


def read_pointer(url: str, storage: StorageConfig | None = None) -> str | None:
    """The stripped text of a pointer file, or None if it does not exist."""
    fs, path = url_to_fs(url, storage)
    try:
        return fs.cat_file(path).decode().strip()
    except FileNotFoundError:
        return None

"""Transient S3 faults: which failures are worth sending again, how long to wait between tries,
and the s3fs filesystem whose every request goes through that one retry loop.

    >>> is_transient(ConnectionResetError()), is_transient(PermissionError())
    (True, False)

Every request rlmill (or anything holding a filesystem from `url_to_fs`) sends
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

RetryingS3FileSystem is built on first use so that `import storage` does not import s3fs.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Iterator

from .config import StorageConfig
from .errors import StorageError, StorageUnavailableError

__all__ = ["RetryPolicy", "backoff_delays", "is_transient"]

log = logging.getLogger("rlmill.storage")

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


class _Tries:
    """One request's attempts on a RetryPolicy: counts the failures, says how long to wait after
    each (or raises StorageUnavailableError once the budget is spent) and logs as it goes."""

    def __init__(self, policy: RetryPolicy, method: str, kwargs: dict[str, Any], endpoint: str):
        self.policy, self.method, self.endpoint = policy, method, endpoint
        self.target = "s3://" + "/".join(str(kwargs[k]) for k in ("Bucket", "Key") if kwargs.get(k))
        self.delays = backoff_delays(policy)
        self.start = self.last_log = time.monotonic()
        self.failures = 0

    def wait_after(self, e: BaseException) -> float:
        """The wait before the next attempt after transient fault `e`; raises once it is spent."""
        policy = self.policy
        self.failures += 1
        elapsed = time.monotonic() - self.start
        delay = next(self.delays, None)
        if delay is None or elapsed >= policy.budget_s:
            raise StorageUnavailableError(
                f"S3 {self.method} {self.target} at {self.endpoint} still failing after {elapsed:.0f} s and "
                f"{self.failures} attempts (storage.retry_budget_seconds={policy.budget_s:g}): "
                f"{_first_line(e)}") from e
        delay = min(delay, policy.budget_s - elapsed)
        now = time.monotonic()
        if self.failures == 1 or now - self.last_log >= _LOG_EVERY_S:
            self.last_log = now
            log.warning("storage: %s %s at %s failed (%s); retrying for up to %.0f s more "
                        "(attempt %d, next in %.1f s)", self.method, self.target, self.endpoint, _first_line(e),
                        policy.budget_s - elapsed, self.failures + 1, delay)
        return delay

    def own_object(self) -> dict[str, Any]:
        log.warning("storage: %s %s: found this write's own object after %d failed attempts; "
                    "it landed, done", self.method, self.target, self.failures)
        return {"rlmill_own_object": True}

    def log_recovery(self) -> None:
        if self.failures:
            log.warning("storage: %s %s at %s answered again after %d failed attempts over %.1f s",
                        self.method, self.target, self.endpoint, self.failures, time.monotonic() - self.start)


async def _holds(fs: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the object a create-only PUT was refused on holds exactly that PUT's bytes."""
    body = kwargs.get("Body")
    if not isinstance(body, (bytes, bytearray, memoryview)):
        return False
    try:
        return await fs._cat_file(f"{kwargs['Bucket']}/{kwargs['Key']}") == bytes(body)
    except FileNotFoundError:
        return False


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

        async def _call_s3_with(self, policy: RetryPolicy, method, *akwarglist, **kwargs):
            tries = _Tries(policy, method, kwargs, self.client_kwargs.get("endpoint_url") or "AWS S3")
            while True:
                try:
                    out = await self._call_s3_once(method, *akwarglist, **kwargs)
                except Exception as e:  # noqa: BLE001 - sorted into transient / final below
                    if tries.failures and _create_conflict(method, kwargs, e) and await _holds(self, kwargs):
                        return tries.own_object()  # an earlier attempt landed, only its answer was lost
                    if not is_transient(e):
                        tries.log_recovery()
                        raise
                    await asyncio.sleep(tries.wait_after(e))
                    continue
                tries.log_recovery()
                return out

    RetryingS3FileSystem.__module__ = __name__
    RetryingS3FileSystem.__qualname__ = "RetryingS3FileSystem"
    _retrying_class = RetryingS3FileSystem
    return RetryingS3FileSystem


def __getattr__(name: str) -> Any:
    # `storage.retry.RetryingS3FileSystem` (pickle finds the class by that name), built lazily.
    if name == "RetryingS3FileSystem":
        return _retrying_s3_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _error_code(e: BaseException) -> str:
    for err in (e, e.__cause__, e.__context__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))
    return ""

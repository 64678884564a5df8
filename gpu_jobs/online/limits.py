"""What one caller may cost the server, and the gate that checks it before a byte of body is parsed.

    limits = ServeLimits(max_body_bytes=1_000_000, rate_limit=5, rate_burst=10)
    app = Gate(fastapi_app, keys=ApiKeys.from_file("keys.yaml"), limits=limits)   # an ASGI app

`Gate` is ASGI middleware, in this order for every path but /health: the API key and its role
(auth.py; 401 / 403), the caller's token bucket (429 with Retry-After), then the body, read up to
`max_body_bytes` (413 at once when Content-Length says more, or as soon as a chunked body passes
it) and handed to the app whole. So a caller without a key, over its rate or sending 100 MB costs
the server a header parse, and the event loop stays free for everyone else (/health included).
Every refusal is in OpenAI's error shape. The principal the key names goes to the app in
scope["rlmill.principal"] (None without keys). Once the body is read the Gate watches the
connection: `client_gone()` is the request's event that is set when its client disconnects (the
app drops its queued or running generation then, batching.py).

Rates are on by default whenever API keys are set (KEYED_RATE_LIMIT and KEYED_FEEDBACK_RATE_LIMIT
per principal, `ServeLimits.resolved`), off without keys unless asked for. `InFlight` caps the
requests one caller (principal, else client address) has queued or generating at once
(`max_in_flight`): its excess is its own 429 while other callers are served.

ServeLimits is the one place these limits and their defaults are declared: `rlmill serve`'s flags
are generated from its fields (flows/cli_serve.py), help text included.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import json
import math
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, Iterator

__all__ = ["Gate", "InFlight", "KEYED_FEEDBACK_RATE_LIMIT", "KEYED_RATE_LIMIT", "RateLimiter", "ServeLimits",
           "client_gone", "client_key", "principal_of"]

PRINCIPAL_KEY = "rlmill.principal"
# When keys are set and no rate is given: per principal, and a frontend key is one principal for all
# its users, so the query rate is a frontend's; feedback, what a canary counts, is the tighter one.
KEYED_RATE_LIMIT = 50.0  # query requests/s per principal
KEYED_FEEDBACK_RATE_LIMIT = 10.0  # feedback posts/s per principal
# The current request's "client disconnected" event (set by the Gate; None outside a request).
_GONE: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar("rlmill_client_gone", default=None)


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class ServeLimits:
    """Per-request and per-caller bounds; see the module docstring. Each field is a flag of
    `rlmill serve` (`--max-body-bytes` for max_body_bytes, ...).

    >>> ServeLimits(rate_limit=-1)
    Traceback (most recent call last):
    ...
    ValueError: --rate-limit -1 is negative: give 0 (no limit) or more
    """

    max_body_bytes: int = field(default=1_000_000, metadata=_help(
        "largest request body in bytes, by its Content-Length or as a chunked body streams in; larger is "
        "refused 413 before it is parsed"))
    max_prompt_chars: int = field(default=100_000, metadata=_help(
        "most characters in a prompt (a completion's text, or all chat messages together); more is refused 400 "
        "before it is tokenised"))
    max_messages: int = field(default=256, metadata=_help("most messages in one chat request; more is refused 400"))
    max_queue: int = field(default=256, metadata=_help(
        "requests waiting for the engine at most (per served version); one more is refused 429 with Retry-After"))
    request_timeout_s: float = field(default=60.0, metadata=_help(
        "seconds a request may wait for and spend in the engine; then it is answered 504 and nothing is "
        "logged (0: no deadline)"))
    rate_limit: float | None = field(default=None, metadata={"type": float, "shown": (
        f"{KEYED_RATE_LIMIT:g} with --api-keys, else 0"), "help": (
        "completions, chat and models requests per second per principal (per API key's principal; without "
        "keys, per client address); over it, 429 with Retry-After (0: no limit)")})
    feedback_rate_limit: float | None = field(default=None, metadata={"type": float, "shown": (
        f"{KEYED_FEEDBACK_RATE_LIMIT:g} with --api-keys, else 0"), "help": (
        "feedback posts per second per principal, as --rate-limit (0: no limit)")})
    max_in_flight: int = field(default=32, metadata=_help(
        "requests one principal (without keys: one client address) may have queued or generating at once; one "
        "more is refused 429 with Retry-After while other callers are served, so one caller's burst cannot fill "
        "the queue (--max-queue)"))
    rate_burst: int = field(default=20, metadata=_help(
        "requests a principal may send at once before its rate applies (the token bucket's size)"))
    grace_s: float = field(default=20.0, metadata=_help(
        "on SIGTERM: seconds to finish the requests in flight and send their events to the broker, then exit 0"))

    def __post_init__(self) -> None:
        for f in fields(self):
            value, flag = getattr(self, f.name), "--" + f.name.replace("_", "-")
            if f.default is None and value is None:  # resolved() fills it in
                continue
            if isinstance(f.default, int) and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{flag} {value} is below 1: give a positive whole number")
            if (isinstance(f.default, float) or f.default is None) and not (isinstance(value, (int, float)) and value >= 0
                                                     and math.isfinite(value)):
                raise ValueError(f"{flag} {value:g} is negative: give 0 (no limit) or more" if value < 0 else
                                 f"{flag} {value} is not a number of seconds or requests per second")

    def resolved(self, keyed: bool) -> "ServeLimits":
        """These limits with the rates left unset filled in: KEYED_RATE_LIMIT and
        KEYED_FEEDBACK_RATE_LIMIT when API keys are set (`keyed`), else 0 (no limit).

        >>> ServeLimits().resolved(True).rate_limit, ServeLimits(rate_limit=0).resolved(True).rate_limit
        (50.0, 0)
        """
        return dataclasses.replace(
            self, rate_limit=(KEYED_RATE_LIMIT if keyed else 0.0) if self.rate_limit is None else self.rate_limit,
            feedback_rate_limit=((KEYED_FEEDBACK_RATE_LIMIT if keyed else 0.0) if self.feedback_rate_limit is None
                                 else self.feedback_rate_limit))

    def rate_of(self, role: str | None) -> float:
        """Requests per second a principal may make to paths needing `role` (0: unlimited; a
        rate not resolved yet counts as 0)."""
        return {"query": self.rate_limit, "feedback": self.feedback_rate_limit}.get(role or "", 0.0) or 0.0


def principal_of(scope: dict) -> str | None:
    """The principal the Gate found for this request (None: no keys configured)."""
    return scope.get(PRINCIPAL_KEY)


def client_key(scope: dict) -> str:
    """Who a request is from when there are no keys: its client address."""
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:unknown"


def client_gone() -> asyncio.Event | None:
    """The current request's event that is set once its client disconnects (the Gate watches the
    connection after reading the body); None outside a request that went through the Gate."""
    return _GONE.get()


class InFlight:
    """Requests each caller has in flight, at most `limit` at once; thread-safe.

    >>> cap = InFlight(1)
    >>> with cap.hold("a"):
    ...     cap.take("a"), cap.take("b")
    (False, True)
    """

    def __init__(self, limit: int):
        self.limit, self._held = limit, {}
        self._lock = threading.Lock()

    def take(self, who: str) -> bool:
        """Take one of `who`'s places (True), or False when it holds `limit` already."""
        with self._lock:
            n = self._held.get(who, 0)
            if n >= self.limit:
                return False
            self._held[who] = n + 1
            return True

    def give(self, who: str) -> None:
        with self._lock:
            n = self._held.get(who, 0) - 1
            if n > 0:
                self._held[who] = n
            else:
                self._held.pop(who, None)

    @contextlib.contextmanager
    def hold(self, who: str) -> Iterator[None]:
        """One place for the block; an ApiError 429 (its own message) when `who` has none left."""
        if not self.take(who):
            from gpu_jobs.online.protocol import ApiError

            raise ApiError(429, f"{who} has {self.limit} requests in flight already (--max-in-flight): wait for "
                                "one to finish", None, "rate_limit_error", {"Retry-After": "1"})
        try:
            yield
        finally:
            self.give(who)


class RateLimiter:
    """One token bucket per (role, caller): `rate` tokens a second, `burst` at most; thread-safe.

    >>> clock = [0.0]
    >>> rl = RateLimiter(ServeLimits(rate_limit=1, rate_burst=2), clock=lambda: clock[0])
    >>> rl.take("query", "a"), rl.take("query", "a"), rl.take("query", "a") > 0, rl.take("query", "b")
    (0.0, 0.0, True, 0.0)
    >>> clock[0] = 1.0; rl.take("query", "a")
    0.0
    """

    MAX_CALLERS = 100_000  # buckets kept; full ones (idle callers) are forgotten first

    def __init__(self, limits: ServeLimits, clock=time.monotonic):
        self.limits, self._clock = limits, clock
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, role: str | None, who: str) -> float:
        """0.0 when the request may go on (a token taken), else the seconds until it may."""
        rate = self.limits.rate_of(role)
        if rate <= 0:
            return 0.0
        burst, now = float(self.limits.rate_burst), self._clock()
        with self._lock:
            tokens, at = self._buckets.get((role, who), (burst, now))
            tokens = min(burst, tokens + (now - at) * rate)
            if tokens < 1.0:
                self._buckets[(role, who)] = (tokens, now)
                return (1.0 - tokens) / rate
            self._buckets[(role, who)] = (tokens - 1.0, now)
            if len(self._buckets) > self.MAX_CALLERS:
                self._forget_idle(now, rate, burst)
            return 0.0

    def _forget_idle(self, now: float, rate: float, burst: float) -> None:
        for key, (tokens, at) in list(self._buckets.items()):
            if tokens + (now - at) * rate >= burst:
                del self._buckets[key]


def _header(scope: dict, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


async def _send_error(send, status: int, message: str, kind: str = "invalid_request_error",
                  headers: dict[str, str] | None = None) -> None:
    from gpu_jobs.online.protocol import error_body

    body = json.dumps(error_body(status, message, None, kind)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


class Gate:
    """ASGI middleware: keys, rate limits and the body cap, before the app; see the module docstring."""

    def __init__(self, app: Any, *, keys: Any = None, limits: ServeLimits = ServeLimits(),
                 rates: RateLimiter | None = None, refused: dict[int, int] | None = None):
        from gpu_jobs.online.auth import OPEN_PATHS, role_of

        self.app, self.keys, self.limits = app, keys, limits
        self.rates = rates or RateLimiter(limits)
        self.refused = refused if refused is not None else {}  # status -> requests refused here
        self._open, self._role_of = OPEN_PATHS, role_of

    async def _refuse(self, send, status: int, message: str, kind: str = "invalid_request_error",
                      headers: dict[str, str] | None = None) -> None:
        self.refused[status] = self.refused.get(status, 0) + 1
        await _send_error(send, status, message, kind, headers)

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            return await self.app(scope, receive, send)
        role = self._role_of(scope["path"])
        principal = None
        if self.keys is not None:
            refusal = self._authorize(scope, role)
            if isinstance(refusal, tuple):
                return await self._refuse(send, *refusal)
            principal = refusal
        scope[PRINCIPAL_KEY] = principal
        wait = self.rates.take(role, principal or client_key(scope))
        if wait > 0:
            return await self._refuse(send, 429, f"rate limit: {self.limits.rate_of(role):g} requests/s for "
                                            f"{principal or 'this client'}; retry in {wait:.1f} s",
                                 "rate_limit_error", {"Retry-After": str(max(1, math.ceil(wait)))})
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body = await self._read_body(scope, receive, send)
        if body is None:
            return None
        gone = asyncio.Event()
        watch = asyncio.ensure_future(_watch(receive, gone))
        token = _GONE.set(gone)
        try:
            await self.app(scope, _replay(body, gone), send)
        finally:
            _GONE.reset(token)
            watch.cancel()

    def _authorize(self, scope: dict, role: str | None) -> str | tuple:
        """The principal's name, or (status, message, type) to refuse with."""
        header = _header(scope, b"authorization")
        if not header:
            return 401, "no API key: send it as the header `Authorization: Bearer <key>`", "authentication_error"
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return 401, "the Authorization header must be `Bearer <key>`", "authentication_error"
        principal = self.keys.lookup(token.strip())
        if principal is None:
            return 401, "invalid API key", "authentication_error"
        if role is not None and role not in principal.roles:
            return 403, (f"principal {principal.name!r} lacks the role {role!r} that {scope['path']} needs "
                         f"(it has: {', '.join(sorted(principal.roles))})"), "permission_error"
        return principal.name

    async def _read_body(self, scope: dict, receive, send) -> bytes | None:
        """The whole body, or None when it was refused (answered here) or the client left."""
        cap = self.limits.max_body_bytes
        length = _header(scope, b"content-length")
        too_big = f"the request body is larger than {cap} bytes (--max-body-bytes)"
        if length is not None:
            if not length.strip().isdigit():
                await self._refuse(send, 400, f"Content-Length {length[:40]!r} is not a number of bytes")
                return None
            if int(length) > cap:
                await self._refuse(send, 413, too_big)
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:  # a chunked body (or a lying Content-Length): stop reading here
                await self._refuse(send, 413, too_big)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _watch(receive, gone: asyncio.Event) -> None:
    """Read the client's messages after the body until it disconnects; then set `gone`."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 -- a connection that broke is gone too
        pass
    gone.set()


def _replay(body: bytes, gone: asyncio.Event):
    """A `receive` that gives the app `body` in one message, then a disconnect once the client
    left (`gone`, set by _watch, which reads the real messages)."""
    given = False

    async def replay() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    return replay

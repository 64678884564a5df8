"""What the HTTP layer exposes beyond the API: the interactive docs, which Host names are answered,
and whose proxy headers are believed. One typed config; `rlmill serve`'s flags are its fields.

    guard = HttpGuard(allowed_hosts=("127.0.0.1", "localhost", "::1"))
    app = FastAPI(**guard.docs_kwargs()); guard.install(app)           # the Host check, first of all
    uvicorn.Config(app, **guard.uvicorn_kwargs())                      # proxy headers only when asked

- `/docs`, `/redoc` and `/openapi.json` are off unless `docs` is set: they list every route and
  schema to anyone who reaches the port (with keys, they need a valid key like any path).
- A request whose Host header names none of `allowed_hosts` is refused 400 before the Gate. This
  is what stops DNS rebinding: a web page whose own name now resolves to 127.0.0.1 makes the
  browser send `Host: evil.example`, so a keyless server on loopback never answers it. `rlmill
  serve` defaults to the loopback names (plus the --host it binds) when bound to loopback; bound to
  another address it takes any Host unless told (the keys it must have then stop a browser, which
  cannot send them across origins).
- `X-Forwarded-For` / `X-Forwarded-Proto` are believed only from `trusted_proxies` (uvicorn's
  proxy headers, off otherwise). uvicorn believes them from 127.0.0.1 by default, which let any
  local caller pick the address its per-address voter and rate limit are counted by.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HttpGuard", "LOOPBACK_NAMES", "host_of"]

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def _help(text: str) -> dict:
    return {"help": text}


def host_of(header: str) -> str:
    """The host name of a Host header, without its port and IPv6 brackets, lowercased.

    >>> host_of("LocalHost:8000"), host_of("[::1]:8000"), host_of("127.0.0.1")
    ('localhost', '::1', '127.0.0.1')
    """
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class HttpGuard:
    """See the module docstring. `allowed_hosts` None: any Host."""

    docs: bool = field(default=False, metadata=_help(
        "serve /docs, /redoc and /openapi.json (off by default: they map the whole API for whoever reaches the "
        "port)"))
    allowed_hosts: tuple[str, ...] | None = field(default=None, metadata=_help(
        "Host header names answered (comma-separated; '*' = any); others are refused 400, which stops DNS "
        "rebinding from reaching a keyless loopback server (default: the loopback names and --host when bound "
        "to loopback, else any)"))
    trusted_proxies: tuple[str, ...] = field(default=(), metadata=_help(
        "addresses of reverse proxies whose X-Forwarded-For / X-Forwarded-Proto are believed (comma-separated; "
        "default none: the client is the connection's peer, so no caller can pick the address its rate limit "
        "and voter are counted by)"))

    @classmethod
    def for_host(cls, bind: str, loopback: bool, docs: bool = False, allowed_hosts: str | None = None,
                 trusted_proxies: str | None = None) -> "HttpGuard":
        """The guard for a server bound to `bind` (`loopback`: a loopback address), from the
        flags' text (None: the default the help states)."""
        hosts: tuple[str, ...] | None
        if allowed_hosts is not None:
            names = tuple(h.strip().lower() for h in allowed_hosts.split(",") if h.strip())
            hosts = None if "*" in names else names
        else:
            hosts = tuple(dict.fromkeys(LOOPBACK_NAMES + (host_of(bind),))) if loopback else None
        proxies = tuple(p.strip() for p in (trusted_proxies or "").split(",") if p.strip())
        return cls(docs=docs, allowed_hosts=hosts, trusted_proxies=proxies)

    def docs_kwargs(self) -> dict[str, Any]:
        """FastAPI's arguments for the docs pages: their default paths, or none of them."""
        return {} if self.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """uvicorn.Config's arguments for proxy headers: believed from trusted_proxies only."""
        if not self.trusted_proxies:
            return {"proxy_headers": False}
        return {"proxy_headers": True, "forwarded_allow_ips": ",".join(self.trusted_proxies)}

    def install(self, app: Any) -> None:
        """Add the Host check as the outermost middleware (added last), when hosts are limited."""
        if self.allowed_hosts is not None:
            app.add_middleware(HostCheck, allowed=frozenset(h.lower() for h in self.allowed_hosts))


class HostCheck:
    """ASGI middleware: a request whose Host names none of `allowed` is refused 400."""

    def __init__(self, app: Any, *, allowed: frozenset[str]):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"host"), "")
        if host_of(header) in self.allowed:
            return await self.app(scope, receive, send)
        from gpu_jobs.online.protocol import error_body

        body = json.dumps(error_body(400, f"Host {header[:100]!r} is not served here (--allowed-hosts)")).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

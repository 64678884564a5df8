"""What the HTTP layer exposes (issue 61 item 7): the docs pages off unless asked, a Host check
that keeps DNS rebinding off a keyless loopback server, X-Forwarded-For believed only from
trusted proxies (so a local caller cannot pick the address its rate limit counts), and rate
limits on by default once API keys are set."""

from __future__ import annotations

import secrets
import threading
import time

import httpx
from fastapi.testclient import TestClient

from gpu_jobs.online.app import Server, ServeSettings, create_app
from gpu_jobs.online.http_guard import HttpGuard
from gpu_jobs.online.limits import KEYED_RATE_LIMIT, ServeLimits
from tests.servers import free_port


def test_docs_pages_are_off_unless_asked(served):
    closed = TestClient(create_app(Server(served)))
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert closed.get(path).status_code == 404, path
    opened = TestClient(create_app(Server(served, settings=ServeSettings(http=HttpGuard(docs=True)))))
    assert opened.get("/openapi.json").status_code == 200 and opened.get("/docs").status_code == 200


def test_only_the_allowed_host_names_are_answered(served):
    guard = HttpGuard.for_host("127.0.0.1", loopback=True)
    assert guard.allowed_hosts == ("127.0.0.1", "localhost", "::1")
    client = TestClient(create_app(Server(served, settings=ServeSettings(http=guard))))
    for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST"):
        assert client.get("/health", headers={"host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", ""):
        r = client.get("/health", headers={"host": host})
        assert r.status_code == 400 and "--allowed-hosts" in r.json()["error"]["message"], host
    refused = client.post("/v1/completions", json={"prompt": "1+1="}, headers={"host": "rebound.example"})
    assert refused.status_code == 400  # before the Gate or the model
    assert HttpGuard.for_host("0.0.0.0", loopback=False).allowed_hosts is None  # keys guard that one
    assert HttpGuard.for_host("127.0.0.1", True, allowed_hosts="api.example, *").allowed_hosts is None
    assert HttpGuard.for_host("127.0.0.1", True, allowed_hosts="api.example").allowed_hosts == ("api.example",)


def _serve(server, guard: HttpGuard):
    """The app under the CLI's own uvicorn setup (flows/cli_serve._drained_uvicorn), in a thread."""
    from flows.cli_serve import _drained_uvicorn

    port = free_port()
    uv = _drained_uvicorn(create_app(server), "127.0.0.1", port, 5.0, guard.uvicorn_kwargs())
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    return uv, thread, f"http://127.0.0.1:{port}"


def test_forwarded_for_is_believed_only_from_trusted_proxies(served):
    """One request a second per client address: a local caller sending X-Forwarded-For stays in
    its own bucket unless 127.0.0.1 is a trusted proxy."""
    limits = ServeLimits(rate_limit=0.001, rate_burst=1)
    for guard, spoof_passes in ((HttpGuard(), False), (HttpGuard(trusted_proxies=("127.0.0.1",)), True)):
        server = Server(served, settings=ServeSettings(limits=limits, http=guard))
        uv, thread, base = _serve(server, guard)
        try:
            assert httpx.get(f"{base}/v1/models").status_code == 200  # the bucket of 127.0.0.1, now empty
            spoofed = httpx.get(f"{base}/v1/models", headers={"x-forwarded-for": "10.9.9.9"})
            assert (spoofed.status_code == 200) == spoof_passes, (guard, spoofed.status_code)
        finally:
            uv.should_exit = True
            thread.join(10)


def test_rate_limits_are_on_by_default_with_keys(served):
    from gpu_jobs.online.auth import ApiKeys

    key = f"sk-{secrets.token_urlsafe(24)}"
    keys = ApiKeys.parse({key: {"principal": "app", "roles": ["query"]}})
    keyed = Server(served, keys=keys)
    assert keyed.settings.limits.rate_limit == KEYED_RATE_LIMIT and keyed.settings.limits.feedback_rate_limit > 0
    assert Server(served).settings.limits.rate_limit == 0  # no keys: off unless asked
    assert Server(served, settings=ServeSettings(limits=ServeLimits(rate_limit=0)), keys=keys
                  ).settings.limits.rate_limit == 0  # asked for none: none
    client = TestClient(create_app(keyed))
    assert client.get("/v1/models", headers={"authorization": f"Bearer {key}"}).status_code == 200
    for _ in range(ServeLimits().rate_burst):  # the Gate's buckets: the burst, taken at once
        keyed.rates.take("query", "app")
    refused = client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
    assert refused.status_code == 429 and "50 requests/s for app" in refused.json()["error"]["message"]


def test_the_flags_are_generated_with_their_defaults_stated():
    import argparse

    from flows.cli_serve import add_serve_parsers

    parser = argparse.ArgumentParser()
    add_serve_parsers(parser.add_subparsers())
    serve = parser.parse_args(["serve"])
    assert serve.limit_rate_limit is None and serve.limit_max_in_flight == 32 and serve.http_docs is False
    flags = parser.parse_args(["serve", "--rate-limit", "0", "--max-in-flight", "4", "--docs",
                               "--allowed-hosts", "api.example", "--trusted-proxies", "10.0.0.1"])
    assert (flags.limit_rate_limit, flags.limit_max_in_flight, flags.http_docs) == (0.0, 4, True)
    sub = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("serve"))
    text = " ".join(sub.format_help().split())
    assert f"(default {KEYED_RATE_LIMIT:g} with --api-keys, else 0)" in text and "--max-in-flight" in text
    assert "--trusted-proxies" in text and "--allowed-hosts" in text

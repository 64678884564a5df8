"""Hot swap and the event guarantee of rlmill serve, on a registered model (two copies of the
built-in model published as versions) with a real redis-server and uvicorn.

The swap moment is made deterministic by a gate in front of the old version's engine: a request
is held inside generate() while the test promotes the next version and waits for the server to
report it; no step waits on a sleep guess."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from gpu_jobs.online.app import Server, ServeSettings
from gpu_jobs.online.broker import STREAM, EventPublisher
from gpu_jobs.online.model import ModelSource
from tests.servers import free_port, stop_process

REPO = Path(__file__).resolve().parents[2]
ASK = {"model": "arith", "prompt": "12+34=", "max_tokens": 4, "temperature": 0}
BOUND_S = 120  # every wait below gives up after this long, naming what it waited for


def wait_for(condition, what: str, timeout_s: float = BOUND_S):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout_s} s waiting for {what}")
        time.sleep(0.02)
    return value


def publish_version(root: Path, version: str, *, broken: bool = False, promote: bool = True) -> None:
    """models/arith/versions/<version>: a copy of the built-in model (without its weights when
    `broken`: a promoted folder that cannot load), then CURRENT -> version."""
    from gpu_jobs.models import resolve_model_path
    from storage import ModelLayout

    layout = ModelLayout(str(root), "arith")
    shutil.copytree(resolve_model_path("builtin"), layout.version(version))
    if broken:
        for weights in Path(layout.version(version)).glob("*.safetensors"):
            weights.unlink()
    if promote:
        layout.promote(version)


class GatedEngine:
    """The real engine behind a gate: generate() says it was entered, then waits for the test to
    open the gate; close() is recorded (the hf engine has nothing to free)."""

    def __init__(self, engine):
        self.engine = engine
        self.entered, self.release, self.closed = threading.Event(), threading.Event(), threading.Event()

    def generate(self, prompts, n, sampling):
        self.entered.set()
        if not self.release.wait(BOUND_S):
            raise TimeoutError("the test never opened the gate of the old version's engine")
        return self.engine.generate(prompts, n, sampling)

    def close(self) -> None:
        self.closed.set()


def metric(base: str, name: str) -> float:
    lines = dict(line.split() for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines())
    return float(lines[name])


def version_of_events(redis_url: str) -> dict[str, str]:
    import redis

    events = [json.loads(fields[b"event"]) for _, fields in redis.Redis.from_url(redis_url).xrange(STREAM)]
    return {e["answer_id"]: e["version"] for e in events if e["kind"] == "answer"}


@pytest.fixture
def registered(tmp_path):
    import torch

    torch.set_num_threads(1)  # two cores shared with other test sessions
    publish_version(tmp_path, "v1")
    return tmp_path


def test_swap_under_requests_in_flight(registered, redis_url, run_app):
    source = ModelSource("arith", str(registered))
    served = source.load()
    gate = served.engine = GatedEngine(served.engine)
    server = Server(served, EventPublisher(redis_url), ServeSettings(watch_s=0.05, event_wait_ms=60_000),
                    source=source)
    out: dict[str, httpx.Response] = {}
    with run_app(server) as base:
        def ask(key: str, body: dict, path: str = "/v1/completions") -> None:
            out[key] = httpx.post(f"{base}{path}", json=body, timeout=BOUND_S)

        plain = threading.Thread(target=ask, args=("plain", ASK))
        plain.start()
        wait_for(gate.entered.is_set, "the first request to enter v1's generate")
        chat = {"model": "arith", "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 4,
                "temperature": 0, "stream": True}
        streamed = threading.Thread(target=ask, args=("streamed", chat, "/v1/chat/completions"))
        streamed.start()
        wait_for(lambda: server.models.current.in_flight == 2, "the streaming request to be queued on v1")

        publish_version(registered, "v2")
        wait_for(lambda: httpx.get(f"{base}/health", timeout=30).json()["version"] == "v2", "/health to show v2")
        after = httpx.post(f"{base}/v1/completions", json=ASK, timeout=BOUND_S)  # v2 answers, v1 still busy
        assert after.status_code == 200 and after.json()["system_fingerprint"] == "arith@v2"
        assert after.headers["x-rlmill-event"] == "logged"
        assert httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["version"] == "v2"
        assert plain.is_alive() and streamed.is_alive() and not gate.closed.is_set()  # v1 is not cut
        assert metric(base, "rlmill_serve_retiring") == 1 and metric(base, "rlmill_serve_in_flight") == 2

        gate.release.set()
        plain.join(BOUND_S)
        streamed.join(BOUND_S)
        wait_for(gate.closed.is_set, "v1's engine to be closed once its requests were done")
        assert metric(base, "rlmill_serve_swaps_total") == 1 and metric(base, "rlmill_serve_retiring") == 0
        assert metric(base, 'rlmill_serve_info{model="arith",version="v2"}') == 1
    server.close()

    assert out["plain"].status_code == 200 and out["plain"].json()["system_fingerprint"] == "arith@v1"
    assert out["plain"].json()["choices"][0]["text"] == after.json()["choices"][0]["text"] == "46"
    chunks = [json.loads(x[len("data: "):]) for x in out["streamed"].text.split("\n\n")
              if x.startswith("data: ") and x != "data: [DONE]"]
    assert out["streamed"].status_code == 200 and {c["system_fingerprint"] for c in chunks} == {"arith@v1"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "46"
    versions = version_of_events(redis_url)  # each event names the version that produced the answer
    assert versions == {out["plain"].json()["id"]: "v1", chunks[0]["id"]: "v1", after.json()["id"]: "v2"}


def test_a_version_that_does_not_load_keeps_the_old_one(registered, run_app, caplog):
    source = ModelSource("arith", str(registered))
    server = Server(source.load(), None, ServeSettings(watch_s=0.05), source=source)
    with run_app(server) as base:
        publish_version(registered, "v2", broken=True)
        wait_for(lambda: metric(base, "rlmill_serve_swap_failures_total") == 1, "the failed load of v2 to be counted")
        polls = metric(base, "rlmill_serve_watch_polls_total")
        r = httpx.post(f"{base}/v1/completions", json=ASK, timeout=BOUND_S)
        assert r.status_code == 200 and r.json()["system_fingerprint"] == "arith@v1"
        assert httpx.get(f"{base}/health", timeout=30).json()["version"] == "v1"
        # CURRENT still says v2: later polls read it and do not load it again
        wait_for(lambda: metric(base, "rlmill_serve_watch_polls_total") >= polls + 3, "three more polls of CURRENT")
        assert metric(base, "rlmill_serve_swap_failures_total") == 1 and metric(base, "rlmill_serve_swaps_total") == 0
        lines = [rec.getMessage() for rec in caplog.records if "does not load" in rec.getMessage()]
        assert len(lines) == 1 and "\n" not in lines[0] and "still serving v1" in lines[0], lines

        publish_version(registered, "v3")  # CURRENT moves again: a good version is taken
        wait_for(lambda: httpx.get(f"{base}/health", timeout=30).json()["version"] == "v3", "/health to show v3")
        assert metric(base, "rlmill_serve_swaps_total") == 1
    server.close()


def test_cli_serve_watches_current_and_answers_only_logged(registered, redis_url):
    """`rlmill serve --watch-s` swaps to a newly promoted version, and an answer that came back
    is in the stream even when the server is SIGKILLed the moment it arrives."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--model", "arith", "--root", str(registered),
                             "--redis", redis_url, "--port", str(port), "--watch-s", "0.1"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"

    def health() -> dict | None:
        assert proc.poll() is None, proc.stdout.read()
        try:
            return httpx.get(f"{base}/health", timeout=5).json()
        except httpx.HTTPError:
            return None

    try:
        assert wait_for(health, "rlmill serve to answer /health")["version"] == "v1"
        first = httpx.post(f"{base}/v1/completions", json=ASK, timeout=BOUND_S)
        publish_version(registered, "v2")
        wait_for(lambda: health()["version"] == "v2", "rlmill serve --watch-s 0.1 to swap to v2")
        last = httpx.post(f"{base}/v1/completions", json=ASK, timeout=BOUND_S)
        os.kill(proc.pid, signal.SIGKILL)  # the moment the answer is in hand: nothing gets to flush
        output = proc.communicate(timeout=30)[0]
    finally:
        stop_process(proc)
    assert proc.returncode == -signal.SIGKILL
    assert first.headers["x-rlmill-event"] == last.headers["x-rlmill-event"] == "logged"
    assert "rlmill: now serving arith version v2 (was v1" in output, output
    assert version_of_events(redis_url) == {first.json()["id"]: "v1", last.json()["id"]: "v2"}

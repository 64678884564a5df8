"""Client mistakes are 4xx in OpenAI's shape, checked before anything is logged or generated: token
ids out of the vocabulary, indices past an answer's choices or int32, oversized bodies (by
Content-Length and as a chunked body streams in, with /health answering meanwhile), too many
characters or messages, a full engine queue (429) and a missed deadline (504)."""

from __future__ import annotations

import dataclasses
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from gpu_jobs.online.app import Server, ServeSettings, create_app
from gpu_jobs.online.limits import ServeLimits
from tests.serve.conftest import Capture

COMPLETION = {"prompt": "12+34=", "max_tokens": 4, "temperature": 0}


class Held:
    """An engine that holds each generate call until `go` is set."""

    def __init__(self, engine):
        self.engine, self.go, self.entered = engine, threading.Event(), threading.Event()

    def generate(self, prompts, n, sampling):
        self.entered.set()
        self.go.wait(60)
        return self.engine.generate(prompts, n, sampling)


def _error(r, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"], err
    assert param == "any" or err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def app(served):
    server = Server(served, Capture(), ServeSettings(limits=ServeLimits(max_body_bytes=4000, max_prompt_chars=500,
                                                                        max_messages=3)))
    yield server, TestClient(create_app(server))
    server.close()


def test_bounds_before_anything_is_logged(app):
    server, client = app
    for ids in ([-1], [99999999], [5, 2**40]):
        assert "vocabulary" in _error(client.post("/v1/completions", json={"prompt": ids}), 400, "prompt")["message"]
    many = [{"role": "user", "content": "hi"}] * 4
    assert "at most 3" in _error(client.post("/v1/chat/completions", json={"messages": many}), 400,
                                 "messages")["message"]
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 501}]}), 400,
           "messages")
    _error(client.post("/v1/completions", json={"prompt": "x" * 501}), 400, "prompt")
    _error(client.post("/v1/completions", json={"prompt": "1+1=", "seed": 2**64}), 400, "seed")
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "root", "content": "x"}]}), 400)
    assert not server.publisher.events  # nothing above reached the log
    one = client.post("/v1/completions", json=COMPLETION).json()["id"]
    two = client.post("/v1/completions", json={**COMPLETION, "n": 2}).json()["id"]
    for body, param in (({"answer_id": two, "preferred_over": one, "preferred_over_index": 2**31, "score": 1},
                         "preferred_over_index"),
                        ({"answer_id": two, "preferred_over": one, "preferred_over_index": 1, "score": 1},
                         "preferred_over_index"),
                        ({"answer_id": two, "index": 2, "score": 1}, "index"),
                        ({"answer_id": two, "index": 2**31, "score": 1}, "index")):
        _error(client.post("/v1/feedback", json=body), 422, param)
    assert client.post("/v1/feedback", json={"answer_id": one, "preferred_over": two, "preferred_over_index": 1,
                                             "score": 1}).status_code == 200
    assert [e["kind"] for e in server.publisher.events] == ["answer", "answer", "feedback"]


def test_body_cap_by_length_and_as_it_streams(app):
    _, client = app
    big = {"prompt": "x" * 5000}
    assert "4000 bytes" in _error(client.post("/v1/completions", json=big), 413)["message"]

    def chunks():
        for _ in range(10):
            yield b" " * 1000  # no Content-Length: the cap applies as the body arrives

    _error(client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    _error(client.post("/v1/completions", content=b"{}", headers={"content-length": "x2"}), 400)
    _error(client.post("/v1/completions", content=b"[" * 3000, headers={"content-type": "application/json"}), 400)
    _error(client.get("/v1/nothing-here"), 404)
    _error(client.get("/v1/completions"), 405)


def test_health_answers_while_a_100_mb_body_arrives(served, run_app):
    server = Server(served, None)  # the default cap, 1 MB
    health: list[int] = []
    with run_app(server) as base, httpx.Client(base_url=base, timeout=60) as probe:
        def body():  # 100 MB in 1 MB chunks; between chunks, /health must answer
            for i in range(100):
                if i % 10 == 1:
                    health.append(probe.get("/health").status_code)
                yield b"1" * (1 << 20)

        declared = httpx.post(f"{base}/v1/completions", content=body(), timeout=60,
                              headers={"content-length": str(100 << 20), "content-type": "application/json"})
        assert declared.status_code == 413  # refused by its Content-Length, before a byte was read
        health.clear()
        try:
            streamed = httpx.post(f"{base}/v1/completions", content=body(), timeout=60,
                                  headers={"content-type": "application/json"}).status_code
        except httpx.TransportError:  # the server answered 413 and closed while the client was writing
            streamed = None
        assert streamed in (413, None)
        assert probe.get("/health").status_code == 200
    server.close()
    assert health and set(health) == {200}, health


def test_a_full_queue_is_429_and_a_missed_deadline_504(served, run_app):
    held = Held(served.engine)
    model = dataclasses.replace(served, engine=held)  # no close(): the shared engine stays open
    server = Server(model, None, ServeSettings(max_batch=1, limits=ServeLimits(max_queue=1, request_timeout_s=0)))
    got: dict[str, int] = {}
    with run_app(server) as base:
        def ask(name: str) -> None:
            got[name] = httpx.post(f"{base}/v1/completions", json=COMPLETION, timeout=60).status_code

        first = threading.Thread(target=ask, args=("first",))
        first.start()
        assert held.entered.wait(30)  # the first is in the engine
        second = threading.Thread(target=ask, args=("second",))
        second.start()
        batcher = server.models.current.batcher
        deadline = time.monotonic() + 30
        while batcher.waiting() < 1 and time.monotonic() < deadline:  # the second waits in the queue
            time.sleep(0.01)
        full = httpx.post(f"{base}/v1/completions", json=COMPLETION, timeout=60)
        held.go.set()
        first.join(60)
        second.join(60)
    assert _error(full, 429)["type"] == "rate_limit_error" and full.headers["retry-after"] == "1"
    assert got == {"first": 200, "second": 200}
    server.close()

    held = Held(served.engine)
    server = Server(dataclasses.replace(served, engine=held), None,
                    ServeSettings(limits=ServeLimits(request_timeout_s=0.2)))
    try:
        late = TestClient(create_app(server)).post("/v1/completions", json=COMPLETION)
    finally:
        held.go.set()
    assert _error(late, 504)["type"] == "timeout_error" and len(server.answers) == 0
    server.close()

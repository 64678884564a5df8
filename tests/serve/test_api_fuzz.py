"""Hypothesis fuzz over request bodies (1,100 hostile inputs, derandomized): raw bytes, any JSON
value, and valid requests with one field replaced by something hostile, to every endpoint of the
API over the built-in model (real engine, its context cut to 64 tokens so an accepted request
generates little). A client's mistake is never a 5xx and every error has OpenAI's shape."""

from __future__ import annotations

import dataclasses
import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_jobs.online.app import Server, ServeSettings, create_app
from gpu_jobs.online.limits import ServeLimits

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/feedback")


def fuzz(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

HOSTILE_SCALARS = st.sampled_from([
    None, True, False, 0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**40,
    0.5, -0.0, 1e308, -1e308, float("nan"), float("inf"), float("-inf"), "", " ", "\x00", "\ud800", "\u202e",
    "x" * 3000, "../../etc/passwd", "builtin", "up", "down", "user", "assistant", "text", [], {}, [[]], [-1],
    [99999999], [0] * 40, ["a", "b"], [{"type": "image_url"}], {"include_usage": "yes"}, {"type": "text"},
])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40) | HOSTILE_SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20)
# Values a field could well hold: they take a request past validation into the engine and the log
PLAUSIBLE = (st.integers(-2, 70) | st.floats(-1, 3) | st.text(max_size=20) | st.lists(st.integers(0, 98), max_size=8)
             | st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=4) | st.booleans())


def _bases(answers: list[str]) -> dict[str, dict]:
    return {
        "/v1/completions": {"model": "builtin", "prompt": "1+2=", "max_tokens": 2, "temperature": 0, "n": 1,
                            "stop": ["\n"], "user": "u", "seed": 1, "stream": False},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 2,
                                 "top_p": 0.9, "top_k": 5, "session_id": "s"},
        "/v1/feedback": {"answer_id": answers[0], "index": 0, "score": 0.5, "thumbs": "up",
                         "preferred_over": answers[1], "preferred_over_index": 0, "text": "ok", "user": "u"},
    }


@pytest.fixture(scope="module")
def fuzzed(served):
    model = dataclasses.replace(served, max_context=64)  # an accepted request generates a few tokens at most
    server = Server(model, None, ServeSettings(limits=ServeLimits(max_body_bytes=20_000, max_prompt_chars=2000)))
    client = TestClient(create_app(server), raise_server_exceptions=False)
    answers = [client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 2, "n": 2}).json()["id"]
               for _ in range(2)]
    yield client, _bases(answers), answers
    server.close()


def _check(r, path: str) -> None:
    assert r.status_code < 500, (path, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code, err
        assert isinstance(err["message"], str) and "\n" not in err["message"]
    elif path == "/v1/feedback":
        assert r.json()["object"] == "feedback"
    elif "text/event-stream" in r.headers.get("content-type", ""):
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"], r.text[:300]


@fuzz(300)
@given(path=st.sampled_from(PATHS), body=st.binary(max_size=400),
       content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]))
def test_raw_bytes(fuzzed, path, body, content_type):
    client, _, _ = fuzzed
    _check(client.post(path, content=body, headers={"content-type": content_type} if content_type else {}), path)


@fuzz(300)
@given(path=st.sampled_from(PATHS), value=JSON)
def test_any_json_value(fuzzed, path, value):
    client, _, _ = fuzzed
    body = json.dumps(value, allow_nan=True)  # NaN and Infinity as Python's json writes them
    _check(client.post(path, content=body, headers={"content-type": "application/json"}), path)


@fuzz(500)
@given(data=st.data(), path=st.sampled_from(PATHS))
def test_one_hostile_field(fuzzed, data, path):
    client, bases, answers = fuzzed
    body = dict(bases[path])
    for _ in range(data.draw(st.integers(0, 2))):
        key = data.draw(st.sampled_from([*body, "logprobs", "tools", "presence_penalty", "max_completion_tokens",
                                         "stream_options", "extra"]))
        body[key] = data.draw(HOSTILE_SCALARS | JSON | PLAUSIBLE | st.sampled_from(answers))
    if data.draw(st.booleans()) and path != "/v1/feedback":  # a hostile message among good ones
        body["messages"] = [{"role": "user", "content": "1+2="},
                            data.draw(st.dictionaries(st.sampled_from(["role", "content", "name"]), HOSTILE_SCALARS,
                                                      max_size=3))]
    _check(client.post(path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"}),
           path)

"""Bounded work per request (issue 61 item 5): a tool schema outside the stated JSON Schema subset is
a 400 naming the keyword and its path (the $defs/allOf bomb and the backtracking pattern among
them), a model's call nested past the parsers' limits is a malformed call (never RecursionError),
the argument checks run in their own executor within a deadline, a principal's burst past its
in-flight cap is its own 429 while others are served, a request whose client left or whose
deadline passed is dropped from the queue, and a flood of made-up answer ids costs one scan of
each stretch of the stream, not one per id."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from gpu_jobs.chat.hermes import CallError, call_text, openai_tool, parse_calls
from gpu_jobs.chat.json_schema import schema_problem, validate
from gpu_jobs.online.app import Server, create_app
from gpu_jobs.online.tools import shape_checked

CALC = openai_tool("calculator", "Exact arithmetic", {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})


def _defs_bomb(levels: int = 32) -> dict:
    """2.3 KB that cost a full validator 2^levels steps: each level is allOf [$ref, $ref] to the last."""
    defs = {"d0": {"type": "string"}}
    for i in range(1, levels + 1):
        defs[f"d{i}"] = {"allOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"$ref": f"#/$defs/d{i - 1}"}]}
    return {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{levels}"}}, "$defs": defs}


REGEX_BOMB = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^(.*)*\u0000$"}}}


@pytest.mark.parametrize("schema, keyword, path", [
    (_defs_bomb(), "$defs", "#"),
    (REGEX_BOMB, "pattern", "#/properties/x"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}}, "anyOf", "#/properties/a"),
    ({"type": "array", "items": {"type": "object", "patternProperties": {".*": {}}}}, "patternProperties",
     "#/items"),
    ({"if": {"type": "string"}, "then": {"maxLength": 3}}, "if", "#"),
    ({"type": "string", "format": "date-time"}, "format", "#"),
])
def test_a_schema_outside_the_subset_is_refused_by_keyword_and_path(schema, keyword, path):
    problem = schema_problem(schema)
    assert problem is not None and f"keyword {keyword!r} at {path} is not supported" in problem, problem
    deep: dict = {"type": "string"}
    for _ in range(17):
        deep = {"type": "object", "properties": {"x": deep}}
    assert "nested more than 16" in schema_problem(deep)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2001)}}
    assert "more than 2000" in schema_problem(wide)
    assert "must be true or false" in schema_problem({"additionalProperties": {"type": "string"}})


def test_the_bombs_are_400s_naming_the_keyword(served):
    server = Server(served, None)
    client = TestClient(create_app(server))
    base = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 2}
    for schema, keyword, path in ((_defs_bomb(), "$defs", "#"), (REGEX_BOMB, "pattern", "#/properties/x")):
        for stream in (False, True):
            r = client.post("/v1/chat/completions", json={**base, "stream": stream,
                                                          "tools": [openai_tool("f", "", schema)]})
            assert r.status_code == 400, r.text[:300]
            err = r.json()["error"]
            assert err["param"].startswith("tools") and f"'{keyword}' at {path}" in err["message"], err
    assert client.post("/v1/chat/completions", json={**base, "tools": [CALC]}).status_code == 200
    server.close()


def test_the_subset_checks_what_it_states():
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 1, "exclusiveMaximum": 10},
                             "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "minLength": 1}},
                             "mode": {"type": ["string", "null"], "enum": ["a", None]}}}
    assert schema_problem(schema) is None
    assert validate({"n": 3, "tags": ["x"], "mode": None}, schema) is None
    assert validate({"n": 2.0}, schema) is None  # 2.0 is an integer in JSON Schema
    for value, says in (({}, "'n' is a required property"), ({"n": True}, "n: True is not of type 'integer'"),
                        ({"n": 0}, "n: 0 is less than the minimum of 1"),
                        ({"n": 10}, "n: 10 is greater than or equal to the maximum of 10"),
                        ({"n": 1, "tags": ["a", "b", "c"]}, "tags: ['a', 'b', 'c'] is too long"),
                        ({"n": 1, "tags": [""]}, "tags/0: '' is too short"),
                        ({"n": 1, "mode": "b"}, "mode: 'b' is not one of ['a', None]"),
                        ({"n": 1, "x": 1}, "Additional properties are not allowed ('x' was unexpected)")):
        assert validate(value, schema) == says, value
    many = {"type": "array", "items": {"type": "integer"}}
    assert "too large to check" in validate(list(range(1000)), many, max_steps=100)


def test_calls_nested_past_the_parsers_limit_are_malformed_not_recursion_errors():
    tools = {"calculator": CALC}
    for text in ("<tool_call>" + "[" * 100_000 + "</tool_call>", "<tool_call>" + "[" * 100_000,
                 '<tool_call>{"name": "calculator", "arguments": "' + "[" * 5000 + '"}</tool_call>',
                 call_text("calculator", {"expression": "1+" * 1000 + "1"})):
        found = parse_calls(text, tools)
        assert len(found) == 1, text[:40]
    assert isinstance(parse_calls("<tool_call>" + "[" * 100_000 + "</tool_call>", tools)[0], CallError)
    deep = {"type": "object", "properties": {"a": {"enum": [[[[1]]]]}}}
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    assert validate({"a": nested}, deep) is not None  # a comparison past the limit: a violation, said


def test_argument_checks_have_a_deadline():
    """The checks run in the executor they are given; when it is busy past the deadline the
    answer stays text and its calls count as malformed, and the choices are not changed later."""
    gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(gate.wait, 30)  # the only worker is busy
        choices = [{"index": 0, "text": call_text("calculator", {"expression": "1"}), "finish_reason": "stop"}]
        assert asyncio.run(shape_checked(choices, [CALC], True, pool, deadline_s=0.05)) == (1, 0)
        gate.set()
    assert "tool_calls" not in choices[0] and choices[0]["finish_reason"] == "stop"
    with ThreadPoolExecutor(1) as pool:
        assert asyncio.run(shape_checked(choices, [CALC], True, pool)) == (0, 0)
    assert choices[0]["finish_reason"] == "tool_calls"


def _model(served, engine):
    from types import SimpleNamespace

    model = SimpleNamespace(**{k: getattr(served, k) for k in ("name", "version", "tokenizer", "max_context",
                                                               "vocab", "path")}, engine=engine)
    model.close = lambda: None
    return model


def _until(what: str, check, seconds: float = 60) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.02)


def test_a_callers_burst_is_its_own_429_while_others_are_served(served, run_app):
    import secrets

    import httpx

    from gpu_jobs.online.app import ServeSettings
    from gpu_jobs.online.auth import ApiKeys
    from gpu_jobs.online.limits import ServeLimits
    from tests.serve.test_api_limits import COMPLETION, Held

    keys = {f"sk-{secrets.token_urlsafe(24)}": {"principal": p, "roles": ["query"]} for p in ("burst", "other")}
    by = {spec["principal"]: key for key, spec in keys.items()}
    held = Held(served.engine)
    server = Server(_model(served, held), None, ServeSettings(max_batch=1, limits=ServeLimits(
        max_in_flight=2, max_queue=16, request_timeout_s=0)), keys=ApiKeys.parse(keys))
    got: dict[str, int] = {}
    with run_app(server) as base:
        def ask(name: str, who: str) -> None:
            got[name] = httpx.post(f"{base}/v1/completions", json=COMPLETION, timeout=60,
                                   headers={"authorization": f"Bearer {by[who]}"}).status_code

        first = threading.Thread(target=ask, args=("burst-1", "burst"))
        first.start()
        assert held.entered.wait(30)
        second = threading.Thread(target=ask, args=("burst-2", "burst"))
        second.start()
        _until("the second request in the queue", lambda: server.models.current.batcher.waiting() == 1)
        over = httpx.post(f"{base}/v1/completions", json=COMPLETION, timeout=60,
                          headers={"authorization": f"Bearer {by['burst']}"})
        other = threading.Thread(target=ask, args=("other", "other"))
        other.start()
        _until("the other caller's request in the queue", lambda: server.models.current.batcher.waiting() == 2)
        held.go.set()
        for t in (first, second, other):
            t.join(60)
    assert over.status_code == 429 and "--max-in-flight" in over.json()["error"]["message"], over.text
    assert over.headers["retry-after"] == "1"
    assert got == {"burst-1": 200, "burst-2": 200, "other": 200}
    assert server.in_flight._held == {}  # every place given back
    server.close()


def test_a_queued_request_whose_client_left_is_never_generated(served, run_app):
    import httpx

    from gpu_jobs.online.app import ServeSettings
    from gpu_jobs.online.limits import ServeLimits
    from tests.serve.test_api_limits import COMPLETION, Held

    held = Held(served.engine)
    server = Server(_model(served, held), None, ServeSettings(max_batch=1, limits=ServeLimits(request_timeout_s=0)))
    with run_app(server) as base:
        first = threading.Thread(target=lambda: httpx.post(f"{base}/v1/completions", json=COMPLETION, timeout=60))
        first.start()
        assert held.entered.wait(30)
        batcher = server.models.current.batcher

        def leave() -> None:  # the client gives up while its request waits in the queue
            with httpx.Client(timeout=httpx.Timeout(60, read=0.5)) as client:
                with pytest.raises(httpx.ReadTimeout):
                    client.post(f"{base}/v1/completions", json={**COMPLETION, "prompt": "9+9="})
        leave()
        _until("the server to see the client leave", lambda: server.counts["client_gone"] == 1)
        held.go.set()
        first.join(60)
        _until("the first request served", lambda: batcher.stats()["requests"] == 1)
    assert batcher.stats()["requests"] == 1 and batcher.stats()["batches"] == 1  # the second never ran
    assert server.in_flight._held == {}
    server.close()


def test_a_running_stream_whose_client_left_stops_at_the_next_step(served, run_app):
    import httpx

    from tests.serve.test_streaming import Held as StepHeld

    held = StepHeld(served.engine)
    server = Server(_model(served, held), None)
    body = {"prompt": "12+34=", "max_tokens": 200, "temperature": 0, "stream": True}  # "46", then EOS
    with run_app(server) as base:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            next(ln for ln in r.iter_lines() if ln.startswith("data: "))  # the first token arrived
        # the client closed the stream; the engine is held after its first step
        batcher = server.models.current.batcher
        _until("the stream's request dropped", lambda: batcher.stats()["dropped_running"] == 1)
        held.release.set()
        _until("the generate call stopped", lambda: batcher.stats()["stopped_calls"] == 1)
    assert batcher.stats()["requests"] == 0 and server.counts["answers"] == 0  # nothing finished or logged
    server.close()


def test_a_flood_of_made_up_answer_ids_reads_each_minute_once(redis_url):
    """Feedback naming made-up ids inside the window: the stream is read once per minute of it
    (the id index), an id asked again is answered from the negative cache, a real answer is still
    found, and lookups past MAX_PENDING are a 429. XRANGE calls counted by redis-server itself."""
    import time

    import redis

    from gpu_jobs.online import recall as recall_module
    from gpu_jobs.online.answers import new_answer_id
    from gpu_jobs.online.protocol import ApiError
    from gpu_jobs.online.recall import AnswerRecall
    from gpu_jobs.online.wire import encode

    client = redis.Redis.from_url(redis_url)
    now = time.time()
    real = new_answer_id("chatcmpl", now - 120)
    event = {"kind": "answer", "answer_id": real, "created": now - 120, "model": "m", "version": "v1",
             "choices": [{"index": 0}, {"index": 1}]}
    client.xadd("rlmill:events", encode(event))

    def xranges() -> int:
        return int(client.info("commandstats").get("cmdstat_xrange", {}).get("calls", 0))

    recall = AnswerRecall(redis_url, None, "m")
    fakes = [new_answer_id("chatcmpl", now - 120 + i * 0.01) for i in range(200)]
    assert all(recall.find(f) is None for f in fakes)
    minutes = xranges()
    assert minutes <= (recall_module.SCAN_BEFORE_S + recall_module.SCAN_AFTER_S) / 60 + 2, minutes
    found = recall.find(real)
    assert found is not None and found.n_choices == 2 and xranges() == minutes  # from the index
    assert asyncio.run(recall.find_async(fakes[0])) is None and recall.reads["misses_cached"] == 1

    gate = threading.Event()
    recall.find = lambda answer_id: gate.wait(30)  # a store that hangs: the lookups pile up

    async def flood():
        waiting = [asyncio.ensure_future(recall.find_async(new_answer_id("chatcmpl", now - 5 - i)))
                   for i in range(recall_module.MAX_PENDING)]
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as refused:
            await recall.find_async(new_answer_id("chatcmpl", now - 1))
        gate.set()
        await asyncio.gather(*waiting)
        return refused.value

    assert asyncio.run(flood()).status == 429
    recall.close()

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

"""`stream: true` with `tools`, and `parallel_tool_calls: false`, on /v1/chat/completions.

The incremental splitter (streaming.ToolText, final_deltas) is checked on hand-made pieces of
text: what goes out while the model writes, and that the deltas add up to the non-streamed
message. The server is checked through the real `openai` client against a scripted engine that
writes Hermes calls one character per decoding step over the built-in tokenizer (the built-in
model never writes a call): the streamed answer, accumulated from its chunks, is the
non-streamed one, and so are their logged events."""

from __future__ import annotations

import asyncio
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from gpu_jobs.models import build_tokenizer
from gpu_jobs.online.app import Server
from gpu_jobs.online.protocol import _message
from gpu_jobs.online.streaming import ToolText, final_deltas
from gpu_jobs.online.tools import judge_checked, shape_choices
from gpu_jobs.chat.hermes import openai_tool
from tests.serve.conftest import Capture

CALC = openai_tool("calculator", "Exact arithmetic", {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
WEATHER = openai_tool("get_weather", "Weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]})
TOOLS = [CALC, WEATHER]
# Hermes calls without line breaks: the built-in tokenizer has no "\n" (parse_calls takes either).
CALL_1 = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>'
CALL_2 = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'
BAD = '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'  # an unknown tool: malformed
# What the scripted model writes, by the prompt's text (the built-in template shows user turns only).
SCRIPTS = {"calls": f"Let me work that out. {CALL_1} {CALL_2}", "bad": f"Sure. {BAD} then more", "plain": "46 is it"}
CUT = SCRIPTS["calls"].index(CALL_2) + 20  # max_tokens that cut inside the second call, the first closed


def _accumulate(deltas: list[dict]) -> tuple[str | None, list[dict], str | None]:
    """(content, tool_calls, finish_reason) of one choice's chat deltas, as a client adds them up."""
    content, calls, finish = "", {}, None
    for d in deltas:
        body = d.get("delta") or {}
        content += body.get("content") or ""
        for t in body.get("tool_calls") or ():
            call = calls.setdefault(t["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = t.get("id") or call["id"]
            call["name"] += (t.get("function") or {}).get("name") or ""
            call["arguments"] += (t.get("function") or {}).get("arguments") or ""
        finish = d.get("finish_reason") or finish
    return content or None, [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("pieces, reason, live", [
    # a tag split across pieces, after text: the text goes out, the call waits for the end
    (["Let", " me", " <to", "ol_c", "all>", '{"name": "calculator", "arguments": {"expression": "1"}}', "</tool",
      "_call>"], "stop", ["Let", " me", "", "", "", "", "", ""]),
    (["1 <", "2"], "stop", ["1", " <2"]),  # what looked like a tag's start was text
    (["A", " " + CALL_1, " B ", CALL_2], "stop", ["A", "", "", ""]),  # two calls, text between them
    (["x ", "<tool_call>", '{"name": "calculator"'], "length", ["x", "", ""]),  # unclosed: cut at max_tokens
    # a malformed block makes the answer text: everything held goes out at once, the rest as it comes
    (["ok ", BAD, " more"], "stop", ["ok", " " + BAD, " more"]),
    ([CALL_1, CALL_1.replace("123*456", "1")], "stop", ["", ""]),  # calls only: content null
])
def test_the_splitter_adds_up_to_the_non_streamed_answer(pieces, reason, live):
    tok = build_tokenizer()
    with ThreadPoolExecutor(1) as pool:
        stream = ToolText(functools.partial(judge_checked, tools=TOOLS, executor=pool))

        async def feed():
            return [await stream.add(p) for p in pieces]
        assert asyncio.run(feed()) == live
    text = "".join(pieces)
    choice = {"index": 0, "text": text, "token_ids": tok.encode(text, add_special_tokens=False),
              "logprobs": [], "finish_reason": reason}
    shape_choices([choice], TOOLS)
    content, calls, finish = _accumulate([{"delta": {"content": stream.sent}}]
                                         + final_deltas("chat", choice, stream.sent, tok))
    message = _message(choice)
    assert (content, finish) == (message["content"] or None, choice["finish_reason"])
    assert calls == [{"id": c["id"], **c["function"]} for c in message.get("tool_calls") or ()]
    assert len(stream.judged) == text.count("</tool_call>")  # each closed block judged once


class Scripted:
    """A model that writes SCRIPTS[prompt] one character per decoding step, reporting each step
    as the hf engine does (streams_tokens), then EOS; cut at max_tokens ("length")."""

    streams_tokens = True

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompts, n, sampling, on_tokens=None):
        outs = []
        for p in prompts:
            ids = self.tok.encode(SCRIPTS[self.tok.decode(p)], add_special_tokens=False) + [self.tok.eos_token_id]
            outs.append(ids[:sampling.max_response_length])
        for step in range(max(map(len, outs))):
            rows = [i * n + j for i, out in enumerate(outs) if step < len(out) for j in range(n)]
            if on_tokens is not None:
                on_tokens(rows, [outs[r // n][step] for r in rows])
        return [{"prompt_index": i, "sample_index": j, "prompt_ids": list(p), "response_ids": out,
                 "rollout_logprobs": [-0.1] * len(out),
                 "finish_reason": "stop" if out[-1] == self.tok.eos_token_id else "length"}
                for i, (p, out) in enumerate(zip(prompts, outs)) for j in range(n)]


@pytest.fixture
def scripted():
    tok = build_tokenizer()
    model = SimpleNamespace(name="builtin", version="v1", tokenizer=tok, max_context=4096, vocab=len(tok), path=None,
                            engine=Scripted(tok), close=lambda: None)
    server = Server(model, Capture())
    yield server
    server.close()


def _streamed(client, **kw) -> tuple[list, tuple]:
    """The chunks of a streamed request and its choice 0 accumulated (content, calls, finish)."""
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].model_dump() for c in chunks if c.choices]
    return deltas, _accumulate(deltas)


def _plain(answer) -> tuple:
    m = answer.choices[0].message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or ()]
    return m.content, calls, answer.choices[0].finish_reason


def _same_answer(streamed: tuple, plain: tuple) -> None:
    """Equal but for the calls' ids, which each answer draws afresh."""
    strip = lambda calls: [{k: v for k, v in c.items() if k != "id"} for c in calls]  # noqa: E731
    assert (streamed[0], strip(streamed[1]), streamed[2]) == (plain[0], strip(plain[1]), plain[2])
    assert all(c["id"].startswith("call_") for c in streamed[1] + plain[1])


def _events_match(events: list[dict]) -> None:
    """The logged choices of a non-streamed and a streamed request: the same, ids aside."""
    def strip(e):
        return [{**c, "tool_calls": [{k: v for k, v in t.items() if k != "id"} for t in c.get("tool_calls") or ()]}
                for c in e["choices"]]
    assert len(events) == 2 and strip(events[0]) == strip(events[1])


def test_a_streamed_answer_with_tools_is_the_non_streamed_one(scripted, run_app):
    import openai

    with run_app(scripted) as base:
        client = openai.OpenAI(api_key="none", base_url=f"{base}/v1", max_retries=0)
        for prompt, max_tokens in (("calls", 400), ("bad", 400), ("calls", CUT), ("plain", 400)):
            kw = dict(model="builtin", messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                      max_tokens=max_tokens, temperature=0)
            plain = _plain(client.chat.completions.create(**kw))
            deltas, streamed = _streamed(client, **kw)
            _same_answer(streamed, plain)
            _events_match(scripted.publisher.events[-2:])
            content = [d["delta"]["content"] for d in deltas if d["delta"].get("content")]
            if prompt == "calls" and max_tokens == 400:  # text first, then the calls, nothing of them as text
                assert plain[2] == "tool_calls" and [c["name"] for c in plain[1]] == ["calculator", "get_weather"]
                assert plain[0] == "Let me work that out." and not any("<" in p for p in content)
                first_call = next(i for i, d in enumerate(deltas) if d["delta"].get("tool_calls"))
                assert deltas[first_call]["delta"]["tool_calls"][0]["function"] == {"name": "calculator",
                                                                                   "arguments": ""}
                assert first_call > max(i for i, d in enumerate(deltas) if d["delta"].get("content"))
                assert len(content) > 5  # sent as it came, piece by piece
            elif prompt == "calls":  # cut inside the second call: text, the engine's finish reason
                assert plain[2] == "length" and not plain[1] and plain[0] == SCRIPTS["calls"][:CUT]
            elif prompt == "bad":
                assert plain[0] == SCRIPTS["bad"] and not plain[1] and plain[2] == "stop"
        metrics = httpx.get(f"{base}/metrics").text
    assert "rlmill_serve_tool_calls_total 4" in metrics  # 2 calls, non-streamed and streamed
    assert "rlmill_serve_malformed_tool_calls_total 4" in metrics  # "bad" twice, the cut call twice


def test_parallel_tool_calls_false_returns_the_first_call(scripted, run_app):
    import openai

    two = [{"index": 0, "text": SCRIPTS["calls"], "finish_reason": "stop"}]
    assert shape_choices(two, TOOLS, parallel=False) == (0, 1)
    assert [c["function"]["name"] for c in two[0]["tool_calls"]] == ["calculator"]
    with run_app(scripted) as base:
        client = openai.OpenAI(api_key="none", base_url=f"{base}/v1", max_retries=0)
        kw = dict(model="builtin", messages=[{"role": "user", "content": "calls"}], tools=TOOLS, max_tokens=400,
                  temperature=0, parallel_tool_calls=False)
        plain = _plain(client.chat.completions.create(**kw))
        _, streamed = _streamed(client, **kw)
        both = _plain(client.chat.completions.create(**{**kw, "parallel_tool_calls": True}))
        metrics = httpx.get(f"{base}/metrics").text
    _same_answer(streamed, plain)
    assert [c["name"] for c in plain[1]] == ["calculator"] and json.loads(plain[1][0]["arguments"]) == {
        "expression": "123*456"}
    assert plain[0] == both[0] and plain[2] == "tool_calls" and len(both[1]) == 2
    assert "rlmill_serve_dropped_tool_calls_total 2" in metrics and "rlmill_serve_tool_calls_total 4" in metrics
    # the event keeps what the model wrote (both calls, for training) and the one call returned
    event = scripted.publisher.events[0]["choices"][0]
    assert event["text"] == SCRIPTS["calls"] and len(event["tool_calls"]) == 1

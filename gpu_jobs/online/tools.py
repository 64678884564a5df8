"""OpenAI tools on the served chat API: the request's `tools`, `tool_choice`,
`parallel_tool_calls` and tool-call messages (bounded), and the Hermes calls in the model's
answer returned as OpenAI's `tool_calls`.

    tools = [{"type": "function", "function": {"name": "calculator", "description": "Exact arithmetic",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
    ids = hermes.render_chat(messages, tokenizer, tools)      # the prompt's token ids
    shape_choice(hermes.call_text("calculator", {"expression": "2*3"}), "stop", tools)
    # -> ([{"id": "call_...", "type": "function", "function": {...}}], 0 malformed, 0 dropped)

The prompt is rendered by gpu_jobs.chat.hermes.render_chat, the renderer training renders a
dataset row with, so serving and training show a model the same tokens. An answer's calls are the Hermes blocks of its text: all well formed
(a known tool, arguments valid against its JSON schema) and the engine stopped on its own ->
`tool_calls`, finish_reason "tool_calls", content the text outside them (or None); any malformed
-> the text as content, the engine's finish_reason, and the malformed calls counted. With
`parallel_tool_calls: false` only the first of several well-formed calls is returned; the others
are dropped (counted; the text logged for training keeps them, as the model wrote them).

The same bounds (tool count, names, schema size and depth, calls per message, id and arguments
length) check a request (a 400 naming the field) and an answer event on the stream (quarantine).
A schema is of the subset gpu_jobs.chat.json_schema states (type, properties, required, enum,
items, description/title/default, minimum/maximum/exclusive bounds, minLength/maxLength,
minItems/maxItems, additionalProperties true/false); any other keyword ($ref, $defs, allOf,
anyOf, oneOf, pattern, patternProperties, if/then, format, ...) is a 400 naming it and its path.
The model's calls are checked against it off the event loop, in the server's check executor,
within CHECK_DEADLINE_S (shape_checked, judge_checked); a check is linear in the arguments' size
and stops after json_schema.MAX_STEPS steps anyway.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpu_jobs.chat import json_schema
from gpu_jobs.chat.hermes import Call, parse_calls

__all__ = ["MAX_CALLS", "MAX_TOOLS", "TOOL_CHOICES", "ToolCall", "ToolSpec", "calls_problem", "content_of",
           "judge_checked", "message_problem", "schema_problem", "shape_checked", "shape_choice", "shape_choices",
           "tools_problem", "well_formed"]

NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function name
_NAME = re.compile(NAME)
MAX_TOOLS = 64  # tools in one request
MAX_TOOL_CHARS = 16_384  # one tool's JSON
MAX_TOOLS_CHARS = 131_072  # all the tools' JSON together
MAX_DESCRIPTION = 4096
MAX_SCHEMA_DEPTH = json_schema.MAX_SCHEMA_DEPTH  # nesting of a tool's parameters
CHECK_DEADLINE_S = 2.0  # one answer's argument checks, in the check executor; past it the calls are text
MAX_CALLS = 16  # tool calls in one message or one answer
MAX_CALL_ID = 128
MAX_ARGUMENTS_CHARS = 100_000
TOOL_CHOICES = ("auto", "none")
MESSAGE_FIELDS = {"role", "content", "tool_calls", "tool_call_id"}
_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


# ------------------------------------------------------------------ bounds (requests and events)
def schema_problem(schema: Any) -> str | None:
    """Why `schema` cannot be a tool's parameters, or None: a schema of the subset
    gpu_jobs.chat.json_schema states (type, properties, required, enum, items, bounds,
    additionalProperties true/false, annotations), at most MAX_SCHEMA_DEPTH deep; any other
    keyword ($ref, allOf, pattern, ...) is refused by name and path. Linear in the schema's size."""
    return json_schema.schema_problem(schema)


def tools_problem(tools: Any) -> str | None:
    """Why `tools` (a list of OpenAI tool dicts) break the bounds, or None."""
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        return f"tools is not a list of 1 to {MAX_TOOLS} tools"
    names = set()
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or t.get("type") != "function" or set(t) - {"type", "function"}:
            return 'a tool is not {"type": "function", "function": {...}}'
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name) or name in names:
            return f"tool name {_short(name)} is not distinct or not 1-64 letters, digits, '_' or '-'"
        names.add(name)
        if len(json.dumps(t, default=str)) > MAX_TOOL_CHARS:
            return f"tool {name}: more than {MAX_TOOL_CHARS} characters of JSON"
        if f.get("parameters") is not None and (problem := schema_problem(f["parameters"])) is not None:
            return f"tool {name}: {problem}"
    if len(json.dumps(tools, default=str)) > MAX_TOOLS_CHARS:
        return f"tools: more than {MAX_TOOLS_CHARS} characters of JSON"
    return None


def calls_problem(calls: Any) -> str | None:
    """Why `calls` (OpenAI's tool_calls of one message or answer) break the bounds, or None."""
    if not isinstance(calls, list) or not calls or len(calls) > MAX_CALLS:
        return f"tool_calls is not a list of 1 to {MAX_CALLS} calls"
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or set(c) != {"id", "type", "function"} or c["type"] != "function":
            return 'a tool call is not {"id", "type": "function", "function": {"name", "arguments"}}'
        if not isinstance(c["id"], str) or not 0 < len(c["id"]) <= MAX_CALL_ID:
            return f"tool call id {_short(c['id'])} is not text of 1 to {MAX_CALL_ID} characters"
        if set(f) != {"name", "arguments"} or not isinstance(f["name"], str) or not _NAME.match(f["name"]):
            return f"tool call function {_short(f)} is not {{name, arguments}} with a valid name"
        if not isinstance(f["arguments"], str) or len(f["arguments"]) > MAX_ARGUMENTS_CHARS:
            return f"tool call arguments are not text of at most {MAX_ARGUMENTS_CHARS} characters"
    return None


def message_problem(m: Any) -> str | None:
    """Why a logged chat message is not {role, content[, tool_calls][, tool_call_id]}, or None."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return "a chat message without a role"
    if unknown := sorted(set(m) - MESSAGE_FIELDS):
        return f"unknown message field(s) {', '.join(_short(k) for k in unknown[:5])}"
    if m.get("content") is not None and not isinstance(m["content"], str):
        return "a chat message whose content is not text"
    if m.get("tool_calls") is not None and (problem := calls_problem(m["tool_calls"])) is not None:
        return problem
    call_id = m.get("tool_call_id")
    if call_id is not None and (not isinstance(call_id, str) or len(call_id) > MAX_CALL_ID):
        return f"tool_call_id is not text of at most {MAX_CALL_ID} characters"
    return None


def _short(value: Any, most: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= most else text[:most] + f"...({len(text)} chars)"


# ------------------------------------------------------------------ request models
class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v):
        if v is not None and (problem := schema_problem(v)) is not None:
            raise ValueError(problem)
        return v


class ToolSpec(BaseModel):
    """One of a request's `tools`: {"type": "function", "function": {name, description, parameters}}."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class CallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME)
    arguments: str = Field(max_length=MAX_ARGUMENTS_CHARS)

    @field_validator("arguments")
    @classmethod
    def _json(cls, v):
        try:
            json.loads(v, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            raise ValueError("arguments must be a JSON text (OpenAI sends them as a string)") from None
        return v


class ToolCall(BaseModel):
    """One of an assistant message's `tool_calls`, as a client sends the conversation back."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=MAX_CALL_ID)
    type: Literal["function"] = "function"
    function: CallFunction


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


# ------------------------------------------------------------------ answers
def shape_choice(text: str, finish_reason: str | None, tools: list[dict],
                 parallel: bool = True) -> tuple[list[dict] | None, int, int]:
    """(tool_calls in OpenAI's shape or None, malformed calls, calls dropped) of one answer's
    text: calls only when the engine stopped on its own and every `<tool_call>` block is well
    formed; with `parallel` False (OpenAI's parallel_tool_calls: at most one call per answer) the
    first call only, the others dropped and counted."""
    try:
        found = parse_calls(text, {t["function"]["name"]: t for t in tools})
    except Exception:  # noqa: BLE001 -- a schema jsonschema cannot apply ($ref to nowhere): malformed
        return None, max(1, text.count("<tool_call>")), 0
    bad = sum(not isinstance(c, Call) for c in found)
    if not found or bad or finish_reason != "stop" or len(found) > MAX_CALLS:
        return None, bad, 0
    kept = found if parallel else found[:1]
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for c in kept], 0, len(found) - len(kept)


def well_formed(block: str, tools: list[dict]) -> bool:
    """Whether one closed `<tool_call>` block would count as well formed in shape_choice (a
    stream uses it to know, as soon as a block closes, that the answer will be text)."""
    try:
        return all(isinstance(c, Call) for c in parse_calls(block, {t["function"]["name"]: t for t in tools}))
    except Exception:  # noqa: BLE001 -- as in shape_choice: a schema jsonschema cannot apply
        return False


def content_of(text: str) -> str | None:
    """An answer's content beside its calls: the text outside the `<tool_call>` blocks, without
    the whitespace at its end (the line breaks before the calls), or None. Its start is kept: a
    stream sends the text before the first call as it comes (streaming.ToolText)."""
    return _BLOCK.sub("", text).rstrip() or None


def shape_choices(choices: list[dict], tools: list[dict], parallel: bool = True) -> tuple[int, int]:
    """Add `tool_calls` (and finish_reason "tool_calls") to the choices whose text holds well
    formed calls (in place); returns (malformed calls, calls dropped by parallel False)."""
    malformed = dropped = 0
    for c in choices:
        calls, bad, extra = shape_choice(c["text"], c["finish_reason"], tools, parallel)
        malformed, dropped = malformed + bad, dropped + extra
        if calls:
            c["tool_calls"], c["finish_reason"] = calls, "tool_calls"
    return malformed, dropped


async def shape_checked(choices: list[dict], tools: list[dict], parallel: bool, executor: Any,
                        deadline_s: float = CHECK_DEADLINE_S) -> tuple[int, int]:
    """shape_choices with its argument checks in `executor`, off the event loop, within
    `deadline_s`: past it the answer stays text and each of its `<tool_call>` blocks counts as
    malformed. The choices change on the event loop only, after the checks returned."""
    loop = asyncio.get_running_loop()
    work = [(c["text"], c["finish_reason"]) for c in choices]
    try:
        shaped = await asyncio.wait_for(loop.run_in_executor(
            executor, lambda: [shape_choice(text, reason, tools, parallel) for text, reason in work]), deadline_s)
    except TimeoutError:
        return sum(max(1, text.count("<tool_call>")) for text, _ in work), 0
    for c, (calls, _, _) in zip(choices, shaped):
        if calls:
            c["tool_calls"], c["finish_reason"] = calls, "tool_calls"
    return sum(bad for _, bad, _ in shaped), sum(extra for _, _, extra in shaped)


async def judge_checked(block: str, tools: list[dict], executor: Any, deadline_s: float = CHECK_DEADLINE_S) -> bool:
    """well_formed(block, tools) in `executor` within `deadline_s` (past it: not well formed)."""
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.run_in_executor(executor, well_formed, block, tools), deadline_s)
    except TimeoutError:
        return False

"""OpenAI-style tools in the Hermes text format (the one Qwen2.5's chat template writes):
the `# Tools` system section, the one writer and parser of `<tool_call>` blocks, argument
checks, and a conversation with OpenAI `tool_calls` and `tool` results rendered through a chat
template (render_chat). Pure functions. `rlmill serve` renders its requests with render_chat and
training renders a dataset row with it (gpu_jobs.stages.run: a served agent's row, its `tools`
column), so a model sees the same tokens in either.

    >>> from gpu_jobs.chat.hermes import openai_tool, parse_calls
    >>> calc = openai_tool("calculator", "Exact arithmetic", {"type": "object",
    ...     "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
    >>> parse_calls('<tool_call>\\n{"name": "calculator", "arguments": {"expression": "2*3"}}\\n</tool_call>',
    ...             {"calculator": calc})
    [Call(name='calculator', arguments={'expression': '2*3'})]
    >>> parse_calls('<tool_call>{"name": "calc"}</tool_call>', {"calculator": calc})[0].message
    "error: unknown tool 'calc'; tools: calculator"

The format, as Qwen2.5's template writes it: the system turn ends with a `# Tools` section that
lists each tool's JSON schema inside `<tools></tools>`, one per line; a model calls a tool with
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (several calls in one turn are
several such blocks), and a result comes back as `<tool_response>\\n...\\n</tool_response>` in a
user turn (consecutive results share one turn).

    >>> call_text("calculator", {"expression": "2*3"})
    '<tool_call>\\n{"name": "calculator", "arguments": {"expression": "2*3"}}\\n</tool_call>'
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["TAG", "Call", "CallError", "call_text", "check_arguments", "hermes_messages", "native_message",
           "openai_tool", "parse_calls", "render_chat", "render_chats", "tool_response", "tooled", "tools_section"]

TAG = "<tool_call>"  # what opens a call in the model's text

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class Call:
    """A well-formed call: a known tool, arguments that satisfy its schema."""

    name: str
    arguments: Any


@dataclass(frozen=True)
class CallError:
    """A call the model got wrong; `message` goes back to it as the call's result."""

    message: str


def openai_tool(name: str, description: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A tool as OpenAI's `tools=[...]` lists it: {"type": "function", "function": {...}}."""
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": dict(parameters)}}


def tools_section(tools: list[dict[str, Any]], system: str | None = None) -> str:
    """The system turn's text with the `# Tools` section appended (after `system` and a blank
    line when there is one), for chat templates that have no tool section of their own.

    >>> tools_section([openai_tool("f", "d", {"type": "object"})]).splitlines()[0]
    '# Tools'
    """
    schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    section = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
               f"{schemas}\n</tools>\n\nFor each function call, return a json object with function name and "
               "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    return f"{system}\n\n{section}" if system else section


def tool_response(results: list[str]) -> str:
    """The content of the user turn that carries `results` back, one `<tool_response>` each.

    >>> tool_response(["579"])
    '<tool_response>\\n579\\n</tool_response>'
    """
    return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


def call_text(name: str, arguments: Any) -> str:
    """One call as Qwen2.5's template writes it (and a Hermes model samples it): the block
    parse_calls reads back as Call(name, arguments). The only writer of the format, so rendered
    conversations and test fixtures cannot drift from what the parser and the template expect."""
    body = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {json.dumps(arguments, ensure_ascii=False)}}}'
    return f"{TAG}\n{body}\n</tool_call>"


def tooled(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether a conversation needs the tool renderings below: tools offered, an assistant
    message with `tool_calls`, or a `tool` result; anything else renders as plain chat."""
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def _arguments(arguments: Any) -> Any:
    """A call's arguments as an object: OpenAI's messages carry them as JSON text."""
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def native_message(m: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message for a chat template with a tool section of its own: the calls'
    arguments as objects (Hugging Face's convention; the templates `tojson` them)."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
            "name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
            for c in m["tool_calls"]]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """Plain {role, content} messages for a chat template without a tool section, as Qwen2.5's
    writes a tool conversation: the `# Tools` section in the system turn (one is added when there
    is none), an assistant's calls as call_text blocks after its text, and each run of `tool`
    results as one user turn (tool_response).

    >>> hermes_messages([{"role": "tool", "content": "6"}], None)
    [{'role': 'user', 'content': '<tool_response>\\n6\\n</tool_response>'}]
    """
    out: list[dict[str, str]] = []
    results: list[str] = []
    for m in messages:
        if m["role"] == "tool":
            results.append(m.get("content") or "")
            continue
        if results:
            out.append({"role": "user", "content": tool_response(results)})
            results = []
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], _arguments(c["function"]["arguments"]))
                              for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m["role"], "content": content})
    if results:
        out.append({"role": "user", "content": tool_response(results)})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": tools_section(tools, out[0]["content"] or None)}
        else:
            out.insert(0, {"role": "system", "content": tools_section(tools)})
    return out


def _native(tokenizer: Any, tools: list[dict[str, Any]]) -> bool:
    """Whether the chat template has a tool section of its own (its text changes with tools=)."""
    probe = [{"role": "user", "content": "\x1fPROBE\x1f"}]  # a content no real conversation holds
    with_tools = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, tools=tools)
    return with_tools != tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)


def render_chat(messages: Any, tokenizer: Any, tools: Any = None, max_prompt_length: int | None = None) -> list[int]:
    """The prompt's token ids (generation prompt added) of a conversation with tools, as the
    rollout's hermes format shows them: a template with a tool section of its own gets `tools=`
    and the messages as OpenAI sends them (native_message); any other gets hermes_messages. A
    conversation without tools, calls or results renders as gpu_jobs.data.render_prompt does.

    `messages`: a prompt cell (OpenAI messages; a dataset row's, see
    gpu_jobs.data.rendering.conversation_messages); `tools`: OpenAI tool dicts, their JSON text
    (a row's `tools` column) or None. Raises gpu_jobs.data.OverlongPromptError past
    `max_prompt_length` tokens."""
    from gpu_jobs.data.rendering import OverlongPromptError, conversation_messages, render_prompt, row_tools

    msgs, tools = conversation_messages(messages), row_tools(tools)
    if not tooled(msgs, tools):
        return render_prompt(msgs, tokenizer, max_prompt_length)
    if tools and _native(tokenizer, tools):
        # Rendered to text, then encoded: how the rollout's hermes turns tokenize a native prompt.
        text = tokenizer.apply_chat_template([native_message(m) for m in msgs], tokenize=False,
                                             add_generation_prompt=True, tools=tools)
        ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    else:
        ids = render_prompt(hermes_messages(msgs, tools), tokenizer)
    if max_prompt_length is not None and len(ids) > max_prompt_length:
        raise OverlongPromptError(f"prompt renders to {len(ids)} tokens > max_prompt_length={max_prompt_length}")
    return ids


def render_chats(prompts: list[Any], tokenizer: Any, tools: list[Any] | None = None) -> list[list[int]]:
    """render_chat of many prompts (`tools`: each one's, or None for none), no length limit; the
    plain chats through one batched chat-template call (gpu_jobs.data.render_many)."""
    from gpu_jobs.data.rendering import conversation_messages, render_many, row_tools

    each = list(tools) if tools is not None else [None] * len(prompts)
    if len(each) != len(prompts):
        raise ValueError(f"render_chats: {len(prompts)} prompts but {len(each)} tools cells")
    plain = [i for i, (p, t) in enumerate(zip(prompts, each)) if not tooled(conversation_messages(p), row_tools(t))]
    out: list[list[int]] = [[] for _ in prompts]
    for i, ids in zip(plain, render_many([prompts[i] for i in plain], tokenizer)):
        out[i] = ids
    for i in sorted(set(range(len(prompts))) - set(plain)):
        out[i] = render_chat(prompts[i], tokenizer, each[i])
    return out


def parse_calls(text: str, tools: Mapping[str, dict[str, Any]]) -> list[Call | CallError]:
    """Every `<tool_call>` block of one assistant turn, in order: a Call, or a CallError saying
    what is wrong (unclosed block, not JSON, no name, unknown tool, arguments against the
    schema). `tools` maps a name to its OpenAI tool dict. No block: [] (a final answer)."""
    out: list[Call | CallError] = []
    for m in _CALL.finditer(text):
        if not m.group(2):
            out.append(CallError("error: <tool_call> is not closed by </tool_call>"))
            continue
        out.append(_one_call(m.group(1), tools))
    return out


def _one_call(body: str, tools: Mapping[str, dict[str, Any]]) -> Call | CallError:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # `[` x 1000 is nested past json's recursion limit
        return CallError(f"error: the tool call is not valid JSON ({_why(e)})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return CallError('error: a tool call is {"name": <function-name>, "arguments": <args-json-object>}')
    name, args = obj["name"], obj.get("arguments", {})
    if name not in tools:
        return CallError(f"error: unknown tool {name[:64]!r}; tools: {', '.join(sorted(tools))}")
    if isinstance(args, str):  # OpenAI's wire format sends arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError) as e:
            return CallError(f"error: arguments of {name!r} are not valid JSON ({_why(e)})")
    problem = check_arguments(args, tools[name]["function"].get("parameters") or {"type": "object"})
    return CallError(f"error: {name}: {problem}") if problem else Call(name, args)


def _why(exc: Exception) -> str:
    return "nested too deep" if isinstance(exc, RecursionError) else " ".join(str(exc).split())[:200]


def check_arguments(arguments: Any, schema: Mapping[str, Any]) -> str | None:
    """None when `arguments` satisfy the tool's JSON schema, else the first violation as one
    line. The schema must be of the subset gpu_jobs.chat.json_schema states (its check is then
    linear and bounded); one outside it is the violation, named.

    >>> check_arguments({"x": 1}, {"type": "object", "required": ["y"]})
    "'y' is a required property"
    """
    from gpu_jobs.chat.json_schema import schema_problem, validate

    if (problem := schema_problem(schema)) is not None:
        return f"the tool's schema cannot be checked: {problem}"
    return validate(arguments, dict(schema))

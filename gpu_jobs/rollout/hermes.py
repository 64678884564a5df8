"""OpenAI-style tools in the Hermes text format (the one Qwen2.5's chat template writes):
the `# Tools` system section, `<tool_call>` parsing and argument checks. Pure functions.

    >>> from gpu_jobs.rollout.hermes import openai_tool, parse_calls
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
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["Call", "CallError", "openai_tool", "tools_section", "tool_response", "parse_calls",
           "check_arguments"]

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
    except ValueError as e:
        return CallError(f"error: the tool call is not valid JSON ({e})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return CallError('error: a tool call is {"name": <function-name>, "arguments": <args-json-object>}')
    name, args = obj["name"], obj.get("arguments", {})
    if name not in tools:
        return CallError(f"error: unknown tool {name!r}; tools: {', '.join(sorted(tools))}")
    if isinstance(args, str):  # OpenAI's wire format sends arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError as e:
            return CallError(f"error: arguments of {name!r} are not valid JSON ({e})")
    problem = check_arguments(args, tools[name]["function"].get("parameters") or {"type": "object"})
    return CallError(f"error: {name}: {problem}") if problem else Call(name, args)


def check_arguments(arguments: Any, schema: Mapping[str, Any]) -> str | None:
    """None when `arguments` satisfy the JSON schema, else the most relevant violation as one
    line (jsonschema's best match).

    >>> check_arguments({"x": 1}, {"type": "object", "required": ["y"]})
    "'y' is a required property"
    """
    import jsonschema

    validator_cls = jsonschema.validators.validator_for(schema)
    error = jsonschema.exceptions.best_match(validator_cls(schema).iter_errors(arguments))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message

"""Tools a model may call during a multi-turn rollout: which exist, their OpenAI schemas, and
running a batch of calls (built-ins here, users' tools in the sandbox).

    >>> from gpu_jobs.chat.tools import ToolSet, get_tool_format
    >>> get_tool_format("brackets").parse_call("[calculator(1234+5678)]")
    ('calculator', '1234+5678')
    >>> ToolSet(["calculator"]).run([("calculator", "1234+5678"), ("calculator", {"expression": "2*3"})])
    ['6912', '6']
    >>> ToolSet(["calculator"]).schemas()["calculator"]["function"]["parameters"]["required"]
    ['expression']

A tool is named by a built-in name (the TOOLS registry: `calculator`, exact arithmetic over an
AST, never `eval`) or `path/to/file.py:function`. Arguments are the call's text (`brackets`
format) or its JSON object (`hermes`). A user's tool runs in the sandbox's worker processes
(gpu_jobs.reward.sandbox, entry gpu_jobs.chat.tool_worker.call_tool) with a time limit per
call, so a hung or crashing tool costs one call, answered with an error text, never the rollout.
A built-in that raises (a calculator call nested past Python's recursion limit) is answered the
same way: every call's answer is text, never an exception.
Tools can also come from verl's tool YAML (`load_tool_config`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

# The call format and the built-in tools are plain text functions, shared with the data and model
# packages below this one.
from gpu_jobs.data.tool_calls import TOOL_FORMATS, TOOLS, ToolFormat, calculator, get_tool_format, register_tool
from gpu_jobs.chat.hermes import openai_tool
from gpu_jobs.chat.tool_worker import tool_error, truncate_text

__all__ = ["TOOLS", "TOOL_FORMATS", "ToolFormat", "ToolSet", "ToolEntry", "calculator", "get_tool_format",
           "check_tool_spec", "register_tool", "load_tool_config", "BUILTIN_SCHEMAS"]

# Each built-in takes one string: its schema names that parameter.
BUILTIN_SCHEMAS: dict[str, tuple[dict[str, Any], str]] = {
    "calculator": (openai_tool("calculator", "Exact value of an arithmetic expression: + - * / // % ** and "
                               "parentheses, e.g. 12*(3+4).",
                               {"type": "object", "properties": {"expression": {
                                   "type": "string", "description": "The expression, e.g. 123*456"}},
                                "required": ["expression"]}), "expression"),
}


# -------------------------------------------------------------------------------- specs
def check_tool_spec(spec: str, check_files: bool = True) -> str:
    """A tool spec is a registered name or `path/to/file.py:function`; raises ValueError saying
    how to fix it."""
    if ":" not in spec:
        if spec not in TOOLS:
            raise ValueError(f"unknown tool {spec!r}: use one of {sorted(TOOLS)} or 'path/to/file.py:function'")
        return spec
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        raise ValueError(f"tool {spec!r}: a user tool is 'path/to/file.py:function_name'")
    if check_files and "://" not in path and not os.path.isfile(path):
        raise ValueError(f"tool file {path!r} does not exist (relative paths start at {os.getcwd()})")
    return spec


def tool_name(spec: str) -> str:
    """The name a model calls a tool by: the registered name, or a user tool's function name."""
    return spec.rpartition(":")[2]


@dataclass(frozen=True)
class ToolEntry:
    """One tool of a run: the name the model calls, its implementation (`spec`), its OpenAI
    schema (None: a user tool named without one, usable in the brackets format only) and
    keyword arguments added to every call."""

    name: str
    spec: str
    schema: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)


def entry_of(spec: str) -> ToolEntry:
    """The ToolEntry of a spec named in `multi_turn.tools` (a built-in gets its schema)."""
    return ToolEntry(tool_name(spec), spec, BUILTIN_SCHEMAS.get(spec, (None, ""))[0])


def load_tool_config(path: str, check_files: bool = True) -> list[ToolEntry]:
    """The tools of verl's tool YAML (`rollout.multi_turn.tool_config_path`):

        tools:
          - class_name: path/to/my_tools.py:lookup     # or a built-in name: calculator
            config: {type: native, table: en}          # keywords of every call (verl's `type` dropped)
            tool_schema: {type: function, function: {name: lookup, description: ..., parameters: {...}}}

    Raises ValueError naming the key at fault; a verl class name (verl.tools....) is refused:
    rlmill runs a Python function by path, not verl's tool classes."""
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    items = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items:
        raise ValueError(f"rollout.multi_turn.tool_config_path {path!r}: expected a 'tools:' list")
    return [_config_entry(item, f"rollout.multi_turn.tool_config_path: tools[{i}]", check_files)
            for i, item in enumerate(items)]


def _config_entry(item: Any, where: str, check_files: bool) -> ToolEntry:
    if not isinstance(item, dict) or not isinstance(item.get("class_name"), str):
        raise ValueError(f"{where}: each tool needs class_name, tool_schema (and optionally config)")
    spec = item["class_name"]
    if ":" not in spec and spec not in TOOLS:
        raise ValueError(f"{where}.class_name {spec!r} is a verl tool class, which rlmill does not have: name "
                         f"'path/to/file.py:function' or a built-in tool ({', '.join(sorted(TOOLS))})")
    check_tool_spec(spec, check_files)
    schema = item.get("tool_schema")
    fn = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}.tool_schema: expected {{type: function, function: {{name, description, "
                         "parameters}}}}")
    config = {k: v for k, v in (item.get("config") or {}).items() if k != "type"}  # verl's 'native' marker
    return ToolEntry(fn["name"], spec, {"type": "function", "function": dict(fn)}, config)


# -------------------------------------------------------------------------------- running
class ToolSet:
    """The tools of one run: `run([(name, arguments), ...]) -> [answer text, ...]`, every
    answer cut to `max_output_chars` at `truncate_side`; errors are answers ("error: ...").

    Built-ins run here; user tools run in the sandbox with `timeout_s` per call (one pool start
    per batch of calls, ~0.5 s per worker).
    """

    def __init__(self, tools: Sequence[str | ToolEntry], timeout_s: float = 10.0, num_workers: int = 2,
                 max_output_chars: int = 1 << 20, truncate_side: str = "middle"):
        entries = [t if isinstance(t, ToolEntry) else entry_of(check_tool_spec(t)) for t in tools]
        self.entries = {e.name: e for e in entries}
        if len(self.entries) != len(entries):
            raise ValueError(f"two tools share a name in {[e.name for e in entries]}: each needs its own name")
        self.timeout_s, self.num_workers = timeout_s, num_workers
        self.max_output_chars, self.truncate_side = max_output_chars, truncate_side

    def schemas(self) -> dict[str, dict[str, Any]]:
        """name -> OpenAI tool dict; raises ValueError for a tool that has none."""
        missing = [n for n, e in self.entries.items() if e.schema is None]
        if missing:
            raise ValueError(f"tools {missing} have no JSON schema: the hermes format needs one per tool; give "
                             "them in rollout.multi_turn.tool_config_path (verl's tool YAML)")
        return {n: e.schema for n, e in self.entries.items()}  # type: ignore[misc]

    def run(self, calls: Sequence[tuple[str, Any]]) -> list[str]:
        out: list[str] = [""] * len(calls)
        remote: list[int] = []
        for i, (name, args) in enumerate(calls):
            entry = self.entries.get(name)
            if entry is None:
                out[i] = f"error: unknown tool {name!r}; tools: {', '.join(sorted(self.entries))}"
            elif ":" in entry.spec:
                remote.append(i)
            else:
                out[i] = self._builtin(entry, args)
        for i, text in zip(remote, self._run_in_sandbox([calls[i] for i in remote])):
            out[i] = text
        return [truncate_text(t, self.max_output_chars, self.truncate_side) for t in out]

    @staticmethod
    def _builtin(entry: ToolEntry, args: Any) -> str:
        try:
            if isinstance(args, dict):  # a hermes call: the built-in's one string parameter
                args = args.get(BUILTIN_SCHEMAS[entry.spec][1], "")
            return str(TOOLS[entry.spec](str(args), **entry.config))
        except Exception as e:  # e.g. RecursionError on a deep expression: the model's observation
            return tool_error(e)

    def _run_in_sandbox(self, calls: Sequence[tuple[str, Any]]) -> list[str]:
        from gpu_jobs.reward.custom import local_source
        from gpu_jobs.reward.sandbox import Failed, SandboxSpec, run_guarded
        from gpu_jobs.chat import tool_worker

        if not calls:
            return []
        users = {n: (*e.spec.rpartition(":")[::2], e.config) for n, e in self.entries.items() if ":" in e.spec}
        for path, _, _ in users.values():
            local_source(path)  # a storage URL is fetched here: the workers hold no credentials
        spec = SandboxSpec(work=tool_worker.call_tool, timeout_s=self.timeout_s, num_workers=self.num_workers,
                           what="tool call", init=tool_worker.init_tools,
                           init_args=(users, self.max_output_chars, self.truncate_side))
        results, _ = run_guarded(list(calls), spec)
        return [f"error: {r.message}" if isinstance(r, Failed) else str(r) for r in results]

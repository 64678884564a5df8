"""Tools a model may call during a multi-turn rollout, and the text format of calls and answers.

    >>> from gpu_jobs.rollout.tools import ToolSet, get_tool_format
    >>> fmt = get_tool_format("brackets")
    >>> fmt.parse_call("[calculator(1234+5678)]")
    ('calculator', '1234+5678')
    >>> ToolSet(["calculator"]).run([("calculator", "1234+5678")])
    ['6912']
    >>> fmt.render_response("6912"), fmt.final_answer("[calculator(1234+5678)]<6912>6912")
    ('<6912>', '6912')

A tool is `fn(arguments: str) -> str`. Built-in tools live in the TOOLS registry and run in
this process (`calculator`: exact arithmetic over an AST, never `eval`). A user's tool is named
`path/to/file.py:function` and runs in the reward worker pool (gpu_jobs.reward.score_batch),
so a hung or crashing tool costs one call, answered with an error text, never the rollout.
"""

from __future__ import annotations

import ast
import operator
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

from gpu_jobs.registry import Registry

__all__ = ["TOOLS", "TOOL_FORMATS", "ToolFormat", "ToolSet", "calculator", "get_tool_format",
           "check_tool_spec", "register_tool"]

Tool = Callable[[str], str]

TOOLS: Registry = Registry("tool")
register_tool = TOOLS.register
"""Decorator registering a built-in tool `fn(arguments: str) -> str` under a name."""


# -------------------------------------------------------------------------------- formats
@dataclass(frozen=True)
class ToolFormat:
    """How a call looks in a model's turn and how a tool's answer is rendered as a tool turn.

    `call` matches one call, groups (name, arguments); the tool turn is `open + text + close`
    (the two markers are removed from a tool's text so an answer cannot fake a turn boundary).
    """

    call: re.Pattern
    open: str
    close: str

    def parse_call(self, text: str) -> tuple[str, str] | None:
        """(tool name, arguments) of the call in one assistant turn, or None (a final answer)."""
        m = self.call.search(text)
        return (m.group(1), m.group(2)) if m else None

    def render_response(self, text: str) -> str:
        return self.open + text.replace(self.open, "").replace(self.close, "") + self.close

    def final_answer(self, text: str) -> str:
        """What the model wrote after the last tool turn of a decoded response (all of it when no
        tool answered): the reward scores this, never a tool's output."""
        at = text.rfind(self.close)
        return text[at + len(self.close):] if at >= 0 and self.open in text[:at] else text


TOOL_FORMATS: Registry = Registry("tool call format")
# Short markers for a character-level model (every character is a token); the greedy `(.*)`
# keeps nested parentheses inside the arguments: "[calculator((1+2)*3)]".
TOOL_FORMATS.register("brackets")(ToolFormat(re.compile(r"\[([A-Za-z_]\w*)\((.*)\)\]", re.DOTALL), "<", ">"))


def get_tool_format(name: str) -> ToolFormat:
    return TOOL_FORMATS[name]


# -------------------------------------------------------------------------------- calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_DIGITS = 64  # a model can ask for 9**9**9: refuse results (and exponents) this large


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > 256:
                raise ValueError("exponents must be integers of at most 256")
        elif isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        out = _BINARY[type(node.op)](left, right)
        if abs(out.numerator) >= 10 ** _MAX_DIGITS:
            raise ValueError("result too large")
        return Fraction(out)
    raise ValueError(f"unsupported expression element {type(node).__name__}")


@register_tool("calculator")
def calculator(arguments: str) -> str:
    """Exact value of an arithmetic expression (+ - * / // % ** and parentheses), e.g. "12*(3+4)"
    -> "84"; a non-integer result as a decimal with up to 6 places. Errors come back as text."""
    try:
        value = _evaluate(ast.parse(arguments.strip(), mode="eval"))
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e.msg if isinstance(e, SyntaxError) else e}"
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


# -------------------------------------------------------------------------------- user tools
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


class ToolSet:
    """The tools of one run: `run([(name, arguments), ...]) -> [answer text, ...]`.

    Built-ins run here; user tools run in the reward worker pool with `timeout_s` per call
    (one pool start per batch of calls, ~0.5 s per worker).
    """

    def __init__(self, specs: Sequence[str], timeout_s: float = 10.0, num_workers: int = 2):
        self.specs = {tool_name(s): check_tool_spec(s) for s in specs}
        if len(self.specs) != len(specs):
            raise ValueError(f"two tools share a name in {list(specs)}: each needs its own function name")
        self.timeout_s, self.num_workers = timeout_s, num_workers

    def run(self, calls: Sequence[tuple[str, str]]) -> list[str]:
        out: list[str | None] = [None] * len(calls)
        remote: list[int] = []
        for i, (name, args) in enumerate(calls):
            spec = self.specs.get(name)
            if spec is None:
                out[i] = f"error: unknown tool {name!r}; tools: {', '.join(sorted(self.specs))}"
            elif ":" in spec:
                remote.append(i)
            else:
                out[i] = str(TOOLS[spec](args))
        if remote:
            for i, text in zip(remote, self._run_in_pool([calls[i] for i in remote])):
                out[i] = text
        return [str(x) for x in out]

    def _run_in_pool(self, calls: Sequence[tuple[str, str]]) -> list[str]:
        from gpu_jobs.reward import RewardConfig, score_batch
        from gpu_jobs.rollout import tool_worker

        by_spec: dict[str, list[int]] = {}
        for i, (name, _) in enumerate(calls):
            by_spec.setdefault(self.specs[name], []).append(i)
        out = [""] * len(calls)
        for spec, idx in by_spec.items():
            path, _, fn = spec.rpartition(":")
            cfg = RewardConfig(
                custom_reward_function={"path": tool_worker.__file__, "name": "call_tool",
                                        "reward_kwargs": {"tool_path": path, "tool_name": fn}},
                timeout_s=self.timeout_s, num_workers=self.num_workers)
            rows = [{"data_source": "tool", "solution_str": calls[i][1], "ground_truth": ""} for i in idx]
            _, extras, _ = score_batch(rows, cfg)
            for i, extra in zip(idx, extras):
                if "error" in extra:
                    kind = extra.get("error_kind")
                    out[i] = (f"error: tool call took longer than {self.timeout_s:g} s" if kind == "timeout"
                              else f"error: {extra['error']}")
                else:
                    out[i] = str(extra.get("tool_output", ""))
        return out

"""The text of tool calls in a model's turn, and the built-in tools: pure functions, no engine.

    >>> fmt = get_tool_format("brackets")
    >>> fmt.parse_call("[calculator(1234+5678)]")
    ('calculator', '1234+5678')
    >>> calculator("1234+5678"), fmt.render_response("6912")
    ('6912', '<6912>')

Shared by the rollout's agent loop (gpu_jobs.chat.tools runs the tools of a run), the
`arith_tools` task's scorer (gpu_jobs.data.tool_tasks) and the tool model's warm-up
(gpu_jobs.models.tool_model), which is why it sits below all three.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from gpu_jobs.registry import Registry

__all__ = ["TOOLS", "TOOL_FORMATS", "Tool", "ToolFormat", "calculator", "get_tool_format", "register_tool"]

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
    except (RecursionError, MemoryError):  # ~1000 chained terms or nested parentheses
        return "error: expression too long or too deeply nested"
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")

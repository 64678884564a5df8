"""The tool sandbox's entry: what a worker process of gpu_jobs.reward.sandbox runs for one call
of a user's tool (name and arguments in, text out, cut to the output limit).

    >>> init_tools({"rev": ("my_tools.py", "reverse", {})}, max_chars=64, side="middle")  # once per worker
    >>> call_tool(("rev", "abc"))
    'cba'

A tool is `fn(arguments: str)` in the `brackets` format and `fn(**arguments)` (the call's JSON
object) in `hermes`; keyword arguments from the tool's config are added to every call. A
tool's exception comes back as an "error: ..." text, an observation for the model; the
sandbox's timeout and crash handling cover a tool that hangs or kills its process.
"""

from __future__ import annotations

from typing import Any

__all__ = ["call_tool", "init_tools", "tool_error", "truncate_text"]

_TOOLS: dict[str, tuple[Any, dict]] = {}
_LIMITS: dict[str, Any] = {"max_chars": 1 << 20, "side": "middle"}


def truncate_text(text: str, limit: int, side: str) -> str:
    """`text` cut to `limit` characters at `side` ("left" drops the start, "right" the end,
    "middle" the middle, marked with "...").

    >>> truncate_text("abcdefghij", 7, "middle")
    'ab...ij'
    """
    if len(text) <= limit:
        return text
    if side == "left":
        return text[-limit:]
    if side == "right":
        return text[:limit]
    head = max(0, (limit - 3) // 2)
    return text[:head] + "..." + text[len(text) - (limit - 3 - head):] if limit > 3 else text[:limit]


def init_tools(tools: dict[str, tuple[str, str, dict]], max_chars: int, side: str) -> None:
    """Load every user tool (name -> (file path, function name, config keywords)) once per worker."""
    from gpu_jobs.reward import load_custom_reward_function

    for name, (path, fn, config) in tools.items():
        _TOOLS[name] = (load_custom_reward_function(path, fn), dict(config))
    _LIMITS.update(max_chars=max_chars, side=side)


def tool_error(e: BaseException) -> str:
    """The answer a model gets for a call that raised: the exception's type and message, one
    line (the message of a RecursionError or a user's exception may itself be anything)."""
    try:
        message = str(e)
    except Exception:  # an exception whose __str__ raises too
        message = "(its message could not be read)"
    return f"error: {type(e).__name__}: {message}"


def call_tool(call: tuple[str, Any]) -> str:
    """The text of one call (name, arguments) of a loaded tool, cut to the output limit in the
    worker, so an enormous answer never travels back."""
    name, arguments = call
    fn, config = _TOOLS[name]
    try:
        out = fn(**arguments, **config) if isinstance(arguments, dict) else fn(arguments, **config)
        text = str(out)  # a returned object's __str__ is the tool's code too
    except Exception as e:  # the tool's bug is the model's observation, never the rollout's failure
        text = tool_error(e)
    return truncate_text(text, _LIMITS["max_chars"], _LIMITS["side"])

"""Runs a user's tool inside a reward worker process (loaded by gpu_jobs.reward's pool).

The pool calls `call_tool` with verl's reward keywords; the call's arguments travel as
`solution_str` and the tool's answer comes back in the result dict (reward_extra), so a user
tool gets the pool's timeout, crash isolation and restarts without a second pool.
"""

from __future__ import annotations

from typing import Any

_LOADED: dict[tuple[str, str], Any] = {}


def call_tool(data_source: str, solution_str: str, ground_truth: Any = None, extra_info: Any = None, *,
              tool_path: str, tool_name: str) -> dict[str, Any]:
    """{"score": 0.0, "tool_output": str(tool(arguments))}; the score is unused."""
    from gpu_jobs.reward import load_custom_reward_function

    key = (tool_path, tool_name)
    if key not in _LOADED:  # once per worker process
        _LOADED[key] = load_custom_reward_function(tool_path, tool_name)
    return {"score": 0.0, "tool_output": str(_LOADED[key](solution_str))}

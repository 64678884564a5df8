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

import os
from typing import Sequence

# The call format and the built-in tools are plain text functions, shared with the data and model
# packages below this one.
from gpu_jobs.data.tool_calls import TOOL_FORMATS, TOOLS, ToolFormat, calculator, get_tool_format, register_tool

__all__ = ["TOOLS", "TOOL_FORMATS", "ToolFormat", "ToolSet", "calculator", "get_tool_format",
           "check_tool_spec", "register_tool"]


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

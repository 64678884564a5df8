"""Multi-turn rollouts with tools (verl's tool agent loop), over any rollout engine.

    >>> from gpu_jobs.rollout.agent_loop import AgentLoopEngine, MultiTurnConfig
    >>> engine = AgentLoopEngine(get_rollout_engine("hf", path), MultiTurnConfig(enable=True), tokenizer)
    >>> rows = engine.generate(prompt_ids, n=8, sampling=SamplingConfig(max_response_length=40, seed=0))
    >>> rows[0]["response_mask"]     # 1 = the model's token, 0 = a tool turn's

One assistant turn is generated until EOS (the end of a chat model's turn). A turn holding a
tool call ("[calculator(123+456)]" in the built-in `brackets` format) gets the tool's answer
appended as a tool turn ("<579>"), and generation continues from the whole conversation, up to
`max_assistant_turns` turns; a turn without a call is the final answer. Every turn of every
sequence in the batch is generated together, one engine call per turn.

The response is everything after the prompt: model turns (with their EOS) and tool turns, and
`rollout.max_response_length` bounds all of it together (verl's `response_length`). Tool tokens
carry response_mask 0: the trainer leaves them out of the loss. Their `rollout_logprobs` were
not sampled; they are filled with the policy's own log-probs of those tokens, scored by the
engine (`score_tokens`), so every per-token column stays finite and what the trainer recomputes
on them agrees with it (the agreement probe may then include them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from gpu_jobs.rollout.base import SamplingConfig, make_row
from gpu_jobs.rollout.tools import TOOL_FORMATS, ToolSet, check_tool_spec, get_tool_format

__all__ = ["MultiTurnConfig", "AgentLoopEngine", "truncate_text", "with_agent_loop"]

# Each turn draws with its own seed, so turn 2 does not replay turn 1's noise.
_TURN_SEED_STRIDE = 7_919


class MultiTurnConfig(BaseModel):
    """verl's `rollout.multi_turn` section (names follow it; tools are named inline, not in a
    separate tool_config_path file)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable: bool = Field(False, description="Multi-turn rollouts: run the tool calls in the model's turns and "
                         "continue after each tool's answer (validation and ReMax baselines too).")
    max_assistant_turns: int = Field(3, ge=1, description="Most model turns per response; a tool call in the "
                                     "last one is not run.")
    tools: list[str] = Field(default_factory=lambda: ["calculator"], description="Tools the model may call: "
                             "built-in names ('calculator') or 'path/to/file.py:function' (called with the "
                             "argument text, returns the answer text; runs in the reward worker pool).")
    format: str = Field("brackets", description=f"Tool call format: one of {sorted(TOOL_FORMATS)}; 'brackets' = "
                        "call '[name(arguments)]' then EOS, answer '<text>'.")
    max_tool_response_length: int = Field(64, ge=1, description="Most characters of a tool's answer kept in "
                                           "the conversation (verl's name).")
    tool_response_truncate_side: Literal["left", "right", "middle"] = Field(
        "middle", description="Which end of a longer answer to cut: 'left' keeps the end, 'right' the start, "
        "'middle' both ends.")
    tool_timeout_s: float = Field(10.0, gt=0, description="Seconds one user-tool call may take; past it the "
                                  "tool answers with an error text.")
    tool_num_workers: int = Field(2, ge=1, description="Worker processes that run user tools.")

    @field_validator("tools")
    @classmethod
    def _tools_exist(cls, v: list[str], info: ValidationInfo) -> list[str]:
        if not v:
            raise ValueError("name at least one tool, e.g. ['calculator']")
        check_files = (info.context or {}).get("check_files", True)
        return [check_tool_spec(s, check_files) for s in v]

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        if v not in TOOL_FORMATS:
            raise ValueError(f"unknown tool call format {v!r}: use one of {sorted(TOOL_FORMATS)}")
        return v


def truncate_text(text: str, limit: int, side: str) -> str:
    """`text` cut to `limit` characters at `side` ("left" drops the start, "right" the end,
    "middle" the middle, marked with "...")."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[-limit:]
    if side == "right":
        return text[:limit]
    head = max(0, (limit - 3) // 2)
    return text[:head] + "..." + text[len(text) - (limit - 3 - head):] if limit > 3 else text[:limit]


@dataclass
class _Conversation:
    """One response being built: its tokens, per-token log-probs and mask, turns so far."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    turns: int = 0
    last_turn: list[int] = field(default_factory=list)
    tool_calls: int = 0

    def add_model_turn(self, row: dict) -> None:
        self.last_turn = list(row["response_ids"])
        self.response += self.last_turn
        self.logprobs += list(row["rollout_logprobs"])
        self.mask += [1] * len(self.last_turn)
        self.finish_reason, self.turns = row["finish_reason"], self.turns + 1


class AgentLoopEngine:
    """A rollout engine whose `generate` runs multi-turn conversations on an inner engine; rows
    gain `response_mask` and `num_turns`. Weight updates and everything else go to the inner one."""

    def __init__(self, engine: Any, config: MultiTurnConfig, tokenizer: Any):
        self.engine, self.config, self.tokenizer = engine, config, tokenizer
        self.format = get_tool_format(config.format)
        self.tools = ToolSet(config.tools, config.tool_timeout_s, config.tool_num_workers)
        self.last_metrics: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:  # update_weights_partial, close, model, ...
        if "engine" not in self.__dict__:  # half-built (copy, unpickling): no delegation yet
            raise AttributeError(name)
        return getattr(self.__dict__["engine"], name)

    def update_weights(self, weights: Any) -> None:
        self.engine.update_weights(weights)

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list[dict]:
        """See `RolloutEngine.generate`; each row also has response_mask (list[int]) and num_turns."""
        budget = sampling.max_response_length
        convs = []
        for row in self.engine.generate(prompts, n, sampling):
            conv = _Conversation(row["prompt_index"], row["sample_index"], list(row["prompt_ids"]))
            conv.add_model_turn(row)
            convs.append(conv)
        for turn in range(1, self.config.max_assistant_turns):
            active = self._run_tools([c for c in convs if c.finish_reason == "stop"], budget)
            if not active:
                break
            seed = None if sampling.seed is None else sampling.seed + turn * _TURN_SEED_STRIDE
            contexts = [c.prompt_ids + c.response for c in active]
            # One call per distinct remaining budget would batch worse; a shared cap plus a
            # per-row cut keeps one call and the budget exact.
            cap = max(budget - len(c.response) for c in active)
            rows = self.engine.generate(contexts, 1, sampling.model_copy(update={"seed": seed, "max_response_length": cap}))
            for conv, row in zip(active, rows):
                conv.add_model_turn(_cut(row, budget - len(conv.response)))
        self._fill_tool_logprobs(convs, sampling)
        self.last_metrics = _metrics(convs)
        return [self._row(c) for c in convs]

    def _run_tools(self, convs: list[_Conversation], budget: int) -> list[_Conversation]:
        """Run the calls in the last turns of `convs`, append the answers as tool turns; returns
        the conversations that continue (a call and room left after its answer)."""
        calls = []
        for conv in convs:
            call = self.format.parse_call(self.tokenizer.decode(conv.last_turn, skip_special_tokens=True))
            if call is not None:
                calls.append((conv, call))
        answers = self.tools.run([call for _, call in calls])
        active = []
        for (conv, _), answer in zip(calls, answers):
            text = truncate_text(answer, self.config.max_tool_response_length, self.config.tool_response_truncate_side)
            ids = self.tokenizer.encode(self.format.render_response(text), add_special_tokens=False)
            room = budget - len(conv.response)
            conv.tool_calls += 1
            conv.response += ids[:room]
            conv.logprobs += [0.0] * len(ids[:room])
            conv.mask += [0] * len(ids[:room])
            if len(ids) >= room:  # no room left for the model to answer
                conv.finish_reason = "length"
            else:
                active.append(conv)
        return active

    def _fill_tool_logprobs(self, convs: list[_Conversation], sampling: SamplingConfig) -> None:
        """Tool tokens get the policy's log-probs of them (at the sampling temperature)."""
        with_tools = [c for c in convs if 0 in c.mask]
        if not with_tools:
            return
        scores = self.engine.score_tokens([c.prompt_ids + c.response for c in with_tools], sampling.temperature)
        for conv, lp in zip(with_tools, scores):
            start = len(conv.prompt_ids) - 1  # lp[i] is the log-prob of token i + 1
            conv.logprobs = [conv.logprobs[j] if m else float(lp[start + j]) for j, m in enumerate(conv.mask)]

    @staticmethod
    def _row(conv: _Conversation) -> dict:
        row = make_row(conv.prompt_index, conv.sample_index, conv.prompt_ids, conv.response, conv.logprobs,
                       conv.finish_reason)
        row.update(response_mask=[int(m) for m in conv.mask], num_turns=conv.turns)
        return row


def _cut(row: dict, room: int) -> dict:
    """A turn cut to the `room` tokens its conversation has left (finish_reason then "length")."""
    if len(row["response_ids"]) <= room:
        return row
    return {**row, "response_ids": row["response_ids"][:room], "rollout_logprobs": row["rollout_logprobs"][:room],
            "finish_reason": "length"}


def _metrics(convs: list[_Conversation]) -> dict[str, float]:
    """verl's multi-turn metrics of one generate call."""
    if not convs:
        return {}
    turns = [c.turns for c in convs]
    calls = [c.tool_calls for c in convs]
    return {"multi_turn/num_turns/mean": sum(turns) / len(turns), "multi_turn/num_turns/max": float(max(turns)),
            "multi_turn/tool_calls/mean": sum(calls) / len(calls),
            "multi_turn/tool_call_frac": sum(1 for c in calls if c) / len(calls)}


def with_agent_loop(engine: Any, config: MultiTurnConfig, tokenizer: Any) -> Any:
    """`engine` wrapped in an AgentLoopEngine when `config.enable` (once: a wrapped engine is
    returned as is), else `engine` unchanged."""
    if not config.enable or isinstance(engine, AgentLoopEngine) or engine is None:
        return engine
    return AgentLoopEngine(engine, config, tokenizer)

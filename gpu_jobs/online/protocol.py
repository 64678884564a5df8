"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions.

Supported sampling parameters: temperature, top_p, top_k (vLLM's extension), max_tokens
(max_completion_tokens for chat), n, seed, stop (cut after generation, as the text the user
sees: the engine has no stop strings), stream and stream_options.include_usage, user, and
rlmill's session_id. OpenAI parameters the engine cannot honour are refused with a 400 naming
them unless they hold their neutral value (presence_penalty 0, logprobs false, ...); names
OpenAI does not have are refused too. Chat also takes `tools`, `tool_choice` and
`parallel_tool_calls` (tools.py), streamed or not.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpu_jobs.online.detok import prefix_lengths, token_pieces
from gpu_jobs.online.signals import SIGNALS, fields as signal_fields, signal_problem
from gpu_jobs.online.tools import (MAX_CALL_ID, MAX_CALLS, MAX_TOOLS, TOOL_CHOICES, ToolCall, ToolSpec, content_of,
                                   tools_problem)

__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "FeedbackRequest", "INT32_MAX", "ParamError",
           "check_token_ids", "error_body", "refused_param", "sampling_of", "make_choices", "chat_response",
           "completion_response"]

INT32_MAX = 2**31 - 1  # what an index must fit in: the event tables store them as int32
INT64 = (-(2**63), 2**63 - 1)  # what a seed must fit in (torch's generators take 64 bits)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# Parameters accepted only at their neutral value (what OpenAI does when they are left out).
NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "repetition_penalty": (1, 1.0, None),
    "logit_bias": (None, {}), "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (False, None),
    "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None, True, False), "min_tokens": (None, 0), "ignore_eos": (None, False),
    "min_p": (None, 0, 0.0), "stream_options": (None,),
}
# Accepted and ignored: they do not change the answer.
IGNORED = ("metadata", "store", "service_tier")


def error_body(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error shape, on one line: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": " ".join(str(message).split()), "type": kind, "param": param, "code": status}}


class ApiError(Exception):
    """Any refusal the API answers with `status` in OpenAI's error shape (error_body), with
    optional extra response headers (Retry-After on a 429)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.headers = status, param, kind, headers or {}

    def body(self) -> dict:
        return error_body(self.status, str(self), self.param, self.kind)


class ParamError(ApiError, ValueError):
    """A request parameter the server cannot honour: a 400 naming `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(400, message, param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    session_id: str | None = Field(None, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s or len(s) > 256 for s in stops):
            raise ValueError("give at most 4 non-empty stop strings of at most 256 characters")
        return stops or None

    def max_new_tokens(self) -> int:
        return self.max_tokens or 16


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[dict] | None = ""
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_CALLS)  # an assistant's calls, sent back
    tool_call_id: str | None = Field(None, max_length=MAX_CALL_ID)  # a tool result: the call it answers

    @model_validator(mode="after")
    def _calls_on_assistant(self) -> "Message":
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} ones")
        return self

    def logged(self) -> dict:
        """The message as the prompt is rendered from and the answer event logs it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": "..."}]
            if any(part.get("type") != "text" or not isinstance(part.get("text", ""), str) for part in self.content):
                raise ParamError("messages", "only text content parts ({\"type\": \"text\", \"text\": \"...\"}) "
                                             "are supported")
            return "".join(part.get("text", "") for part in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)

    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # False: at most one tool call per answer (the first)

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        if v and (problem := tools_problem([t.model_dump(exclude_none=True) for t in v])) is not None:
            raise ValueError(problem)
        return v or None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v is not None and (not isinstance(v, str) or v not in TOOL_CHOICES):
            shown = json.dumps(v[:80]) if isinstance(v, str) else f"of type {type(v).__name__}"
            if isinstance(v, dict) and isinstance(v.get("type"), str):
                shown = f'{{"type": {json.dumps(v["type"][:40])}, ...}}'
            raise ValueError(f"tool_choice {shown} is not supported by this server: give "
                             f"{' or '.join(map(repr, TOOL_CHOICES))}")
        return v

    def tool_list(self) -> list[dict] | None:
        """The tools as OpenAI dicts (None: none given), as they are rendered and logged."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def calls_wanted(self) -> bool:
        """Whether the answer's Hermes calls become tool_calls (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def parallel_calls(self) -> bool:
        """Whether an answer may return several tool calls (OpenAI's default; False: the first only)."""
        return self.parallel_tool_calls is not False

    def max_new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16

    def check_size(self, max_chars: int, max_messages: int) -> None:
        """ParamError when the messages are more than `max_messages` or longer than `max_chars`
        characters in all, tools and calls' arguments included (checked before the chat template
        tokenises them)."""
        if len(self.messages) > max_messages:
            raise ParamError("messages", f"{len(self.messages)} messages: this server takes at most {max_messages} "
                                         "(--max-messages)")
        chars = sum(len(m.text()) + sum(len(c.function.arguments) for c in m.tool_calls or ())
                    for m in self.messages)
        chars += len(json.dumps(self.tool_list())) if self.tools else 0
        if chars > max_chars:
            raise ParamError("messages", f"the messages have {chars} characters: this server takes at most "
                                         f"{max_chars} (--max-prompt-chars)")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ParamError("prompt", "one prompt per request: send the others as their own requests")
            p = p[0]
        if not p:
            raise ParamError("prompt", "prompt is empty")
        return p

    def check_size(self, max_chars: int) -> None:
        """ParamError when a text prompt is longer than `max_chars` characters (checked before it
        is tokenised; a token-id prompt is bounded by the context length instead)."""
        p = self.single_prompt()
        if isinstance(p, str) and len(p) > max_chars:
            raise ParamError("prompt", f"the prompt has {len(p)} characters: this server takes at most {max_chars} "
                                       "(--max-prompt-chars)")


def check_token_ids(ids: list[int], vocab: int) -> None:
    """ParamError naming the first token id outside [0, vocab): an out-of-range id would index
    past the embedding (an error for the whole batch on CPU, a dead engine on CUDA)."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise ParamError("prompt", f"token id {t} at position {i} is outside this model's vocabulary [0, {vocab})")


def refused_param(req: _Sampling) -> ParamError | None:
    """The first parameter the server cannot honour, or None."""
    for key, value in (req.model_extra or {}).items():
        if key in IGNORED:
            continue
        if key not in NEUTRAL:
            return ParamError(key, f"unsupported parameter {key!r}")
        if value not in NEUTRAL[key]:
            return ParamError(key, f"parameter {key!r}={json.dumps(value)} is not supported by this server's "
                                   f"engine; leave it out")
    return None


def sampling_of(req: _Sampling):
    """The engine's SamplingConfig for a request."""
    from gpu_jobs.rollout import SamplingConfig

    return SamplingConfig(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                          max_response_length=req.max_new_tokens(), seed=req.seed)


def make_choices(rows: list[dict], tokenizer, stops: list[str] | None) -> list[dict]:
    """Engine rows of one prompt -> choices {index, text, token_ids, logprobs, finish_reason}.
    A stop string cuts the text before it; the tokens kept are those the cut text came from."""
    out = []
    for i, row in enumerate(rows):
        ids, lps, reason = list(row["response_ids"]), list(row["rollout_logprobs"]), row["finish_reason"]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((text.find(s) for s in stops or () if s in text), default=-1)
        if cut >= 0:
            text, reason = text[:cut], "stop"
            lengths = prefix_lengths(ids, tokenizer)  # O(L) short decodes, not one per prefix
            keep = next(k for k, chars in enumerate(lengths) if chars >= cut)
            ids, lps = ids[:keep], lps[:keep]
        out.append({"index": i, "text": text, "token_ids": ids, "logprobs": lps, "finish_reason": reason})
    return out


def _usage(prompt_ids: list[int], choices: list[dict]) -> dict:
    completion = sum(len(c["token_ids"]) for c in choices)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


def _message(c: dict) -> dict:
    """A chat choice's message: its text, or (tool calls) the text outside them and the calls."""
    if not c.get("tool_calls"):
        return {"role": "assistant", "content": c["text"]}
    return {"role": "assistant", "content": content_of(c["text"]), "tool_calls": c["tool_calls"]}


def chat_response(answer_id: str, created: int, model: str, fingerprint: str, prompt_ids, choices) -> dict:
    return {"id": answer_id, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": c["index"], "message": _message(c),
                         "logprobs": None, "finish_reason": c["finish_reason"]} for c in choices],
            "usage": _usage(prompt_ids, choices)}


def completion_response(answer_id: str, created: int, model: str, fingerprint: str, prompt_ids, choices) -> dict:
    return {"id": answer_id, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": c["index"], "text": c["text"], "logprobs": None,
                         "finish_reason": c["finish_reason"]} for c in choices],
            "usage": _usage(prompt_ids, choices)}


def _pieces(choice: dict, tokenizer) -> list[str]:
    """The choice's text split at token boundaries (what each token added), summing to the text;
    incremental (detok.token_pieces): O(L) short decodes."""
    pieces, shown, text = [], 0, choice["text"]
    for piece in token_pieces(choice["token_ids"], tokenizer):
        piece = piece[:max(0, len(text) - shown)]
        if piece:
            pieces.append(piece)
            shown += len(piece)
    if shown != len(text):
        pieces.append(text[shown:])
    return pieces


class FeedbackRequest(BaseModel):
    """Body of POST /v1/feedback: the answer, and at least one signal. What a signal may hold is
    the signal registry's to say (gpu_jobs/online/signals.py), as for the stream's events."""

    model_config = ConfigDict(extra="forbid")

    answer_id: str = Field(min_length=1, max_length=128)
    index: int = Field(0, ge=0, le=INT32_MAX, description="Which choice of the answer (n > 1).")
    score: float | None = Field(None, description="A score in [0, 1].")
    thumbs: str | None = Field(None, description="up | down.")
    preferred_over: str | None = Field(None, description="Another answer id this one was preferred over.")
    preferred_over_index: int = Field(0, ge=0, le=INT32_MAX, description="Which choice of preferred_over.")
    text: str | None = Field(None, description="A comment.")
    user: str | None = Field(None, max_length=256)
    session_id: str | None = Field(None, max_length=256)

    @field_validator(*signal_fields())
    @classmethod
    def _signal(cls, v, info):
        if v is not None:
            (signal,) = [s for s in SIGNALS.values() if s.field == info.field_name]
            if (problem := signal.check(v)) is not None:
                raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _one_signal(self) -> "FeedbackRequest":
        if (problem := signal_problem(self.model_dump())) is not None:
            raise ValueError(problem)
        return self


def now_s() -> int:
    return int(time.time())

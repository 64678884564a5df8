"""Prompts through a tokenizer's chat template: token ids, with verl's length rules.

    >>> from gpu_jobs.data import render_prompt
    >>> render_prompt([{"role": "user", "content": "37+45="}], tokenizer, max_prompt_length=512)

These render plain chats ({role, content}). A tool conversation (a row's `tools` column, an
assistant's `tool_calls`, `tool` results: what `rlmill feedback dataset` writes for a served agent)
is rendered by gpu_jobs.chat.hermes.render_chat, the renderer `rlmill serve` uses, from the
messages conversation_messages keeps and the tools row_tools reads; it sits above this package
(rollout imports data, so data cannot import it back).
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["TOOLS_KEY", "DatasetConfig", "OverlongPromptError", "completion_chat_template", "conversation_messages",
           "normalize_messages", "render_prompt", "render_many", "render_prompts", "row_tools", "with_prompt_template"]

TOOLS_KEY = "tools"  # verl's default data.tools_key: a row's OpenAI tools, as JSON text


def normalize_messages(prompt: Any) -> list[dict[str, str]]:
    """A prompt cell as a plain list of {"role", "content"} dicts.

    Parquet gives back a numpy array of dicts (pandas) or a list; a bare string (some verl
    datasets store raw text) becomes one user message.
    """
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def conversation_messages(prompt: Any) -> list[dict[str, Any]]:
    """A prompt cell as normalize_messages gives it, plus an assistant's `tool_calls` (OpenAI's
    shape, arguments as JSON text) and a tool result's `tool_call_id` where a message has them:
    the conversation a served agent's row holds. Parquet gives every message of a column every
    field (None where a message has none) and lists as numpy arrays."""
    if prompt is None or isinstance(prompt, str):
        return normalize_messages(prompt)
    out = []
    for m in prompt:
        message = {"role": m["role"], "content": m["content"]}
        calls = m.get("tool_calls")
        if calls is not None and len(calls):  # len, not truth: a numpy array has none
            message["tool_calls"] = [{"id": c["id"], "type": c.get("type") or "function", "function": {
                "name": c["function"]["name"], "arguments": c["function"]["arguments"]}} for c in calls]
        if m.get("tool_call_id") is not None:
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def row_tools(value: Any) -> list[dict[str, Any]] | None:
    """A row's tools cell as a list of OpenAI tool dicts, or None when it has none: JSON text
    (what verl's tool datasets and `rlmill feedback dataset` store) or a list already.

    >>> row_tools('[{"type": "function", "function": {"name": "f"}}]')[0]["function"]["name"]
    'f'
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):  # pandas' missing cell
        return None
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
    if value is not None and not isinstance(value, (list, tuple)):
        raise TypeError(f"a row's {TOOLS_KEY!r} is a JSON list of OpenAI tools, not {type(value).__name__}")
    return list(value) if value else None


class DatasetConfig(BaseModel):
    """How prompts are read and rendered; field names follow verl's `data.*` where one exists."""

    model_config = ConfigDict(extra="forbid")

    train_files: list[str] = Field(
        default_factory=list, description="URLs of training Parquet files (verl format); local or s3://."
    )
    val_files: list[str] = Field(
        default_factory=list, description="URLs of validation Parquet files (verl format)."
    )
    prompt_key: str = Field("prompt", description="Column holding the chat messages (verl: data.prompt_key).")
    max_prompt_length: int = Field(
        512, gt=0, description="Most tokens a rendered prompt (chat template + generation prompt) may have."
    )
    completion_template: str | None = Field(
        None,
        description=(
            "A completion-style prompt for a base model (one without a chat template, e.g. gemma3-270m): "
            "text with one {prompt}, which is replaced by the row's message contents (a blank line "
            "apart); the tokenizer's BOS comes first, nothing is added after it (the model continues the "
            "text). E.g. 'Q: What is 3 times 4?\\nA: 12\\nQ: {prompt}\\nA:'. null: the tokenizer's own "
            "chat template. Set, it replaces the chat template for the run's prompts (training and "
            "validation) and is saved with the checkpoints' tokenizer."
        ),
    )
    overlong_prompts: Literal["error", "filter"] = Field(
        "error",
        description=(
            "What to do with a prompt longer than max_prompt_length: 'error' raises "
            "OverlongPromptError naming the row (verl truncation='error'); 'filter' drops it and "
            "counts it (verl filter_overlong_prompts=True)."
        ),
    )

    @field_validator("completion_template")
    @classmethod
    def _one_prompt_slot(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(v) if f is not None]
        except ValueError as e:
            raise ValueError(f"data.completion_template {v!r}: {e} (write a literal brace as {{{{ or }}}})") from None
        if fields != [("prompt", "", None)]:
            found = ", ".join("{" + f + (f"!{c}" if c else "") + (f":{s}" if s else "") + "}" for f, s, c in fields)
            raise ValueError(f"data.completion_template {v!r} must hold {{prompt}} exactly once and no other "
                             f"{{field}} (found {found or 'none'}); write a literal brace as {{{{ or }}}}")
        return v


def _jinja_literal(text: str) -> str:
    """`text` as a Jinja string literal (Jinja unescapes literals as Python's unicode-escape)."""
    out = []
    for c in text:
        if c in '\\"':
            out.append("\\" + c)
        elif " " <= c <= "~":
            out.append(c)
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
    return '"' + "".join(out) + '"'


def completion_chat_template(template: str) -> str:
    """A Jinja chat template rendering data.completion_template: BOS, the text before {prompt},
    the messages' contents a blank line apart, the text after it; no generation prompt. As a chat
    template every renderer (render_prompt, render_many, the data gate) takes it unchanged."""
    before, after = template.replace("{prompt}", "\0", 1).format().split("\0")  # {{ }} become braces
    return ("{% if bos_token %}{{ bos_token }}{% endif %}{{ " + _jinja_literal(before) + " }}"
            "{% for m in messages %}{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
            "{{ m['content'] }}{% endfor %}"
            "{{ " + _jinja_literal(after) + " }}")


def with_prompt_template(tokenizer, completion_template: str | None):
    """`tokenizer` rendering prompts as the run's config says: with `completion_template` set,
    its chat template is replaced by completion_chat_template's; without, it must have a chat
    template (ValueError naming the fix: a base model's tokenizer has none)."""
    if completion_template is not None:
        tokenizer.chat_template = completion_chat_template(completion_template)
    elif not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the model's tokenizer ({type(tokenizer).__name__}) has no chat template (a base "
                         "model): set data.completion_template to a completion-style prompt with one {prompt}, "
                         "e.g. 'Q: {prompt}\\nA:' (examples/grpo_times_gemma3.yaml)")
    return tokenizer


class OverlongPromptError(ValueError):
    """A rendered prompt has more tokens than max_prompt_length and the config says 'error'."""


def _ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding by default; we ask for plain ids but accept both.
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def render_prompt(messages: Any, tokenizer, max_prompt_length: int | None = None) -> list[int]:
    """Token ids of `messages` through the chat template, with the generation prompt added.

    Raises OverlongPromptError when the result is longer than `max_prompt_length`.
    """
    ids = _ids(
        tokenizer.apply_chat_template(
            normalize_messages(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    if max_prompt_length is not None and len(ids) > max_prompt_length:
        raise OverlongPromptError(f"prompt renders to {len(ids)} tokens > max_prompt_length={max_prompt_length}")
    return ids


def render_many(prompts: Iterable[Any], tokenizer) -> list[list[int]]:
    """Token ids of many prompts (no length limit). One batched chat-template call: ~3x faster
    than rendering one by one (4096 short prompts: ~0.2 s)."""
    convs = [normalize_messages(m) for m in prompts]
    if not convs:
        return []
    out = tokenizer.apply_chat_template(convs, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [_ids(x) for x in out]


def render_prompts(prompts: Iterable[Any], tokenizer, cfg: DatasetConfig,
                   render: Callable[[list[Any]], list[list[int]]] | None = None) -> tuple[list[list[int]], list[int], int]:
    """Render many prompts (with `render`, prompts -> token id lists; default render_many);
    returns (token ids of the kept prompts, their positions, n_filtered).

    With cfg.overlong_prompts == "error" the first overlong prompt raises, naming its position
    and length; with "filter" it is left out and counted in n_filtered (never dropped silently).
    """
    kept_ids, kept_pos, n_filtered = [], [], 0
    ids_of = render(list(prompts)) if render is not None else render_many(prompts, tokenizer)
    for i, ids in enumerate(ids_of):
        if len(ids) > cfg.max_prompt_length:
            if cfg.overlong_prompts == "error":
                raise OverlongPromptError(
                    f"prompt at row {i} renders to {len(ids)} tokens > max_prompt_length="
                    f"{cfg.max_prompt_length}; raise max_prompt_length or set overlong_prompts='filter'"
                )
            n_filtered += 1
            continue
        kept_ids.append(ids)
        kept_pos.append(i)
    return kept_ids, kept_pos, n_filtered

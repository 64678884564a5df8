"""Prompts through a tokenizer's chat template: token ids, with verl's length rules.

    >>> from gpu_jobs.data import render_prompt
    >>> render_prompt([{"role": "user", "content": "37+45="}], tokenizer, max_prompt_length=512)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DatasetConfig", "OverlongPromptError", "normalize_messages", "render_prompt", "render_many",
           "render_prompts"]


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
    overlong_prompts: Literal["error", "filter"] = Field(
        "error",
        description=(
            "What to do with a prompt longer than max_prompt_length: 'error' raises "
            "OverlongPromptError naming the row (verl truncation='error'); 'filter' drops it and "
            "counts it (verl filter_overlong_prompts=True)."
        ),
    )


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


def render_prompts(prompts: Iterable[Any], tokenizer, cfg: DatasetConfig) -> tuple[list[list[int]], list[int], int]:
    """Render many prompts; returns (token ids of the kept prompts, their positions, n_filtered).

    With cfg.overlong_prompts == "error" the first overlong prompt raises, naming its position
    and length; with "filter" it is left out and counted in n_filtered (never dropped silently).
    """
    kept_ids, kept_pos, n_filtered = [], [], 0
    for i, ids in enumerate(render_many(prompts, tokenizer)):
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

"""The prompt files a run names, checked before the run starts: each problem the data gate
(`gpu_jobs.data.gates.validate_prompts`) would find minutes in is one line here, naming the file, the
column or row, and the fix. The rules are the gate's own derived columns, not a second copy.

    >>> check_prompt_file("data/train.parquet", "data.train_files", data=cfg.data, gate=cfg.gate, tokenizer=tok)

A row-level problem (a malformed, empty or over-long prompt, a rule reward without a ground
truth) is refused only where the run would refuse it: with `gate.on_failure=raise` (quarantine
sets such rows aside instead), and for length with `data.overlong_prompts=error`.
"""

from __future__ import annotations

import math
from typing import Any

from gpu_jobs.data.rendering import DatasetConfig, render_many
from storage.datasets import VERL_ROW, DatasetError, read_prompt_file
from storage.fs import redact_url
from gpu_jobs.data.gates import GateConfig, prompt_derived_columns

__all__ = ["check_prompt_file"]

_QUARANTINE = "or set gate.on_failure=quarantine to set such rows aside"
_MESSAGES = '[{"role": "user", "content": "..."}]'


def check_prompt_file(url: str, key: str, *, data: DatasetConfig, gate: GateConfig, storage=None,
                      tokenizer: Any = None) -> None:
    """Raise DatasetError for the first problem of the verl prompt file `url` (named by the
    config key `key`, e.g. "data.train_files"). `tokenizer` (optional) renders prompts for the
    length check; without one the length is left to the run."""
    name = f"{redact_url(url)} ({key})"
    required = tuple(dict.fromkeys([*gate.required_prompt_columns, data.prompt_key]))
    df = read_prompt_file(url, storage=storage, required=required, name=name)
    if data.prompt_key != "prompt":
        df = df.assign(prompt=df[data.prompt_key])
    if gate.on_failure == "raise":
        _check_rows(df, name)
    if tokenizer is not None and data.overlong_prompts == "error":
        _check_lengths(df, name, tokenizer, data.max_prompt_length)


def _first(bad: list[int]) -> str:
    return f"row {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")


def _check_rows(df: Any, name: str) -> None:
    sources = df["data_source"].tolist()
    bad = [i for i, s in enumerate(sources) if s is None or (isinstance(s, float) and math.isnan(s))]
    if bad:
        raise DatasetError(f"data file {name} {_first(bad)}: data_source is empty: give every row a data_source "
                           f"(it routes the reward, e.g. 'rlmill/arith' or 'openai/gsm8k'), {_QUARANTINE}")
    derived = prompt_derived_columns(df)
    prompts = df["prompt"].tolist()
    bad = [i for i, ok in enumerate(derived["dq_prompt_well_formed"]) if not ok]
    if bad:
        cell = prompts[bad[0]]
        raise DatasetError(
            f"data file {name} {_first(bad)}: column 'prompt' is not a list of {{role, content}} messages (it holds "
            f"{type(cell).__name__} {_short(cell)}): write each prompt as {_MESSAGES} or a plain string, {_QUARANTINE}")
    bad = [i for i, (n, chars) in enumerate(zip(derived["dq_prompt_n_messages"], derived["dq_prompt_chars"]))
           if n < 1 or chars < 1]
    if bad:
        raise DatasetError(f"data file {name} {_first(bad)}: column 'prompt' is empty (no message text): fill in "
                           f"the prompt or remove the row, {_QUARANTINE}")
    if "dq_rule_has_ground_truth" in derived:
        bad = [i for i, ok in enumerate(derived["dq_rule_has_ground_truth"]) if not ok]
        if bad:
            rm = df["reward_model"].tolist()[bad[0]]
            raise DatasetError(
                f"data file {name} {_first(bad)}: column 'reward_model' has no ground_truth for the rule reward "
                f"(it holds {_short(rm)}): give it one, like {VERL_ROW}, or remove the row, {_QUARANTINE}")


def _check_lengths(df: Any, name: str, tokenizer: Any, limit: int) -> None:
    lengths = prompt_derived_columns(df, render=lambda convs: render_many(convs, tokenizer))["dq_prompt_length"]
    bad = [i for i, n in enumerate(lengths) if n > limit]
    if bad:
        raise DatasetError(
            f"data file {name} {_first(bad)}: the prompt renders to {lengths[bad[0]]} tokens > "
            f"data.max_prompt_length={limit}: raise data.max_prompt_length, set data.overlong_prompts=filter to "
            "drop such rows, or shorten them")


def _short(value: Any, most: int = 60) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= most else text[: most - 3] + "..."

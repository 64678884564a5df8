"""The data-quality gates on rlmill's data: verl prompt datasets and rollout batches.

    >>> from gpu_jobs.data.gates import GateConfig, validate_prompts, validate_rollout
    >>> res = validate_prompts(df, GateConfig(max_prompt_length=64), render=partial(render_many, tokenizer=tok),
    ...                        report_url="s3://bucket/runs/r1/data/_QUALITY.json")
    >>> res.passed, res.n_rows
    (True, 4096)

This module says what a good prompt row and a good rollout row are; `storage.quality` runs the
expectations (great-expectations), writes the report and the quarantine, and raises
DataQualityError. On a failure the gate either raises (on_failure="raise"; the message names the
expectation, the column and a few offending rows) or, with on_failure="quarantine", returns the
clean rows in `result.clean` and the bad rows in `result.quarantined` (also written to
`quarantine_url` when given), counted in `result.n_quarantined`. Rows are never dropped silently.

Checks the library cannot express directly are validated on derived columns named `dq_*`
(e.g. `dq_prompt_length`, the rendered prompt's token count): `ExpectColumnValueLengthsToBeBetween`
measures a value's string form, not a list's length.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpu_jobs.data.rendering import normalize_messages
from storage.quality import GateResult, run_gate

__all__ = [
    "GateConfig",
    "validate_prompts",
    "validate_rollout",
    "prompt_derived_columns",
    "rollout_derived_columns",
]


class GateConfig(BaseModel):
    """Limits and failure policy of a data-quality gate."""

    model_config = ConfigDict(extra="forbid")

    enable: bool = Field(
        True,
        description=(
            "false: no great-expectations suite runs; prompt datasets and rollout batches go on unchecked "
            "(gate/checked 0 in each iteration's metrics). For machines without great-expectations, such as "
            "the GPU machine `make gpu-bundle` prepares; the pre-start checks of data files still run."
        ),
    )
    on_failure: Literal["raise", "quarantine"] = Field(
        "raise",
        description=(
            "'raise': any failed expectation raises DataQualityError. 'quarantine': rows that fail "
            "a row-level expectation are set aside (returned, counted, written to quarantine_url) "
            "and the clean rows go on; a table-level failure (a missing column) still raises."
        ),
    )
    max_prompt_length: int | None = Field(
        None, gt=0, description="Most tokens a rendered prompt may have; None skips the length check."
    )
    max_response_length: int | None = Field(
        None, ge=0, description="Most tokens a response may have; None only checks response_len >= 0."
    )
    score_range: tuple[float, float] | None = Field(
        None, description="(min, max) the reward scorer declares; scores outside fail. None: finite only."
    )
    required_prompt_columns: tuple[str, ...] = Field(
        ("data_source", "prompt", "reward_model"), description="Columns a prompt dataset must have."
    )
    required_rollout_columns: tuple[str, ...] = Field(
        ("uid", "group_id", "data_source", "response_ids", "rollout_logprobs", "response_len"),
        description="Columns a rollout batch must have.",
    )
    max_examples: int = Field(5, ge=1, description="Offending rows quoted per expectation in the error message.")

    @model_validator(mode="after")
    def _check_range(self) -> "GateConfig":
        if self.score_range is not None and not self.score_range[0] <= self.score_range[1]:
            raise ValueError(f"score_range must be (min, max) with min <= max, got {self.score_range}")
        return self


# --------------------------------------------------------------------------------------------
# Derived columns
# --------------------------------------------------------------------------------------------
def _len(x: Any) -> int:
    # -1 for a cell that is not a sequence: it then fails the length checks instead of crashing.
    try:
        return 0 if x is None else len(x)
    except TypeError:
        return -1


def prompt_derived_columns(df, *, render=None) -> dict[str, list]:
    """dq_* columns for a verl prompt dataset: message count, well-formed messages (each a
    dict with a string role and string content), content characters, rule rows with a ground
    truth, and (given `render`, lists of messages -> token id lists, e.g.
    `functools.partial(gpu_jobs.data.render_many, tokenizer=tok)`, or a `prompt_ids` column)
    the rendered prompt length. Storage knows no tokenizer: the caller brings the renderer."""
    cols: dict[str, list] = {}
    if "prompt" in df.columns:
        msgs = [_messages_or_none(p) for p in df["prompt"]]
        cols["dq_prompt_n_messages"] = [len(m) if m is not None else 0 for m in msgs]
        cols["dq_prompt_well_formed"] = [m is not None for m in msgs]
        cols["dq_prompt_chars"] = [sum(len(c["content"]) for c in m) if m else 0 for m in msgs]
        if render is not None:
            # Only well-formed, non-empty prompts are rendered; the others fail above anyway.
            lengths = [0] * len(msgs)
            ok = [i for i, m in enumerate(msgs) if m]
            for i, ids in zip(ok, render([msgs[i] for i in ok])):
                lengths[i] = len(ids)
            cols["dq_prompt_length"] = lengths
    if "dq_prompt_length" not in cols and "prompt_ids" in df.columns:
        cols["dq_prompt_length"] = [_len(x) for x in df["prompt_ids"]]
    if "reward_model" in df.columns:
        cols["dq_rule_has_ground_truth"] = [_rule_has_ground_truth(rm) for rm in df["reward_model"]]
    return cols


def _messages_or_none(p: Any) -> list[dict[str, str]] | None:
    """The messages if every one has a string role and string content, else None."""
    try:
        msgs = normalize_messages(p)
    except (KeyError, TypeError, IndexError):
        return None
    if all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in msgs):
        return msgs
    return None


def _rule_has_ground_truth(rm: Any) -> bool:
    if not isinstance(rm, dict):
        return False
    if rm.get("style") != "rule":
        return True
    gt = rm.get("ground_truth")
    if gt is None or (isinstance(gt, float) and math.isnan(gt)):
        return False
    return not (isinstance(gt, str) and gt == "")


def rollout_derived_columns(df) -> dict[str, list]:
    """dq_* columns for a rollout batch: lengths of the token lists and per-row min / max /
    all-finite of rollout_logprobs (empty responses: min = max = 0, finite)."""
    cols: dict[str, list] = {}
    if "response_ids" in df.columns:
        cols["dq_response_ids_len"] = [_len(x) for x in df["response_ids"]]
    if "rollout_logprobs" in df.columns:
        lps = [np.asarray(x if x is not None else [], dtype=np.float64) for x in df["rollout_logprobs"]]
        cols["dq_logprobs_len"] = [a.size for a in lps]
        finite = [bool(np.isfinite(a).all()) for a in lps]
        cols["dq_logprobs_all_finite"] = finite
        # Non-finite rows get NaN here (great-expectations skips NaN); dq_logprobs_all_finite flags them.
        cols["dq_logprobs_max"] = [_extreme(a, f, np.max) for a, f in zip(lps, finite)]
        cols["dq_logprobs_min"] = [_extreme(a, f, np.min) for a, f in zip(lps, finite)]
    if "score" in df.columns:
        cols["dq_score_finite"] = [_finite_number(s) for s in df["score"]]
    return cols


def _extreme(a: np.ndarray, finite: bool, reduce) -> float:
    if not finite:
        return math.nan
    return float(reduce(a)) if a.size else 0.0


def _finite_number(x: Any) -> bool:
    try:
        return x is not None and not isinstance(x, bool) and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------------------------
# Expectations
# --------------------------------------------------------------------------------------------
def _prompt_expectations(gxe, df, cfg: GateConfig, derived: dict) -> list:
    exps = [gxe.ExpectColumnToExist(column=c) for c in cfg.required_prompt_columns]
    if "data_source" in df.columns:
        exps.append(gxe.ExpectColumnValuesToNotBeNull(column="data_source"))
    if "dq_prompt_n_messages" in derived:
        exps.append(gxe.ExpectColumnValuesToBeInSet(column="dq_prompt_well_formed", value_set=[True]))
        exps.append(gxe.ExpectColumnValuesToBeBetween(column="dq_prompt_n_messages", min_value=1))
        exps.append(gxe.ExpectColumnValuesToBeBetween(column="dq_prompt_chars", min_value=1))
    if cfg.max_prompt_length is not None and "dq_prompt_length" in derived:
        exps.append(
            gxe.ExpectColumnValuesToBeBetween(column="dq_prompt_length", min_value=0, max_value=cfg.max_prompt_length)
        )
    if "dq_rule_has_ground_truth" in derived:
        exps.append(gxe.ExpectColumnValuesToBeInSet(column="dq_rule_has_ground_truth", value_set=[True]))
    return exps


def _rollout_expectations(gxe, df, cfg: GateConfig, derived: dict) -> list:
    exps = [gxe.ExpectColumnToExist(column=c) for c in cfg.required_rollout_columns]
    if "response_len" in df.columns:
        exps.append(gxe.ExpectColumnValuesToNotBeNull(column="response_len"))
        exps.append(
            gxe.ExpectColumnValuesToBeBetween(column="response_len", min_value=0, max_value=cfg.max_response_length)
        )
        if "dq_response_ids_len" in derived:
            exps.append(gxe.ExpectColumnPairValuesToBeEqual(column_A="response_len", column_B="dq_response_ids_len"))
        if "dq_logprobs_len" in derived:
            exps.append(gxe.ExpectColumnPairValuesToBeEqual(column_A="response_len", column_B="dq_logprobs_len"))
    if "dq_logprobs_all_finite" in derived:
        exps.append(gxe.ExpectColumnValuesToBeInSet(column="dq_logprobs_all_finite", value_set=[True]))
        exps.append(gxe.ExpectColumnValuesToBeBetween(column="dq_logprobs_max", max_value=0.0))
    if "uid" in df.columns:
        exps.append(gxe.ExpectColumnValuesToBeUnique(column="uid"))
    if "group_id" in df.columns and "sample_index" in df.columns:
        exps.append(gxe.ExpectCompoundColumnsToBeUnique(column_list=["group_id", "sample_index"]))
    if "dq_score_finite" in derived:
        exps.append(gxe.ExpectColumnValuesToBeInSet(column="dq_score_finite", value_set=[True]))
        if cfg.score_range is not None:
            lo, hi = cfg.score_range
            exps.append(gxe.ExpectColumnValuesToBeBetween(column="score", min_value=lo, max_value=hi))
    return exps


def unchecked(df) -> GateResult:
    """The result of a gate that is off (GateConfig.enable false): every row passes, nothing was
    checked, no report is written."""
    return GateResult(passed=True, n_rows=len(df), n_quarantined=0, clean=df)


def validate_prompts(
    df,
    cfg: GateConfig,
    report_url: str | None = None,
    *,
    render=None,
    quarantine_url: str | None = None,
    storage=None,
) -> GateResult:
    """Gate a verl prompt dataset (pandas DataFrame as read by `read_prompts`).

    Checks: required columns present, data_source non-null, prompt has >= 1 message and
    non-empty content, rendered prompt length <= cfg.max_prompt_length (rendered with `render`,
    see `prompt_derived_columns`, or from a `prompt_ids` column; skipped when neither is given),
    and a ground truth on every row whose reward_model style is "rule".
    """
    if not cfg.enable:
        return unchecked(df)
    derived = prompt_derived_columns(df, render=render)
    build = lambda gxe: _prompt_expectations(gxe, df, cfg, derived)  # noqa: E731
    return run_gate("prompts", df, derived, build, on_failure=cfg.on_failure, max_examples=cfg.max_examples,
                    report_url=report_url, quarantine_url=quarantine_url, storage=storage)


def validate_rollout(
    df, cfg: GateConfig, report_url: str | None = None, *, quarantine_url: str | None = None, storage=None
) -> GateResult:
    """Gate a rollout batch (sample schema; a pandas DataFrame or a pyarrow Table).

    Checks: required columns present, 0 <= response_len <= cfg.max_response_length and equal to
    len(response_ids) and len(rollout_logprobs), logprobs finite and <= 0, uid unique (and
    (group_id, sample_index) unique when that column exists), score finite and within
    cfg.score_range when a score column exists.
    """
    if not hasattr(df, "columns") or not hasattr(df, "reset_index"):
        df = df.to_pandas()
    if not cfg.enable:
        return unchecked(df)
    derived = rollout_derived_columns(df)
    build = lambda gxe: _rollout_expectations(gxe, df, cfg, derived)  # noqa: E731
    return run_gate("rollout", df, derived, build, on_failure=cfg.on_failure, max_examples=cfg.max_examples,
                    report_url=report_url, quarantine_url=quarantine_url, storage=storage)

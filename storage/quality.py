"""Data-quality gates (great-expectations) for prompt datasets and rollout batches.

    >>> from storage.quality import GateConfig, validate_prompts, validate_rollout
    >>> res = validate_prompts(df, GateConfig(max_prompt_length=64), render=partial(render_many, tokenizer=tok),
    ...                        report_url="s3://bucket/runs/r1/data/_QUALITY.json")
    >>> res.passed, res.n_rows
    (True, 4096)

On a failure the gate either raises DataQualityError (on_failure="raise"; the message names the
expectation, the column and a few offending rows) or, with on_failure="quarantine", returns the
clean rows in `result.clean` and the bad rows in `result.quarantined` (also written to
`quarantine_url` when given), counted in `result.n_quarantined`. Rows are never dropped silently.
The great-expectations validation result goes to `report_url` as JSON, pass or fail: per
expectation pass/fail for a clean batch, with the offending rows and values when one failed.

Checks the library cannot express directly are validated on derived columns named `dq_*`
(e.g. `dq_prompt_length`, the rendered prompt's token count): `ExpectColumnValueLengthsToBeBetween`
measures a value's string form, not a list's length.

great_expectations costs 3-7 s to import, so it is imported on first use; its ephemeral context
and the registered suites are kept for the life of the process (one validation of 4096 rows
then takes ~0.1 s).
"""

from __future__ import annotations

import json
import math
import os
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from storage.datasets import _url_to_fs, normalize_messages

__all__ = [
    "GateConfig",
    "GateResult",
    "DataQualityError",
    "validate_prompts",
    "validate_rollout",
    "prompt_derived_columns",
    "rollout_derived_columns",
]


class GateConfig(BaseModel):
    """Limits and failure policy of a data-quality gate."""

    model_config = ConfigDict(extra="forbid")

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


@dataclass
class GateResult:
    """What a gate found. `clean`/`quarantined` are set in quarantine mode (clean is the input
    when everything passed); `failures` has one dict per failed expectation."""

    passed: bool
    n_rows: int
    n_quarantined: int
    failures: list[dict[str, Any]] = field(default_factory=list)
    clean: Any = None
    quarantined: Any = None
    report_url: str | None = None
    quarantine_url: str | None = None


class DataQualityError(ValueError):
    """A data-quality gate failed. `.result` is the GateResult with every failure."""

    def __init__(self, message: str, result: GateResult):
        super().__init__(message)
        self.result = result


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
# Suites
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


@lru_cache(maxsize=1)
def _gx():
    """(great_expectations, expectations module, ephemeral context); built once per process
    because the import alone costs seconds."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    import great_expectations.expectations as gxe
    from great_expectations.data_context.types.base import ProgressBarsConfig

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    return gx, gxe, ctx


# Registered validation definitions by (gate, expectations): registering a suite in the context
# costs about as much as validating 512 rows, and every iteration's rollout gate asks for the
# same one. Bounded; an evicted definition is removed from the context.
_DEFINITIONS: "OrderedDict[str, Any]" = OrderedDict()
_MAX_DEFINITIONS = 16
_gx_lock = threading.Lock()  # the ephemeral context is shared; GX does not promise thread safety


def _validation_definition(name: str, build) -> Any:
    gx, gxe, ctx = _gx()
    exps = build(gxe)
    key = name + json.dumps([e.configuration.to_json_dict() for e in exps], sort_keys=True, default=str)
    if key in _DEFINITIONS:
        _DEFINITIONS.move_to_end(key)
        return _DEFINITIONS[key]
    tag = f"{name}-{uuid.uuid4().hex[:12]}"
    batch_def = ctx.data_sources.add_pandas(tag).add_dataframe_asset(name="df").add_batch_definition_whole_dataframe("all")
    suite = ctx.suites.add(gx.ExpectationSuite(name=tag))
    for exp in exps:
        suite.add_expectation(exp)
    _DEFINITIONS[key] = ctx.validation_definitions.add(gx.ValidationDefinition(data=batch_def, suite=suite, name=tag))
    while len(_DEFINITIONS) > _MAX_DEFINITIONS:
        old = _DEFINITIONS.popitem(last=False)[1]
        ctx.validation_definitions.delete(old.name)
        ctx.suites.delete(old.name)
        ctx.data_sources.delete(old.name)
    return _DEFINITIONS[key]


def _run_suite(name: str, df, build):
    """Validate `df`: a cheap pass/fail first (most batches are clean), the row-level detail only
    when something failed (BOOLEAN_ONLY is ~2.5x faster than COMPLETE on 512 rows)."""
    with _gx_lock:
        vd = _validation_definition(name, build)
        quick = vd.run(batch_parameters={"dataframe": df}, result_format={"result_format": "BOOLEAN_ONLY"})
        if quick.success:
            return quick
        return vd.run(batch_parameters={"dataframe": df}, result_format={"result_format": "COMPLETE"})


# --------------------------------------------------------------------------------------------
# Gate
# --------------------------------------------------------------------------------------------
def _describe(failure: dict, max_examples: int) -> str:
    kw = {k: v for k, v in failure["kwargs"].items() if k not in ("batch_id",)}
    args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    text = f"{failure['expectation']}({args})"
    if failure["rows"] is None:
        return text + (f": {failure['exception']}" if failure.get("exception") else ": failed on the whole table")
    rows, values = failure["rows"][:max_examples], failure["values"][:max_examples]
    return f"{text}: {len(failure['rows'])} row(s), e.g. rows {rows} values {values}"


def _column_of(kwargs: dict) -> str:
    if "column" in kwargs:
        return kwargs["column"]
    if "column_A" in kwargs:
        return f"{kwargs['column_A']},{kwargs['column_B']}"
    if "column_list" in kwargs:
        return ",".join(kwargs["column_list"])
    return ""


def _failures(validation) -> list[dict[str, Any]]:
    out = []
    for r in validation.results:
        if r.success:
            continue
        cfg = r.expectation_config
        result = r.result or {}
        exc = (r.exception_info or {}).get("exception_message") if isinstance(r.exception_info, dict) else None
        rows = result.get("unexpected_index_list")
        if rows is not None:
            rows = [int(i) if not isinstance(i, dict) else int(next(iter(i.values()))) for i in rows]
        out.append(
            {
                "expectation": cfg.type,
                "column": _column_of(dict(cfg.kwargs)),
                "kwargs": {k: v for k, v in dict(cfg.kwargs).items() if k != "batch_id"},
                "n_unexpected": result.get("unexpected_count"),
                "rows": rows,
                "values": [_jsonable(v) for v in result.get("unexpected_list", [])] if rows is not None else None,
                "exception": exc,
            }
        )
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def _write_bytes(url: str, data: bytes, storage=None) -> None:
    fs, path = _url_to_fs(url, storage)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    fs.pipe_file(path, data)


def _gate(kind: str, df, cfg: GateConfig, derived: dict, build, report_url, quarantine_url, storage) -> GateResult:
    import pandas as pd

    df = df.reset_index(drop=True)
    checked = pd.concat([df, pd.DataFrame(derived, index=df.index)], axis=1) if derived else df
    validation = _run_suite(f"rlmill-{kind}", checked, build)
    failures = _failures(validation)
    result = GateResult(passed=not failures, n_rows=len(df), n_quarantined=0, failures=failures, report_url=report_url)
    if report_url is not None:
        report = {"gate": kind, "n_rows": len(df), "failures": failures, "validation": validation.to_json_dict()}
        _write_bytes(report_url, json.dumps(report, default=str, indent=1).encode(), storage)
    if not failures:
        result.clean = df
        return result
    table_level = [f for f in failures if f["rows"] is None]
    if cfg.on_failure == "raise" or table_level:
        raise DataQualityError(_message(kind, result, cfg, table_level), result)

    bad: dict[int, list[str]] = {}
    for f in failures:
        for i in f["rows"]:
            bad.setdefault(i, []).append(f"{f['expectation']}:{f['column']}")
    bad_rows = sorted(bad)
    result.clean = df.drop(index=bad_rows).reset_index(drop=True)
    result.quarantined = df.loc[bad_rows].assign(dq_failures=[bad[i] for i in bad_rows], dq_row=bad_rows)
    result.n_quarantined = len(bad_rows)
    if quarantine_url is not None:
        _write_quarantine(result.quarantined, quarantine_url, storage)
        result.quarantine_url = quarantine_url
    return result


def _message(kind: str, result: GateResult, cfg: GateConfig, table_level: list) -> str:
    head = f"data-quality gate '{kind}' failed {len(result.failures)} expectation(s) on {result.n_rows} rows"
    if table_level and cfg.on_failure == "quarantine":
        head += " (table-level failures cannot be quarantined)"
    body = "; ".join(_describe(f, cfg.max_examples) for f in result.failures)
    tail = f"; full report: {result.report_url}" if result.report_url else ""
    return f"{head}: {body}{tail}"


def _write_quarantine(bad_df, url: str, storage=None) -> None:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(bad_df, preserve_index=False), buf, use_dictionary=False)
    _write_bytes(url, buf.getvalue(), storage)


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
    derived = prompt_derived_columns(df, render=render)
    build = lambda gxe: _prompt_expectations(gxe, df, cfg, derived)  # noqa: E731
    return _gate("prompts", df, cfg, derived, build, report_url, quarantine_url, storage)


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
    derived = rollout_derived_columns(df)
    build = lambda gxe: _rollout_expectations(gxe, df, cfg, derived)  # noqa: E731
    return _gate("rollout", df, cfg, derived, build, report_url, quarantine_url, storage)

"""A data-quality gate over a table: great-expectations runs the expectations a caller builds,
the report goes to storage, failed rows are set aside or refused.

    >>> result = run_gate("rollout", df, derived, build, on_failure="quarantine",
    ...                   report_url="s3://bucket/runs/r1/iterations/000001/gate_report.json")
    >>> result.passed, result.n_quarantined
    (False, 3)

`build(gxe)` returns the expectations (gxe is `great_expectations.expectations`), checked on `df`
with the caller's derived columns (`dq_*`) beside it; what a good row is, is the caller's
(`gpu_jobs.data.gates` for prompt datasets and rollout batches). The validation result goes to
`report_url` as JSON, pass or fail: per expectation pass/fail for a clean batch, with the
offending rows and values when one failed. on_failure="raise" raises DataQualityError naming the
expectation, the column and a few offending rows; on_failure="quarantine" returns the clean rows
in `result.clean` and the bad ones in `result.quarantined` (also written to `quarantine_url`),
counted in `result.n_quarantined`. Rows are never dropped silently.

great_expectations costs 3-7 s to import, so it is imported on first use; its ephemeral context
and the registered suites are kept for the life of the process (one validation of 4096 rows
then takes ~0.1 s).
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Literal

import numpy as np

from .fs import overwrite

__all__ = ["GateResult", "DataQualityError", "run_gate"]


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
# Suites
# --------------------------------------------------------------------------------------------
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


OnFailure = Literal["raise", "quarantine"]


def run_gate(kind: str, df, derived: dict[str, list], build: Callable[[Any], list], *,
             on_failure: OnFailure = "raise", max_examples: int = 5, report_url: str | None = None,
             quarantine_url: str | None = None, storage=None) -> GateResult:
    """Check `df` (a pandas DataFrame), with the `derived` columns beside it, against the
    expectations `build(gxe)` returns; write the report to `report_url`, then pass, quarantine
    the failed rows (on_failure="quarantine", rows written to `quarantine_url`) or raise
    DataQualityError quoting `max_examples` offending rows per expectation. A table-level
    failure (a missing column) raises whatever on_failure says."""
    import pandas as pd

    df = df.reset_index(drop=True)
    checked = pd.concat([df, pd.DataFrame(derived, index=df.index)], axis=1) if derived else df
    validation = _run_suite(f"rlmill-{kind}", checked, build)
    failures = _failures(validation)
    result = GateResult(passed=not failures, n_rows=len(df), n_quarantined=0, failures=failures, report_url=report_url)
    if report_url is not None:
        report = {"gate": kind, "n_rows": len(df), "failures": failures, "validation": validation.to_json_dict()}
        overwrite(report_url, json.dumps(report, default=str, indent=1).encode(), storage)
    if not failures:
        result.clean = df
        return result
    table_level = [f for f in failures if f["rows"] is None]
    if on_failure == "raise" or table_level:
        raise DataQualityError(_message(kind, result, on_failure, max_examples, table_level), result)
    _quarantine(df, result)
    if quarantine_url is not None:
        _write_quarantine(result.quarantined, quarantine_url, storage)
        result.quarantine_url = quarantine_url
    return result


def _quarantine(df, result: GateResult) -> None:
    """Split `df` into result.clean and result.quarantined (each bad row with the expectations it
    failed, `dq_failures`, and its row number, `dq_row`)."""
    bad: dict[int, list[str]] = {}
    for f in result.failures:
        for i in f["rows"]:
            bad.setdefault(i, []).append(f"{f['expectation']}:{f['column']}")
    bad_rows = sorted(bad)
    result.clean = df.drop(index=bad_rows).reset_index(drop=True)
    result.quarantined = df.loc[bad_rows].assign(dq_failures=[bad[i] for i in bad_rows], dq_row=bad_rows)
    result.n_quarantined = len(bad_rows)


def _message(kind: str, result: GateResult, on_failure: OnFailure, max_examples: int, table_level: list) -> str:
    head = f"data-quality gate '{kind}' failed {len(result.failures)} expectation(s) on {result.n_rows} rows"
    if table_level and on_failure == "quarantine":
        head += " (table-level failures cannot be quarantined)"
    body = "; ".join(_describe(f, max_examples) for f in result.failures)
    tail = f"; full report: {result.report_url}" if result.report_url else ""
    return f"{head}: {body}{tail}"


def _write_quarantine(bad_df, url: str, storage=None) -> None:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(bad_df, preserve_index=False), buf, use_dictionary=False)
    overwrite(url, buf.getvalue(), storage)



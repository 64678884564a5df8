"""What people see of a run: Prefect artifacts, console lines, TensorBoard events, the curves PNG,
and a failure's one line (flows/user_errors.py words it) delivered once, before the run's state.

Everything here reads metrics that stages already committed; nothing here changes a run.
"""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path
from typing import Any


log = logging.getLogger("rlmill")

# The verl-named metrics shown first in each iteration's table artifact.
HEADLINE = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy",
            "actor/grad_norm", "actor/lr", "response_length/mean", "timing_s/gen", "timing_s/reward",
            "timing_s/update_actor", "timing_s/step", "perf/throughput", "val/acc")


def run_logger() -> Any:
    """The Prefect run logger inside a flow or task run (the UI shows it), else the "rlmill" logger
    (a task called as .fn, e.g. in tests)."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return log


def artifact_key(run_id: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    safe = "".join(c if c.isalnum() else "-" for c in run_id.lower()).strip("-")
    return f"{safe}-{what}"


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def iteration_artifacts(run_id: str, k: int, metrics: dict[str, Any], samples: list[dict]) -> None:
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    keys = [m for m in HEADLINE if m in metrics] + sorted(m for m in metrics if m not in HEADLINE)
    create_table_artifact(
        key=artifact_key(run_id, "metrics"),
        table=[{"metric": m, "value": _fmt(metrics[m])} for m in keys],
        description=f"Iteration {k} of run {run_id}: verl-named metrics",
    )
    if samples:
        lines = [f"### Iteration {k}: sample responses", "", "| prompt | response | truth | score |", "|---|---|---|---|"]
        for s in samples:
            cells = [str(s[c]).replace("|", "\\|").replace("\n", " ")[:200] for c in ("prompt", "response", "truth", "score")]
            lines.append("| " + " | ".join(cells) + " |")
        create_markdown_artifact(key=artifact_key(run_id, "samples"), markdown="\n".join(lines),
                                 description=f"Iteration {k} samples")


class Progress:
    """A Prefect progress artifact for the run plus one console line per iteration."""

    def __init__(self, run_id: str, total: int, start: int):
        from prefect.artifacts import create_progress_artifact

        self.total = total
        self.id = create_progress_artifact(progress=100.0 * start / total, key=artifact_key(run_id, "progress"),
                                           description=f"Iterations of run {run_id}")

    def update(self, k: int, metrics: dict[str, Any]) -> None:
        from prefect.artifacts import update_progress_artifact

        update_progress_artifact(self.id, progress=100.0 * k / self.total)
        print(console_line(k, self.total, metrics), flush=True)


def console_line(k: int, total: int, metrics: dict[str, Any]) -> str:
    """Iteration k's console line: reward, loss and step time; after a validation also val/acc
    and verl's val-core metrics per data source (mean@N, best@N and maj@N ± bootstrap std).

    >>> console_line(5, 20, {"critic/score/mean": 0.5, "timing_s/step": 1.25, "val/acc": 0.4,
    ...                      "val-core/rlmill/arith/reward/mean@4": 0.4})
    '[#####               ] iter 5/20  score=0.5  step=1.25  val/acc=0.4  val-core rlmill/arith reward: mean@4=0.4'
    """
    bar = "#" * int(20 * k / total)
    shown = [f"{m.split('/')[-2] if m.count('/') > 1 else m.split('/')[-1]}={_fmt(metrics[m])}"
             for m in ("critic/score/mean", "actor/pg_loss", "timing_s/step") if m in metrics]
    if "val/acc" in metrics:
        shown.append(f"val/acc={_fmt(metrics['val/acc'])}")
    for (source, var), cells in sorted(_val_core_cells(metrics).items()):
        values = " ".join(f"{m}={c}" for m, c in sorted(cells.items(), key=_mean_first))
        shown.append(f"val-core {source} {var}: {values}")
    return f"[{bar:<20}] iter {k}/{total}  " + "  ".join(shown)


class MetricLoggers:
    """TensorBoard events, plus the MLflow / Weights & Biases runs trainer.loggers names
    (flows/trackers.py): iteration k's scalars at step k, and at close a summary and the curves.

    The config check (flows.config) refuses a named logger whose package is not installed, so
    by the time a run starts every logger named here imports.
    """

    def __init__(self, run_id: str, tb_dir: str | None, extra: list[str], config: dict[str, Any]):
        from flows.trackers import open_trackers

        self.run_id, self.tb = run_id, None
        self.history: list[tuple[int, dict[str, float]]] = []  # what this process logged: the closing summary
        if tb_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(tb_dir)
        self.trackers = open_trackers(run_id, extra, config)

    def log(self, k: int, metrics: dict[str, Any]) -> None:
        scalars = {m: float(v) for m, v in metrics.items() if isinstance(v, (int, float))}
        self.history.append((k, scalars))
        if self.tb is not None:
            for m, v in scalars.items():
                self.tb.add_scalar(m, v, k)
            self.tb.flush()
        for tracker in self.trackers:
            tracker.log(k, scalars)

    def close(self) -> None:
        """Call it from the run's `finally`: an exception on its way out means the run failed, and
        the trackers' runs end FAILED (MLflow status, W&B exit code 1) instead of FINISHED."""
        import sys

        failed = sys.exc_info()[0] is not None
        if self.tb is not None:
            self.tb.close()
        if not self.trackers:
            return
        from flows.trackers import finish_trackers

        # Every tracker ends even when one raises; with the run failed, the run's own error surfaces.
        finish_trackers(self.trackers, failed, self._summary(failed), curves_png(self.history, self._val_points()))

    def _summary(self, failed: bool) -> dict[str, Any]:
        last = {m: v for _, scalars in self.history for m, v in scalars.items()}  # each metric's latest value
        return {"run_id": self.run_id, "status": "failed" if failed else "finished",
                "iterations logged": [k for k, _ in self.history], "last": last}

    def _val_points(self) -> list[tuple[int, float]]:
        return [(k, s["val/acc"]) for k, s in self.history if "val/acc" in s]


def curves_png(history: list[tuple[int, dict]], val: list[tuple[int, float]]) -> bytes | None:
    """Reward (critic/score/mean) and validation accuracy per iteration, as PNG bytes; None, with
    one warning, where matplotlib is not installed (a slim environment such as the GPU bundle's:
    the run's numbers are all in its manifests, only the picture is missing)."""
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: no curves.png for this run (pip install matplotlib)")
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    if history:
        ax.plot([k for k, _ in history], [m.get("critic/score/mean", float("nan")) for _, m in history],
                label="train reward (critic/score/mean)")
    if val:
        ax.plot([k for k, _ in val], [a for _, a in val], "o-", label="held-out accuracy (val/acc)")
    ax.set_xlabel("iteration")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _val_core_cells(metrics: dict[str, Any]) -> dict[tuple[str, str], dict[str, str]]:
    """verl's val-core metrics (gpu_jobs.reward.val_metrics) by (data source, variable): metric ->
    its value as text, the bootstrap std beside its mean ("0.62 ± 0.05")."""
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for name, value in metrics.items():
        if not name.startswith("val-core/") or name.endswith("/std"):
            continue
        where, _, metric = name.removeprefix("val-core/").rpartition("/")
        if metric == "mean" and "@" in where.rpartition("/")[2]:  # best@n/mean, maj@n/mean
            where, _, metric = where.rpartition("/")
            std = metrics.get(f"val-core/{where}/{metric}/std")
            cell = f"{_fmt(value)} ± {_fmt(std)}" if std is not None else _fmt(value)
        else:
            cell = _fmt(value)
        source, _, var = where.rpartition("/")
        rows.setdefault((source, var), {})[metric] = cell
    return rows


def _mean_first(metric) -> tuple:
    name = metric[0] if isinstance(metric, tuple) else metric
    return name.split("@")[0] != "mean", name


def validation_markdown(metrics: dict[str, Any]) -> str:
    """verl's val-core metrics of a validation as a markdown table, one row per (data source,
    variable), one column per metric, the bootstrap std beside its mean ("0.62 ± 0.05"); ""
    when there are none."""
    rows = _val_core_cells(metrics)
    if not rows:
        return ""
    cols = sorted({m for r in rows.values() for m in r}, key=_mean_first)
    lines = ["| data source | variable | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for (source, var), cells in sorted(rows.items()):
        lines.append(f"| {source} | {var} | " + " | ".join(cells.get(c, "") for c in cols) + " |")
    return "\n".join(lines)


def validation_artifact(run_id: str, k: int, metrics: dict[str, Any]) -> None:
    """The validation after iteration k: val/acc and the val-core table (markdown artifact)."""
    from prefect.artifacts import create_markdown_artifact

    md = f"### Validation after iteration {k}\n\nval/acc: {_fmt(metrics.get('val/acc'))}\n\n"
    create_markdown_artifact(key=artifact_key(run_id, "validation"), markdown=md + validation_markdown(metrics),
                             description=f"Run {run_id}: validation after iteration {k} (verl val-core metrics)")


def final_artifact(run_id: str, summary: dict[str, Any], png_url: str | None,
                   val_metrics: dict[str, Any] | None = None) -> None:
    """The run's summary; with `val_metrics` (the last validation's manifest metrics) also
    verl's val-core metrics per data source."""
    from prefect.artifacts import create_markdown_artifact

    rows = "\n".join(f"| {k} | {_fmt(v)} |" for k, v in summary.items())
    md = f"## Run {run_id}\n\n| | |\n|---|---|\n{rows}\n\n"
    if png_url:
        md += f"Reward and validation-accuracy curves: [{png_url}]({png_url})\n"
    if table := validation_markdown(val_metrics or {}):
        md += f"\n### Validation (verl val-core: mean@N, best@N, maj@N ± bootstrap std)\n\n{table}\n"
    create_markdown_artifact(key=artifact_key(run_id, "summary"), markdown=md, description=f"Run {run_id} summary")


def local_tb_dir(root: str, run_id: str) -> str:
    """TensorBoard needs a local folder: the run's folder for a local root, else a cache dir."""
    if "://" not in root or root.startswith("file://"):
        return str(Path(root.removeprefix("file://")) / "runs" / run_id / "tensorboard")
    return str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlmill" / "tensorboard" / run_id)


def dumps(metrics: dict) -> str:
    return json.dumps(metrics, indent=1, sort_keys=True, default=str)


# ------------------------------------------------------------------------ a failure, reported once
class _OneTraceback(logging.Filter):
    """Drops Prefect log records that would repeat an error the rl-training flow already
    reported (flows.training.rl_training marks the exception): a user's mistake (`rlmill_line`)
    is reported by its one line, so no traceback at all; a bug (`rlmill_reported`) was logged
    with its traceback on the flow's summary line, so the engine's copies go ("Encountered
    exception during execution"; a deployment run's process logs it again on exit, "Engine
    execution exited with unexpected exception"; a parent flow logs it again)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and record.name == "prefect.task_runs" and getattr(record, "flow_name", None) in STAGE_FLOWS:
            # A stage task failed for good ("Task run failed ... Retries are exhausted"): the error
            # goes up to rl-training, which reports it once. Its one line stays; its traceback goes.
            record.exc_info, record.exc_text = None, None
            return True
        return exc is None or not (getattr(exc, "rlmill_line", None) or getattr(exc, "rlmill_reported", False))


STAGE_FLOWS = ("rl-training", "rl-iteration")  # the flows whose tasks are stages


def one_traceback_per_error() -> None:
    """Install _OneTraceback on the loggers Prefect's engines report failures on (idempotent)."""
    for name in ("prefect.flow_runs", "prefect.engine", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OneTraceback) for f in logger.filters):
            logger.addFilter(_OneTraceback())


def deliver_logged_line(flow_run_id: Any, text: str, timeout_s: float = 60.0) -> bool:
    """Block until a line this flow run logged is stored by the Prefect API; True once it is.

    Why: `prefect deployment run --watch` stops following a run's log stream 3 s after the run's
    final state arrives, and the run logger sends its batch every 2 s (longer when the cores are
    busy). A failure's one-line explanation logged just before the flow returns Failed could then
    miss the stream the user is watching. The server publishes a log to that stream in the same
    request that stores it, so once it can be read back it is on the stream before the state
    change. Costs one flush and a few reads, only on a failed run."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import get_current_settings

    if not get_current_settings().logging.to_api.enabled:
        return False
    APILogWorker.drain_all(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    only_this_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        while True:
            try:
                if any(text in entry.message for entry in client.read_logs(
                        log_filter=only_this_run, sort=LogSort.TIMESTAMP_DESC, limit=100)):
                    return True
            except Exception as exc:  # the API is down: the state message still carries the line
                log.warning("rlmill: could not confirm the failure's log line reached the API: %s", exc)
                return False
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)

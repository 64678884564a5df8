"""What people see: Prefect artifacts, console lines, TensorBoard events, the curves PNG.

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
        bar = "#" * int(20 * k / self.total)
        shown = "  ".join(f"{m.split('/')[-2] if m.count('/') > 1 else m.split('/')[-1]}={_fmt(metrics[m])}"
                          for m in ("critic/score/mean", "actor/pg_loss", "timing_s/step") if m in metrics)
        print(f"[{bar:<20}] iter {k}/{self.total}  {shown}", flush=True)


class MetricLoggers:
    """TensorBoard events, plus Weights & Biases / MLflow runs when the config names them.

    The config check (flows.config) refuses a named logger whose package is not installed, so
    by the time a run starts every logger named here imports.
    """

    def __init__(self, run_id: str, tb_dir: str | None, extra: list[str], config: dict[str, Any]):
        self.tb = self.wandb = self.mlflow = None
        if tb_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(tb_dir)
        if "wandb" in extra:
            import wandb

            self.wandb = wandb.init(project="rlmill", name=run_id, id=run_id, resume="allow", config=config)
        if "mlflow" in extra:
            import mlflow

            mlflow.set_experiment("rlmill")
            self.mlflow = mlflow.start_run(run_name=run_id)
            mlflow.log_params({"run_id": run_id})

    def log(self, k: int, metrics: dict[str, Any]) -> None:
        scalars = {m: float(v) for m, v in metrics.items() if isinstance(v, (int, float))}
        if self.tb is not None:
            for m, v in scalars.items():
                self.tb.add_scalar(m, v, k)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=k)
        if self.mlflow is not None:
            import mlflow

            # MLflow metric names may not contain '@' etc.; verl's '/' names are fine.
            mlflow.log_metrics(scalars, step=k)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            import mlflow

            mlflow.end_run()


def curves_png(history: list[tuple[int, dict]], val: list[tuple[int, float]]) -> bytes:
    """Reward (critic/score/mean) and validation accuracy per iteration, as PNG bytes."""
    import matplotlib

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


def final_artifact(run_id: str, summary: dict[str, Any], png_url: str) -> None:
    from prefect.artifacts import create_markdown_artifact

    rows = "\n".join(f"| {k} | {_fmt(v)} |" for k, v in summary.items())
    md = (f"## Run {run_id}\n\n| | |\n|---|---|\n{rows}\n\n"
          f"Reward and validation-accuracy curves: [{png_url}]({png_url})\n")
    create_markdown_artifact(key=artifact_key(run_id, "summary"), markdown=md, description=f"Run {run_id} summary")


def local_tb_dir(root: str, run_id: str) -> str:
    """TensorBoard needs a local folder: the run's folder for a local root, else a cache dir."""
    if "://" not in root or root.startswith("file://"):
        return str(Path(root.removeprefix("file://")) / "runs" / run_id / "tensorboard")
    return str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlmill" / "tensorboard" / run_id)


def dumps(metrics: dict) -> str:
    return json.dumps(metrics, indent=1, sort_keys=True, default=str)

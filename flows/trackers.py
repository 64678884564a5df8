"""The experiment trackers `trainer.loggers` names: MLflow and Weights & Biases, one tracker run
per rlmill run, fed by flows.reporting.MetricLoggers.

    MLFLOW_TRACKING_URI=http://127.0.0.1:5000 rlmill train --config examples/grpo_arith.yaml 'trainer.logger=[console,mlflow]'
    WANDB_MODE=offline rlmill train --config examples/grpo_arith.yaml 'trainer.logger=[console,wandb]'

What each gets, the way verl's and TRL's trackers do it: the run's frozen config (run.json) once,
as flattened params; every iteration's scalar metrics with the iteration as the step; at the end
a summary (JSON) and the reward/accuracy curves (PNG), then the tracker run's final status
(FAILED when the run failed). A resumed rlmill run continues its tracker run: W&B by id (the
rlmill run id), MLflow by the tag `rlmill.run_id`. Where they log is the trackers' own business:
MLFLOW_TRACKING_URI / MLFLOW_EXPERIMENT_NAME, WANDB_MODE / WANDB_DIR / WANDB_PROJECT.
Tested for real (an `mlflow server`, W&B offline files) in tests/flows/test_trackers.py.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

__all__ = ["MLFLOW_RUN_TAG", "MlflowTracker", "Tracker", "WandbTracker", "flat_params", "mlflow_name", "open_trackers"]

PROJECT = "rlmill"  # the MLflow experiment and W&B project when their environment names none
MLFLOW_RUN_TAG = "rlmill.run_id"  # how a resumed run finds its MLflow run again


class Tracker(Protocol):
    def log(self, k: int, scalars: dict[str, float]) -> None: ...

    def finish(self, failed: bool, summary: dict[str, Any], curves_png: bytes) -> None: ...


def open_trackers(run_id: str, names: list[str], config: dict[str, Any]) -> list[Tracker]:
    """The trackers `names` (trainer.loggers) asks for, each with its run started or resumed."""
    kinds = {"mlflow": MlflowTracker, "wandb": WandbTracker}
    return [kinds[name](run_id, config) for name in names]


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys (the same as the command line's overrides),
    values as text cut to MLflow's 6000 characters.

    >>> flat_params({"trainer": {"loggers": ["mlflow"], "val_every": 5}, "run_id": "r"})
    {'trainer.loggers': "['mlflow']", 'trainer.val_every': '5', 'run_id': 'r'}
    """
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{mlflow_name(str(key))}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, name + "."))
        else:
            out[name] = str(value)[:6000]
    return out


def mlflow_name(name: str) -> str:
    """A metric or param name MLflow accepts (letters, digits, `_ - . / : ` and spaces): verl's
    val-core names carry '@' (mean@4 -> mean_at_4).

    >>> mlflow_name("val-core/rlmill/arith/reward/mean@4")
    'val-core/rlmill/arith/reward/mean_at_4'
    """
    return re.sub(r"[^\w./:\- ]", "_", name.replace("@", "_at_"))


class MlflowTracker:
    """One MLflow run per rlmill run, through `MlflowClient` with the run id passed explicitly:
    the fluent API's active run is process-global, and a flow process may hold other runs.

        t = MlflowTracker("grpo-arith-1", frozen_config(cfg))   # MLFLOW_TRACKING_URI=http://...
        t.log(1, {"critic/score/mean": 0.25})
        t.finish(failed=False, summary={"val/acc after": 0.5}, curves_png=png_bytes)
    """

    def __init__(self, run_id: str, config: dict[str, Any]):
        from mlflow import MlflowClient
        from mlflow.environment_variables import MLFLOW_EXPERIMENT_NAME

        self.client = MlflowClient()  # MLFLOW_TRACKING_URI; unset, MLflow's default (./mlflow.db)
        experiment = self._experiment_id(MLFLOW_EXPERIMENT_NAME.get() or PROJECT)
        found = self.client.search_runs([experiment], filter_string=f"tags.`{MLFLOW_RUN_TAG}` = '{run_id}'",
                                        max_results=1)
        if found:  # a resumed rlmill run: the same MLflow run, its params already there (and immutable)
            self.id = found[0].info.run_id
            self.client.update_run(self.id, status="RUNNING")
            return
        self.id = self.client.create_run(experiment, run_name=run_id, tags={MLFLOW_RUN_TAG: run_id}).info.run_id
        from mlflow.entities import Param

        self.client.log_batch(self.id, params=[Param(k, v) for k, v in flat_params(config).items()])

    def _experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment else self.client.create_experiment(name)

    def log(self, k: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(mlflow_name(m), v, now, k) for m, v in scalars.items()])

    def finish(self, failed: bool, summary: dict[str, Any], curves_png: bytes) -> None:
        self.client.log_text(self.id, json.dumps(summary, indent=1, sort_keys=True, default=str),
                             "rlmill/summary.json")
        with tempfile.TemporaryDirectory(prefix="rlmill-mlflow-") as tmp:
            png = Path(tmp) / "curves.png"
            png.write_bytes(curves_png)
            self.client.log_artifact(self.id, str(png), "rlmill")
        self.client.set_terminated(self.id, "FAILED" if failed else "FINISHED")


class WandbTracker:
    """One W&B run per rlmill run, its id the rlmill run id (resume="allow" continues it). With
    WANDB_MODE=offline it writes `wandb/offline-run-*/run-<id>.wandb` under WANDB_DIR, for
    `wandb sync` later; every resumed process writes one more such folder with the same id."""

    def __init__(self, run_id: str, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT, name=run_id, id=run_id,
                              resume="allow", config=config)

    def log(self, k: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=k)

    def finish(self, failed: bool, summary: dict[str, Any], curves_png: bytes) -> None:
        # Files in run.dir are the run's files: uploaded with it (offline: by `wandb sync`).
        files = Path(self.run.dir)
        (files / "rlmill-summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True, default=str))
        (files / "curves.png").write_bytes(curves_png)
        self.run.finish(exit_code=1 if failed else 0)

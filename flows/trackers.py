"""The experiment trackers `trainer.loggers` names: MLflow and Weights & Biases, one tracker run
per rlmill run, fed by flows.reporting.MetricLoggers.

    MLFLOW_TRACKING_URI=http://127.0.0.1:5000 rlmill train --config examples/grpo_arith.yaml 'trainer.logger=[console,mlflow]'
    WANDB_MODE=offline rlmill train --config examples/grpo_arith.yaml 'trainer.logger=[console,wandb]'

What each gets, the way verl's and TRL's trackers do it: the run's frozen config (run.json) once,
as flattened params; every iteration's scalar metrics with the iteration as the step; at the end
a summary (JSON) and the reward/accuracy curves (PNG), then the tracker run's final status
(FAILED when the run failed). A resumed rlmill run continues its tracker run: W&B by id (the
rlmill run id), MLflow by the tag `rlmill.run_id`. Where they log is the trackers' own business:
MLFLOW_TRACKING_URI / MLFLOW_EXPERIMENT_NAME, WANDB_MODE / WANDB_DIR / WANDB_PROJECT. rlmill's
environment has MLflow's client only (mlflow-skinny); a tracking server with its web UI, in an
environment of its own: `"$(bash scripts/ensure_mlflow_server.sh | tail -1)" server ...`.

No tracker run is left RUNNING: when one tracker fails to open, those already opened are ended
FAILED (`abort`) before the error surfaces; `finish_trackers` ends every tracker even when one
of them raises. Tested for real (an `mlflow server`, W&B offline files) in
tests/flows/test_trackers.py; the MLflow web UI's run page in tests/flows/test_mlflow_ui.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Protocol

__all__ = ["MLFLOW_RUN_TAG", "MlflowTracker", "Tracker", "TrackerError", "WandbTracker", "finish_trackers",
           "flat_params", "mlflow_name", "open_trackers"]

log = logging.getLogger(__name__)

PROJECT = "rlmill"  # the MLflow experiment and W&B project when their environment names none
MLFLOW_RUN_TAG = "rlmill.run_id"  # how a resumed run finds its MLflow run again


class Tracker(Protocol):
    settings: str  # where its settings live: named by the error when its run does not open

    def log(self, k: int, scalars: dict[str, float]) -> None: ...

    def finish(self, failed: bool, summary: dict[str, Any], curves_png: bytes | None) -> None:
        """The report, then the run's final status; the status is set even when the report fails."""

    def abort(self, reason: str) -> None:
        """End the run FAILED with no report: the rlmill run stops before it began."""


class TrackerError(RuntimeError):
    """A tracker run that could not be opened or ended; the message names which and why."""


def open_trackers(run_id: str, names: list[str], config: dict[str, Any]) -> list[Tracker]:
    """The trackers `names` (trainer.loggers) asks for, each with its run started or resumed.
    If one fails to open, the ones opened before it are ended FAILED first: otherwise a team's
    MLflow would show a run RUNNING forever for an rlmill run that never started."""
    opened: list[Tracker] = []
    for name in names:
        try:
            opened.append(TRACKERS[name](run_id, config))
        except Exception as exc:
            reason = f"the {name} run of {run_id} did not open: {type(exc).__name__}: {exc}"
            ended, errors = _each(opened, lambda tracker: tracker.abort(reason))
            for error in errors:
                log.warning("rlmill: trainer.loggers: could not end %s", error)
            raise TrackerError(f"rlmill: trainer.loggers: {reason}"
                               + (f" (ended FAILED: {', '.join(ended)})" if ended else "")
                               + f"; fix: check {TRACKERS[name].settings}, or leave {name} out of trainer.loggers"
                               ) from exc
    return opened


def finish_trackers(trackers: list[Tracker], failed: bool, summary: dict[str, Any], curves_png: bytes | None) -> None:
    """Finish every tracker, even after one raised (each would otherwise stay RUNNING). With the
    run failed, a tracker that cannot be told is a warning: the run's own error is the one to
    surface. With the run finished, the trackers' errors are raised once all were tried."""
    _, errors = _each(trackers, lambda tracker: tracker.finish(failed, summary, curves_png))
    if errors and not failed:
        raise TrackerError(f"rlmill: trainer.loggers: could not end {'; '.join(errors)}")
    for error in errors:
        log.warning("rlmill: trainer.loggers: could not end %s", error)


def _each(trackers: list[Tracker], call: Callable[[Tracker], None]) -> tuple[list[str], list[str]]:
    """call(tracker) for every tracker, whatever the others raise: (the names of the trackers it
    worked for, "the <name> run: <error>" for the others)."""
    done, errors = [], []
    for tracker in trackers:
        name = TRACKER_NAMES[type(tracker)]
        try:
            call(tracker)
            done.append(name)
        except Exception as exc:
            errors.append(f"the {name} run: {type(exc).__name__}: {exc}")
    return done, errors


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

    settings = "MLFLOW_TRACKING_URI (is its server up?) and MLFLOW_EXPERIMENT_NAME"

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

        try:
            self.client.log_batch(self.id, params=[Param(k, v) for k, v in flat_params(config).items()])
        except Exception as exc:  # the run exists now: it must not stay RUNNING
            self.abort(f"its params were refused: {exc}")
            raise

    def _experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment else self.client.create_experiment(name)

    def log(self, k: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(mlflow_name(m), v, now, k) for m, v in scalars.items()])

    def finish(self, failed: bool, summary: dict[str, Any], curves_png: bytes | None) -> None:
        try:
            self.client.log_text(self.id, json.dumps(summary, indent=1, sort_keys=True, default=str),
                                 "rlmill/summary.json")
            if curves_png is not None:  # None: matplotlib not installed
                with tempfile.TemporaryDirectory(prefix="rlmill-mlflow-") as tmp:
                    png = Path(tmp) / "curves.png"
                    png.write_bytes(curves_png)
                    self.client.log_artifact(self.id, str(png), "rlmill")
        except Exception:  # no report, but the run still ends, and FAILED: its report is missing
            self.client.set_terminated(self.id, "FAILED")
            raise
        self.client.set_terminated(self.id, "FAILED" if failed else "FINISHED")

    def abort(self, reason: str) -> None:
        self.client.log_text(self.id, reason + "\n", "rlmill/aborted.txt")
        self.client.set_terminated(self.id, "FAILED")


class WandbTracker:
    """One W&B run per rlmill run, its id the rlmill run id (resume="allow" continues it). With
    WANDB_MODE=offline it writes `wandb/offline-run-*/run-<id>.wandb` under WANDB_DIR, for
    `wandb sync` later; every resumed process writes one more such folder with the same id."""

    settings = "WANDB_MODE, WANDB_DIR, WANDB_PROJECT (and `wandb login` when online)"

    def __init__(self, run_id: str, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT, name=run_id, id=run_id,
                              resume="allow", config=config)

    def log(self, k: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=k)

    def finish(self, failed: bool, summary: dict[str, Any], curves_png: bytes | None) -> None:
        # Files in run.dir are the run's files: uploaded with it (offline: by `wandb sync`).
        files = Path(self.run.dir)
        try:
            (files / "rlmill-summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True, default=str))
            if curves_png is not None:  # None: matplotlib not installed
                (files / "curves.png").write_bytes(curves_png)
        except Exception:  # no report, but the run still ends, and failed: its report is missing
            self.run.finish(exit_code=1)
            raise
        self.run.finish(exit_code=1 if failed else 0)

    def abort(self, reason: str) -> None:
        self.run.summary["rlmill/aborted"] = reason
        self.run.finish(exit_code=1)


# trainer.loggers' names (flows.config checks them) -> their trackers, and back for messages.
TRACKERS: dict[str, type] = {"mlflow": MlflowTracker, "wandb": WandbTracker}
TRACKER_NAMES = {kind: name for name, kind in TRACKERS.items()}

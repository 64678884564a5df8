"""Retrain on arrival: when enough feedback waits, train the promoted model on exactly the feedback
no earlier run trained on, score it against the promoted model on the fixed held-out set, and
promote it only if it is not worse (the nightly gate) -- or, with canary_share > 0, send that share of
live users to it and let rl-canary's stated test promote or roll it back (flows/online/canary.py).

    prefect deployment run 'rl-retrain/on-feedback' -p model=arith -p root=s3://bucket/rl     # by hand
    python -m flows.online.retrain --model arith root=/tmp/rl reward.custom_reward_function.path=my_reward.py

Started by its deployment trigger (deployments/prefect.yaml): the feedback consumer (flows/online/feedback.py)
emits `rlmill.feedback.window.ready` for a model after a drain when `readiness` holds -- at least
`ready_rows` feedback rows no run has trained on, or the oldest of them waiting `ready_after_s`
seconds -- and the trigger starts this flow with the event's model and root. The deployment's
concurrency limit of 1 (CANCEL_NEW) coalesces overlapping triggers: a run started while one trains
is cancelled, and the consumer's next drain announces what is still waiting.

One run, as Prefect tasks and one `rl-training` subflow:
  1. the reward check: the feedback rows' only ground truth is the logged answer's own text, so a
     built-in rule reward (which compares against a ground truth) is refused in one line (a config
     with a `preference:` section trains DPO/KTO on the window's ratings and needs no reward);
  2. the window (gpu_jobs.online.windows): the run's own window when it is a retry or resume (run_id
     given, or a window whose run never finished), else a new one holding every committed
     feedback segment no window holds, committed create-only; none -> a "nothing new" artifact,
     Completed; its run training in another live process (its run lock held: the trigger fired
     again meanwhile) -> "in progress", Completed, nothing touched. The run id is
     retrain-<model>-w<seq>, so a resume finds its committed stages;
  3. the rows: gpu_jobs.online.dataset's training rows of the window's feedback, written once as a
     verl-format prompt file under models/<name>/retrain/<run id>/, through the nightly's gate --
     or, for a preference run, the window's DPO pairs / KTO examples (window_preferences) as a
     preference file, preference.val_size of them (at most a quarter) held out for val/acc;
  4. train, evaluate, promote if not worse: flows.nightly.train_and_gate, the nightly's own path
     (history records the move as "retrain"); with canary_share > 0 a canary of the version starts
     instead of the move (models/<name>/CANARY; the first promotion of a model is direct);
  5. artifacts: the window (segments, rows), both scores, the decision; the window's done record.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from prefect import flow, get_run_logger, tags, task
from prefect.cache_policies import NONE as NO_CACHE

from flows.online.replay import check_replay, cold_start_rows, older_rows, replay_counts, sample_rows
from flows.reporting import artifact_key, run_logger
from flows.run_lock import RunLock
from storage import ModelLayout, join, url_to_fs
from gpu_jobs.online.windows import Piece, Readiness, Window, WindowLog, backlog, current_uris, readiness

if TYPE_CHECKING:
    from flows.config import RunConfig

__all__ = ["DEPLOYMENT", "check_reward", "feedback_pieces", "plan_training", "preference_held_out", "rl_retrain",
           "run_id_for", "window_preferences", "window_readiness", "window_rows"]

DEPLOYMENT = "rl-retrain/on-feedback"
FEEDBACK_ROWS = "feedback"  # the segment table whose rows the readiness rule counts
log = logging.getLogger("rlmill")


def run_id_for(model: str, seq: int) -> str:
    """The run that trains window `seq` of `model`: retrain-<model>-w<seq>."""
    return f"retrain-{model}-w{seq}"


# ------------------------------------------------------------------------------------ the data
def feedback_pieces(root: str, model: str, storage: Any = None) -> list[Piece]:
    """Every committed feedback segment of `model` as a window piece: manifest URI, its rows
    (answers, feedback) and commit time. One listing plus one GET per segment manifest."""
    from gpu_jobs.online.consumer import FEEDBACK_DIR, SEGMENT_KIND, segment_manifests
    from storage import check_name

    out = []
    for m in segment_manifests(join(root, FEEDBACK_DIR, check_name(model, "model name")), storage):
        if m.kind != SEGMENT_KIND:
            continue
        at = dt.datetime.fromisoformat(m.created_at).timestamp() if m.created_at else 0.0
        out.append(Piece(m.uri, {k: int(v) for k, v in m.metrics.items() if isinstance(v, int)}, at,
                         tuple(m.extra.get("replaces", ()))))  # a rewrite without a forgotten party's rows
    return out


def window_readiness(root: str, model: str, min_rows: int, max_wait_s: float, now: float | None = None,
                     storage: Any = None) -> Readiness:
    """The readiness rule for `model` from what storage holds: feedback rows no finished run
    trained on, and the age of the oldest segment holding some."""
    log_ = WindowLog(ModelLayout(root, model, storage))
    rows, age = backlog(log_, feedback_pieces(root, model, storage), FEEDBACK_ROWS, time.time() if now is None else now)
    return readiness(rows, age, min_rows, max_wait_s)


def window_rows(root: str, model: str, window: Window, storage: Any = None) -> list[dict[str, Any]]:
    """The verl-format training rows (gpu_jobs.online.dataset.training_rows) of the answer choices
    that received feedback in `window`'s segments -- a preference's loser included -- oldest first,
    each carrying only this window's ratings. Each feedback event lies in one segment and each
    segment in one window, so every feedback row is trained in exactly one window; a choice rated
    again later is trained again then, with the later ratings."""
    from gpu_jobs.online.dataset import training_rows

    uris = current_uris(window.uris, feedback_pieces(root, model, storage))  # a segment rewritten by a forget
    return training_rows(root, model, storage, feedback_from=uris)


# ------------------------------------------------------------------------------------ checks and plan
def check_reward(cfg: "RunConfig") -> str | None:
    """Why the run's reward cannot score re-rolled feedback prompts, as one line with the fix;
    None when it can. A feedback row's ground truth is the logged answer's own text and its
    data_source rlmill/feedback/<model> has no built-in scorer: the user's function decides what a
    good answer is (it gets that text as ground_truth and the feedback in extra_info), or a reward
    model alone does (combine=rm_only: the rule score is then only logged, where one exists)."""
    if cfg.reward.custom_reward_function.path is not None:
        return None
    if cfg.reward_model.enable and cfg.reward_model.combine == "rm_only":
        return None  # the reward model's score trains; the rule score is only logged where it exists
    rm = " (reward_model.combine=add adds the rule score to the model's)" if cfg.reward_model.enable else ""
    return ("reward: the built-in rule scorers compare answers with a ground truth, and a feedback window has "
            f"none (its rows' ground_truth is the logged answer's own text){rm}: set "
            "reward.custom_reward_function.path=<file.py> to a function that scores without one (it gets the "
            "feedback in extra_info), or train on a reward model's score alone (gpu_jobs/reward/model_reward.py): "
            "reward_model.enable=true reward_model.combine=rm_only")


def plan_training(batch_size: int, mini_batch_size: int, n_rows: int, epochs: int) -> tuple[list[str], int, int]:
    """(overrides, iterations, rows left out per epoch) that train `epochs` passes over a window
    of `n_rows` rows: the batch shrinks to the window when the window is smaller, and each epoch
    is n_rows // batch batches of a fresh permutation (verl's drop_last), so up to batch - 1 rows
    sit out each epoch.

    >>> plan_training(64, 16, 40, 1)
    (['data.train_batch_size=40', 'actor.ppo_mini_batch_size=16'], 1, 0)
    >>> plan_training(8, 4, 20, 2)
    (['data.train_batch_size=8', 'actor.ppo_mini_batch_size=4'], 4, 4)
    """
    batch = min(batch_size, n_rows)
    return ([f"data.train_batch_size={batch}", f"actor.ppo_mini_batch_size={min(mini_batch_size, batch)}"],
            epochs * (n_rows // batch), n_rows % batch)


def check_inputs(model: Any, root: Any, epochs: Any, eval_size: Any) -> str | None:
    """What is wrong with the parameters, as one line with the fix; None when nothing is.

    >>> check_inputs("arith", ".rlmill", 0, 300)
    'epochs=0: give the passes over the window (an int >= 1)'
    """
    from storage.errors import InvalidNameError
    from storage.layout import check_name, check_root

    try:
        check_root(root)
        check_name(model, "model name")
    except InvalidNameError as exc:
        return f"{exc} (the model/root parameters, which the trigger takes from the event)"
    for name, v in (("epochs", epochs), ("eval_size", eval_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"{name}={v!r}: give " + ("the passes over the window" if name == "epochs" else
                                             "the held-out rows scored") + " (an int >= 1)"
    return None


# ------------------------------------------------------------------------------------ artifacts
def window_table(window: Window, n_rows: int) -> list[dict[str, Any]]:
    """One row per segment of the window, then the training rows built from it."""
    rows = [{"segment": p.uri, "answers": p.rows.get("answers", 0), "feedback": p.rows.get("feedback", 0)}
            for p in window.pieces]
    return rows + [{"segment": f"window {window.seq} (run {window.run_id}): training rows", "answers": "",
                    "feedback": n_rows}]


def decision_markdown(model: str, window: Window, n_rows: int, left_out: int, out: Any, base: str,
                      base_version: str | None) -> str:
    from flows.nightly import _fmt, outcome_status

    d = out.decision
    verdict = {"promoted": f"PROMOTED `{out.promoted_to}`", "canary": f"CANARY `{out.canary}` started",
               "published": "PUBLISHED (another canary runs: no canary started)",
               "refused": "REFUSED (promoted model kept)"}[outcome_status(out)]
    return (f"## Retraining `{model}` on feedback window {window.seq}: {verdict}\n\n"
            "| model | weights | held-out mean reward | exact match | rows |\n|---|---|---|---|---|\n"
            f"| new (run `{window.run_id}`) | `{out.new_url}` | {_fmt(out.new_eval['mean_reward'])} | "
            f"{_fmt(out.new_eval['exact_match'])} | {out.new_eval['n']} |\n"
            f"| promoted ({f'version `{base_version}`' if base_version else 'config model'}) | `{base}` | "
            f"{_fmt(out.cur_eval['mean_reward'])} | {_fmt(out.cur_eval['exact_match'])} | {out.cur_eval['n']} |\n\n"
            f"**Decision:** {'promote' if d.promote else 'refuse'}: {d.reason}. "
            + (f"Live traffic decides next: canary `{out.canary}` (rl-canary).\n\n" if out.canary else
               "Promoted on the held-out gate alone, as the nightly does.\n\n" if out.promoted_to else "\n\n")
            +
            f"**Window {window.seq}:** {len(window.pieces)} segment(s), {window.rows('feedback')} feedback row(s) -> "
            f"{n_rows} training row(s); {left_out} row(s) sit out each epoch (batch remainder).\n")


def _markdown(model: str, markdown: str, description: str) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(key=artifact_key(model, "retrain"), markdown=markdown, description=description)


def _window_artifact(window: Window, n_rows: int) -> None:
    from prefect.artifacts import create_table_artifact

    create_table_artifact(key=artifact_key(window.run_id, "window"), table=window_table(window, n_rows),
                          description=f"Feedback window {window.seq}: its segments and training rows")


# ------------------------------------------------------------------------------------ tasks
# Each step is idempotent on its own (create-only window records, a rows file written once), so
# retries are harmless and no result cache is needed.
@task(name="open-window", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def open_window(root: str, model: str, run_id: str | None, storage: Any) -> Window | None:
    """The window this run trains on: `run_id`'s own, else one whose run never finished (resumed
    under its run id), else a new one over the segments no window holds; None: nothing new."""
    log_ = WindowLog(ModelLayout(root, model, storage))
    if run_id is not None:
        return log_.find(run_id)
    return log_.pending() or log_.claim(feedback_pieces(root, model, storage),
                                        run_id_for=lambda seq: run_id_for(model, seq))


def window_preferences(rows: list[dict[str, Any]], algorithm: str) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """A window's feedback rows as preference-file rows (TRL's columns) for a DPO or KTO run, and
    the builder's counts of what it dropped (gpu_jobs/data/preferences.py: votes merged per pair,
    KTO labels from thumbs)."""
    from gpu_jobs.data.preferences import kto_examples, preference_file_rows, preference_pairs

    items, counts = preference_pairs(rows) if algorithm == "dpo" else kto_examples(rows)
    return preference_file_rows(items), counts


def preference_held_out(n: int, val_size: int) -> int:
    """Pairs/examples of a window of `n` held out for the run's val/acc: preference.val_size, at
    most a quarter of the window, at least 2 (the key's floor).

    >>> preference_held_out(400, 64), preference_held_out(40, 64), preference_held_out(5, 64)
    (64, 10, 2)
    """
    return max(2, min(val_size, n // 4))


def _training_rows(rows: list[dict[str, Any]], preference: str | None, what: str) -> list[dict[str, Any]]:
    if preference is None:
        return rows
    rows, counts = window_preferences(rows, preference)
    run_logger().info("%s as %s rows: %s", what, preference, counts)
    return rows


@task(name="write-window-rows", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def write_window_rows(root: str, model: str, window: Window, dest: str, storage: Any,
                      preference: str | None = None, replay: dict[str, Any] | None = None) -> int:
    """The window's training rows as one Parquet file at `dest`, written once: verl prompt rows,
    or with `preference` ("dpo" | "kto") preference rows; then the `replay` rows (replay_counts,
    sampled with the window's seq as seed). A resumed run reads the file it wrote (the rows of
    committed segments never change anyway)."""
    import pyarrow.parquet as pq

    from storage.datasets import write_prompts

    fs, path = url_to_fs(dest, storage)
    if fs.exists(path):
        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).metadata.num_rows
    rows = _training_rows(window_rows(root, model, window, storage), preference, f"window {window.seq}")
    counts = replay_counts(len(rows), replay)
    parts = {"window": rows}
    if counts.get("feedback"):
        older = _training_rows(older_rows(root, model, window, storage), preference, "older windows")
        parts["feedback"] = sample_rows(older, counts["feedback"], window.seq)
    if counts.get("cold_start"):
        cold = cold_start_rows(replay["cold_start_files"], preference, storage)
        parts["cold_start"] = sample_rows(cold, counts["cold_start"], window.seq)
    if len(parts) > 1:
        run_logger().info("window %d: %s training rows", window.seq, {k: len(v) for k, v in parts.items()})
    rows = [r for part in parts.values() for r in part] if rows else []  # nothing new: nothing to replay for
    if rows:
        write_prompts(rows, dest, storage=storage)
    return len(rows)


# ------------------------------------------------------------------------------------ the flow
def _failed(line: str):
    """The run's Failed state for a refused input, tagged input-error so that the automatic resume
    (deployments/resume.py) leaves it: it would fail the same way."""
    from prefect.states import Failed

    from flows.training import INPUT_ERROR_TAG, _tag_flow_run

    get_run_logger().error("rlmill: %s", line)
    _tag_flow_run(INPUT_ERROR_TAG, quiet=True)
    return Failed(message=line)



def _nothing_new(root: str, model: str) -> dict[str, Any]:
    """Every committed segment is in a window (a trigger that fired twice): say so, Completed."""
    get_run_logger().info("nothing new: every committed feedback segment of %s is in a window", model)
    _markdown(model, f"## Retraining `{model}`: nothing new\n\nEvery committed feedback segment under "
                     f"`{join(root, 'feedback', model)}` is already in a window (a trigger that fired "
                     "twice, or overlapping triggers).\n", "nothing new")
    return {"status": "nothing new", "model": model}


def _in_progress(model: str, window: Window, holder: str) -> dict[str, Any]:
    """The window's run is training in another live process (the trigger fired again while it
    trains): nothing to do here, Completed, and nothing of that run touched."""
    get_run_logger().info("window %d of %s is in progress: %s", window.seq, model, holder)
    _markdown(model, f"## Retraining `{model}`: window {window.seq} in progress\n\nIts run `{window.run_id}` is "
                     f"training in another process ({holder}); this run did nothing.\n", "in progress")
    return {"status": "in progress", "model": model, "window": window.seq, "run_id": window.run_id}


def _window_rows_written(root: str, model: str, window: Window, dest: str, cfg: "RunConfig",
                         replay: dict[str, Any] | None) -> int:
    """The window's training rows written to `dest` (write_window_rows), its artifact and log line."""
    pref = cfg.preference
    n_rows = write_window_rows(root, model, window, dest, cfg.storage, pref.algorithm if pref else None, replay)
    _window_artifact(window, n_rows)
    get_run_logger().info("window %d: %d segment(s), %d feedback row(s) -> %d training row(s); run %s", window.seq,
                          len(window.pieces), window.rows("feedback"), n_rows, window.run_id)
    return n_rows


def _done_record(window: Window, n_rows: int, base: str, out: Any) -> dict[str, Any]:
    """The window's done record: what it trained, both scores, the decision (train_and_gate's `out`)."""
    return {"window": window.seq, "run_id": window.run_id, "segments": window.uris, "rows": n_rows,
            "feedback_rows": window.rows("feedback"), "base": base, "new": out.new_eval,
            "promoted_before": out.cur_eval, "decision": "promote" if out.decision.promote else "refuse",
            "reason": out.decision.reason, "promoted_version": out.promoted_to, "merged_export": out.merged_to,
            "canary": out.canary}


def _checked_parameters(model: Any, root: Any, epochs: Any, eval_size: Any, canary_share: Any, canary_test: Any,
                        config: str | None, overrides: list[str] | None) -> str | tuple[Any, Any, list[str]]:
    """(the run config, the canary policy, the overrides with root) or the one line that refuses them."""
    from flows.config import ConfigError, load_run_config
    from flows.nightly import canary_policy

    if (line := check_inputs(model, root, epochs, eval_size)) is not None:
        return line
    try:
        canary = canary_policy(canary_share, canary_test)
    except (TypeError, ValueError) as exc:
        return str(exc)
    overrides = [*(overrides or []), f"root={json.dumps(root)}"]
    try:
        cfg = load_run_config(config, overrides)
    except (ConfigError, ValueError) as exc:
        return f"config: {exc}"
    return (check_reward(cfg) if cfg.preference is None else None) or (cfg, canary, overrides)


@flow(name="rl-retrain", log_prints=True)
def rl_retrain(model: str = "arith", root: str = ".rlmill", config: str | None = "examples/grpo_arith.yaml",
               overrides: list[str] | None = None, run_id: str | None = None, epochs: int = 1,
               eval_size: int = 300, min_gain: float = 0.0, heldout_files: list[str] | None = None,
               export_merged_hf: bool = False, canary_share: float = 0.0,
               canary_test: dict[str, Any] | None = None, replay: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train `model`'s promoted version on the next feedback window (see the module docstring).

    model, root: the model and storage root (the trigger passes the event's); config/overrides:
    the run config (give the small lr or LoRA and the reward here; `root` wins over the config's);
    run_id: retrain-<model>-w<seq> to retry that window (default: the next one); epochs: passes
    over the window; eval_size, min_gain, heldout_files, export_merged_hf: the nightly's gate
    (flows/nightly.py); canary_share: > 0 starts a canary of a candidate that passed the gate, with
    that share of live users (0.0 promotes directly); canary_test: its test settings (min_samples: voters per arm,
    confidence, margin, max_duration_s, method: msprt (default) | welch; gpu_jobs.online.canary.CanaryPolicy);
    replay: rows replayed per window row, by source (check_replay). A wrong parameter or reward
    ends the run Failed with one line and the fix, before any window is taken.
    """
    from flows.nightly import ensure_heldout, gate_new_data, outcome_status, run_summary, train_and_gate

    checked = check_replay(replay) or _checked_parameters(model, root, epochs, eval_size, canary_share, canary_test,
                                                          config, overrides)
    if isinstance(checked, str):
        return _failed(checked)
    cfg, canary, overrides = checked
    models = ModelLayout(root, model, cfg.storage)
    if run_id is not None and WindowLog(models).find(run_id) is None:
        return _failed(f"run_id={run_id!r}: no feedback window of {model!r} is trained by that run; leave run_id "
                       "out to take the next window")
    with tags("rlmill", "retrain", f"model:{model}"):
        window = open_window(root, model, run_id, cfg.storage)
        if window is None:
            return _nothing_new(root, model)
        if (holder := RunLock(cfg.root, window.run_id).live_holder()) is not None:  # before any write of its run
            return _in_progress(model, window, holder)
        work, pref = join(models.root, "retrain", window.run_id), cfg.preference
        dest = join(work, "window.parquet")
        n_rows = _window_rows_written(root, model, window, dest, cfg, replay)
        held = preference_held_out(n_rows, pref.val_size) if pref else 0
        if n_rows - held < 1:  # e.g. only answers, ratings of answers the window cannot see, no pair
            WindowLog(models).finish(window, {"decision": "nothing to train", "rows": n_rows})
            return {"status": "nothing to train", "model": model, "window": window.seq, "run_id": window.run_id}
        plan, iterations, left_out = plan_training(cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size,
                                                   n_rows - held, epochs)
        base_version, base = models.current_version(), models.current_url() or cfg.model.path
        if pref:  # preference rows: the run's own checks read them (gpu_jobs/stages/preference_data.py)
            plan, train_files = [*plan, f"preference.val_size={held}"], [dest]
        else:
            train_files = gate_new_data([dest], cfg, base, work)
        heldout = ensure_heldout(cfg, models, max(eval_size, cfg.data.val_size), heldout_files)
        out = train_and_gate(config, [*overrides, *plan], cfg, models, base=base, train_files=train_files,
                             heldout=heldout, run_id=window.run_id, iterations=iterations, eval_size=eval_size,
                             min_gain=min_gain, export_merged_hf=export_merged_hf, by="retrain", canary=canary)
        _markdown(model, decision_markdown(model, window, n_rows, left_out, out, base, base_version),
                  f"Window {window.seq}: {outcome_status(out)}")
        record = _done_record(window, n_rows, base, out)
        WindowLog(models).finish(window, record)
        return {"status": outcome_status(out), "model": model, **record, "run": run_summary(out.run)}


def main(argv: list[str] | None = None) -> None:
    import argparse

    from flows.cli import _quiet_env

    p = argparse.ArgumentParser(prog="python -m flows.online.retrain",
                                description="retrain a model on its next feedback window")
    p.add_argument("--model", default="arith")
    p.add_argument("--config", default="examples/grpo_arith.yaml")
    p.add_argument("--run-id", default=None, help="retrain-<model>-w<seq>: retry that window (default: the next)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eval-size", type=int, default=300)
    p.add_argument("--min-gain", type=float, default=0.0)
    p.add_argument("--canary-share", type=float, default=0.0,
                   help="> 0: a candidate that passes the gate gets this share of live users (a canary that "
                        "rl-canary decides) instead of being promoted; 0 promotes directly (default)")
    p.add_argument("--replay", default=None, metavar="JSON",
                   help="rows replayed per window row, by source, e.g. '{\"feedback\": 0.2, \"cold_start\": 0.1, "
                        "\"cold_start_files\": [\"data/train.parquet\"]}' (default: the window only)")
    p.add_argument("overrides", nargs="*", help="dotted run-config overrides; root=... names the storage root")
    a = p.parse_args(argv)
    try:
        replay = json.loads(a.replay) if a.replay else None
    except ValueError as exc:
        raise SystemExit(f"rlmill: --replay {a.replay!r} is not JSON ({exc}): give e.g. '{{\"feedback\": 0.2}}'")
    _quiet_env()
    roots = [o.split("=", 1)[1] for o in a.overrides if o.startswith("root=")]
    from flows.online import run_for_cli

    summary = run_for_cli(rl_retrain, model=a.model, root=roots[-1] if roots else ".rlmill", config=a.config,
                          overrides=a.overrides, run_id=a.run_id, epochs=a.epochs, eval_size=a.eval_size,
                          min_gain=a.min_gain, canary_share=a.canary_share, replay=replay)
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()

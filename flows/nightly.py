"""Nightly retraining: train the promoted model on the prompts that arrived since the last
successful night, score the new checkpoint and the promoted model on a fixed held-out set, and
promote the new one only if it is not worse.

    prefect deployment run 'rl-nightly/nightly'          # what the 02:00 schedule triggers
    python -m flows.nightly --config examples/grpo_arith.yaml --model-name arith root=/tmp/rl

One night, as Prefect tasks and one `rl-training` subflow (each step is one plain function):
  1. new data: verl-format Parquet files under `new_data_prefix` (default <root>/incoming/<model>/)
     that the last successful night did not process (flows.nightly_state); none -> a "nothing to do"
     artifact, done;
  2. the gate: validate them (great-expectations, gpu_jobs.data.gates.validate_prompts);
  3. train: rl_training starting from the promoted version (models/<name>/CURRENT) or, before the
     first promotion, from the config's model; run id nightly-<YYYYMMDD>;
  4. evaluate: the run's own validation stage on the fixed held-out set (its first eval_size rows):
     before the first update it scores the promoted model, after the last the new one -- the one
     evaluation path a training run has, read back from its committed stages (`validation_scores`);
  5. decide: promote if new - promoted >= min_gain;
  6. promote (or, with canary_share > 0, start a canary: the version is published the same way and
     models/<name>/CANARY sends that share of live users to it until rl-canary's stated test
     promotes or rolls it back, flows/online/canary.py; with nothing promoted yet, or a canary of another
     candidate still running, see `_publish`): copy the HF folder to models/<name>/versions/<run id>
     through storage's commit primitive (every file verified, index last, create-only), then point CURRENT at it (a LoRA
     run's folder is its adapter + a pointer to its base; with export_merged_hf a plain merged
     HF folder is written to models/<name>/merged/<run id> too);
     a markdown artifact shows the decision and both scores;
  7. record: write models/<name>/nightly_state.json (only on success): which files are done.

Steps 3-6 are one function, `train_and_gate`, which retraining on arrival (flows/online/retrain.py) calls
too: the two flows differ in where the data comes from, not in how a candidate is judged.

A night that fails leaves the state untouched, so the next night sees the same files again and,
on the same date, resumes the same run id from its committed stages.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefect import flow, get_run_logger, tags, task
from prefect.cache_policies import NONE as NO_CACHE

from flows.config import load_run_config
from flows.nightly_state import NewFile, list_new_files, pick_run_id, read_state, record_success, state_url
from flows.reporting import artifact_key, run_logger
from gpu_jobs.online.canary import CanaryPolicy, CanaryRunning, start_canary
from storage import ModelLayout, RunLayout, committed, copy_checkpoint, join, url_to_fs

if TYPE_CHECKING:
    from flows.config import RunConfig

log = logging.getLogger("rlmill")


# ------------------------------------------------------------------------------------ the gate
def gate_new_data(files: list[str], cfg: "RunConfig", model: str, out_dir: str) -> list[str]:
    """Validate the new prompts; returns the files to train on (a clean copy when rows were
    quarantined). A failed gate in 'raise' mode fails the night and leaves the state as it was."""
    from gpu_jobs.data import render_many
    from gpu_jobs.models import load_tokenizer, resolve_model_path
    from storage.datasets import read_prompts, write_prompts
    from gpu_jobs.data.gates import validate_prompts

    df = read_prompts(files, storage=cfg.storage)
    gate = cfg.gate.model_copy(update={"max_prompt_length": cfg.gate.max_prompt_length or cfg.data.max_prompt_length})
    tok = load_tokenizer(resolve_model_path(model, cfg.storage, cfg.model.seed))
    result = validate_prompts(df, gate, join(out_dir, "_QUALITY.json"),
                              render=functools.partial(render_many, tokenizer=tok),
                              quarantine_url=join(out_dir, "quarantine.parquet"), storage=cfg.storage)
    run_logger().info("new data: %d rows in %d file(s), %d quarantined", result.n_rows, len(files),
                   result.n_quarantined)
    if not result.n_quarantined:
        return list(files)
    if len(result.clean) == 0:
        raise ValueError(f"every new row failed the data-quality gate; see {result.report_url}")
    return [write_prompts(result.clean.to_dict("records"), join(out_dir, "clean.parquet"), storage=cfg.storage)]


# ------------------------------------------------------------------------------------ held-out set
def ensure_heldout(cfg: "RunConfig", models: ModelLayout, size: int, heldout_files: list[str] | None) -> list[str]:
    """The fixed held-out set: `heldout_files`, else the config's data.val_files, else the
    config's built-in generator's test split, written once under models/<name>/heldout/."""
    from gpu_jobs.data import make_dataset

    if heldout_files:
        return list(heldout_files)
    if cfg.data.val_files:
        return list(cfg.data.val_files)
    if not cfg.data.generate:
        raise ValueError("no held-out set: pass heldout_files, or set data.val_files or data.generate")
    out = join(models.root, "heldout", f"{cfg.data.generate.replace(':', '-')}-seed{cfg.data.seed}-n{size}")
    test_url = join(out, "test.parquet")
    fs, path = url_to_fs(test_url, cfg.storage)
    if not fs.exists(path):
        make_dataset(cfg.data.generate, out, train_size=0, test_size=size, seed=cfg.data.seed, storage=cfg.storage)
    return [test_url]


# ------------------------------------------------------------------------------------ training
def train_night(config: str | None, overrides: list[str], *, base: str, train_files: list[str],
                heldout: list[str], run_id: str, iterations: int, eval_size: int,
                preference: bool = False) -> dict[str, Any]:
    """The `rl-training` subflow on `train_files` (tonight's, or a retraining window's), from
    `base`; returns its summary. It validates on the first `eval_size` rows of `heldout` before
    its first update (`base`'s score) and after its last (the new checkpoint's): the gate's two
    scores. `preference`: the files are DPO/KTO preference files (a run with a `preference:`
    section validates on held-out pairs of its own, not on `heldout` prompts)."""
    from flows.training import rl_training

    data = ([f"preference.train_files={json.dumps(train_files)}"] if preference else
            [f"data.train_files={json.dumps(train_files)}", f"data.val_files={json.dumps(heldout)}",
             f"data.val_size={eval_size}"])
    return rl_training(config=config, overrides=[
        *overrides, f"model.path={json.dumps(base)}", *data, f"run_id={run_id}",
        f"trainer.total_iterations={iterations}", "trainer.val_before_train=true"])


def validation_scores(layout: RunLayout, k: int) -> dict[str, float]:
    """The held-out scores of the weights after update k (k=0: the model the run started from),
    read from the run's committed validation stage: mean reward (val/acc), exact match (each
    response's text equal to its ground truth; NaN for a preference run, which scores pairs) and n.
    """
    from gpu_jobs.reward import decode_ground_truth
    from storage import NotCommittedError, read_manifest, read_table

    uri = committed(layout.stage(k, "validate"), layout.storage)
    if uri is None:
        raise NotCommittedError(f"run {layout.run_id} has no committed validation after iteration {k}")
    metrics = read_manifest(uri, layout.storage).metrics
    table = read_table(uri, storage=layout.storage)
    n = int(metrics.get("val/n", table.num_rows))
    exact = float("nan")
    if n and {"response_text", "ground_truth"} <= set(table.column_names):
        truths = [str(decode_ground_truth(g)) for g in table.column("ground_truth").to_pylist()]
        exact = sum(t.strip() == g for t, g in zip(table.column("response_text").to_pylist(), truths)) / n
    return {"mean_reward": float(metrics["val/acc"]) if n else float("nan"), "exact_match": exact, "n": n}


def run_summary(run: dict[str, Any]) -> dict[str, Any]:
    """The held-out accuracy before and after, from rl_training's summary (what a record keeps)."""
    return {k: run[k] for k in ("val/acc before", "val/acc after") if k in run}


# ------------------------------------------------------------------------------------ decision
@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def decide(new_score: float, current_score: float, min_gain: float = 0.0) -> Decision:
    """Promote when new - current >= min_gain ("not worse" at the default 0.0).

    >>> decide(0.52, 0.50).promote, decide(0.50, 0.50).promote, decide(0.49, 0.50).promote
    (True, True, False)
    """
    if not math.isfinite(new_score):
        return Decision(False, f"new score is {new_score}: nothing to compare")
    if not math.isfinite(current_score):
        return Decision(True, f"promoted model's score is {current_score}: the new one wins by default")
    gain = new_score - current_score
    # 1e-9: a tie computed from the same rows in a different order must count as "not worse".
    promote = gain >= min_gain - 1e-9
    return Decision(promote, f"new {new_score:.4f} - promoted {current_score:.4f} = {gain:+.4f} "
                             f"{'>=' if promote else '<'} min_gain {min_gain:+.4f}")


# ------------------------------------------------------------------------------------ promotion
def promote_version(src_url: str, models: ModelLayout, version: str, by: str = "nightly") -> str:
    """Publish the checkpoint at `src_url` as models/<name>/versions/<version> (storage's commit
    primitive: every file verified, index last, create-only), then point CURRENT at it, recorded
    in the model's history as moved `by` ("nightly", "retrain"). Safe to retry: a version already
    committed is not copied again."""
    dest = copy_checkpoint(src_url, models.version(version), models.storage)
    models.promote(version, by=by)
    return dest


def export_merged(src_url: str, dest_url: str, storage: Any = None) -> str:
    """A plain HF folder at `dest_url` (config, tokenizer, full safetensors; storage's commit
    primitive) of the model at `src_url`: a LoRA policy folder (adapter + base pointer) is merged
    with its base first, so the export loads with `from_pretrained` / vLLM anywhere, without peft
    or the base. Safe to retry: an export already committed is returned as it is."""
    from transformers import AutoConfig, AutoTokenizer

    from gpu_jobs.models.loading import read_state_dict, resolve_model_path
    from storage import INDEX_NAME, committed, save_checkpoint

    if committed(dest_url, storage, name=INDEX_NAME):
        return dest_url
    folder = resolve_model_path(src_url, storage)  # downloaded, and merged if an adapter
    return save_checkpoint(dest_url, read_state_dict(folder), config=AutoConfig.from_pretrained(folder),
                           tokenizer=AutoTokenizer.from_pretrained(folder), storage=storage)


def export_url(models: ModelLayout, version: str) -> str:
    """Where the merged export of a promoted version goes: models/<name>/merged/<version>."""
    return join(models.root, "merged", version)


# ------------------------------------------------------------------------------------ artifacts
def _fmt(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def decision_markdown(model_name: str, night: str, run_id: str, decision: Decision, new_eval: dict,
                      cur_eval: dict, new_url: str, base: str, base_version: str | None,
                      files: list[NewFile], promoted_to: str | None) -> str:
    verdict = (f"PROMOTED `{promoted_to}`" if promoted_to else "PASSED THE GATE: published for a canary"
               if decision.promote else "REFUSED (promoted model kept)")
    shown = "".join(f"\n- `{f.url}` ({f.size} bytes)" for f in files[:20])
    more = f"\n- ... and {len(files) - 20} more" if len(files) > 20 else ""
    return (
        f"## Nightly retraining of `{model_name}`, {night}: {verdict}\n\n"
        "| model | weights | held-out mean reward | exact match | rows |\n|---|---|---|---|---|\n"
        f"| new (run `{run_id}`) | `{new_url}` | {_fmt(new_eval['mean_reward'])} | "
        f"{_fmt(new_eval['exact_match'])} | {new_eval['n']} |\n"
        f"| promoted ({f'version `{base_version}`' if base_version else 'config model, nothing promoted yet'}) "
        f"| `{base}` | {_fmt(cur_eval['mean_reward'])} | {_fmt(cur_eval['exact_match'])} | {cur_eval['n']} |\n\n"
        f"**Decision:** {'promote' if decision.promote else 'refuse'}: {decision.reason}\n\n"
        f"**New data:** {len(files)} file(s){shown}{more}\n"
    )


def nothing_markdown(model_name: str, night: str, prefix: str, state: dict) -> str:
    last = state.get("last_success", {}).get("finished_at", "never")
    return (f"## Nightly retraining of `{model_name}`, {night}: nothing to do\n\n"
            f"No new Parquet files under `{prefix}` (last successful night: {last}; "
            f"{len(state['processed'])} file(s) already processed).\n")


def _markdown_artifact(model_name: str, markdown: str, description: str) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(key=artifact_key(model_name, "nightly"), markdown=markdown, description=description)


# ------------------------------------------------------------------------------------ tasks
# Each step is idempotent on its own (files are compared by name, the copy commits create-only),
# so no Prefect result cache is needed: NO_CACHE also avoids hashing the config on every call.
@task(name="find-new-data", retries=2, retry_delay_seconds=5, cache_policy=NO_CACHE)
def find_new_data(prefix: str, state_file: str, cfg: "RunConfig") -> list[NewFile]:
    return list_new_files(prefix, read_state(state_file, cfg.storage)["processed"], cfg.storage)


@task(name="validate-new-data", cache_policy=NO_CACHE)
def validate_new_data(files: list[str], cfg: "RunConfig", model: str, out_dir: str) -> list[str]:
    return gate_new_data(files, cfg, model, out_dir)


@task(name="evaluate", retries=1, cache_policy=NO_CACHE)
def evaluate(layout: RunLayout, k: int) -> dict[str, float]:
    return validation_scores(layout, k)


@task(name="promote", retries=2, cache_policy=NO_CACHE)
def promote(src_url: str, models: ModelLayout, version: str, by: str = "nightly") -> str:
    return promote_version(src_url, models, version, by)


def canary_version(src_url: str, models: ModelLayout, version: str, policy: CanaryPolicy, by: str) -> str | None:
    """Publish the checkpoint at `src_url` as version `version` (as promote_version does), then
    start a canary of it against CURRENT (gpu_jobs.online.canary.start_canary); returns the canary id, or
    None (logged) when a canary of another candidate runs: one is compared at a time, and this
    version waits, published, for a person (`rlmill models promote`). Safe to retry: the copy is
    create-only and a canary of the same candidate is the same one."""
    copy_checkpoint(src_url, models.version(version), models.storage)
    try:
        return start_canary(models, version, policy, by=by).id
    except CanaryRunning as exc:
        run_logger().warning("rlmill: %s published as a version, no canary started: %s", version, exc)
        return None


def canary_policy(share: Any, test: dict[str, Any] | None) -> CanaryPolicy | None:
    """The canary a flow's `canary_share` and `canary_test` ask for: None for share 0 (promote
    directly); ValueError, one line naming the key and the fix, for anything else wrong.

    >>> canary_policy(0.0, None), canary_policy(0.1, {"min_samples": 50}).min_samples
    (None, 50)
    """
    if share == 0 and not isinstance(share, bool):
        return None
    fields = set(CanaryPolicy.__dataclass_fields__) - {"share"}
    unknown = sorted(set(test or {}) - fields)
    if unknown:
        raise ValueError(f"canary_test: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    return CanaryPolicy(share=share, **(test or {}))


@task(name="start-canary", retries=2, cache_policy=NO_CACHE)
def canary_task(src_url: str, models: ModelLayout, version: str, policy: CanaryPolicy, by: str) -> str | None:
    return canary_version(src_url, models, version, policy, by)


@task(name="export-merged", retries=2, cache_policy=NO_CACHE)
def export(src_url: str, dest_url: str, storage: Any) -> str:
    return export_merged(src_url, dest_url, storage)


# ------------------------------------------------------------------------------------ the flow
def _today() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")


def _publish(decision: Decision, new_url: str, models: ModelLayout, version: str, export_merged_hf: bool,
             storage: Any, by: str, canary: CanaryPolicy | None = None) -> tuple[str | None, str | None, str | None]:
    """Step 6: when the decision promotes, the new checkpoint becomes `version` (and, asked for,
    its merged HF export); returns (promoted version, export URL, canary id), None for what did not
    happen. With `canary`, the version is published and a canary of it starts instead of the move
    of CURRENT -- except before the first promotion (no CURRENT to compare with: promoted
    directly); while a canary of another candidate runs, the version is published and waits
    (promote it by hand, `rlmill models promote`), since one canary at a time is compared."""
    if not decision.promote:
        return None, None, None
    def merged(version_url: str) -> str | None:
        return export(version_url, export_url(models, version), storage) if export_merged_hf else None

    if canary is not None and models.current_version() not in (None, version):
        canary_id = canary_task(new_url, models, version, canary, by)
        return None, merged(models.version(version)), canary_id
    return version, merged(promote(new_url, models, version, by)), None


@dataclass(frozen=True)
class Outcome:
    """What train_and_gate did: the run's summary, the new checkpoint, both held-out scores, the
    decision, and the version (and merged export) it published, None when refused; `canary` is
    the id of the canary started for it instead (None: none)."""

    run: dict[str, Any]
    new_url: str
    new_eval: dict[str, float]
    cur_eval: dict[str, float]
    decision: Decision
    promoted_to: str | None
    merged_to: str | None
    canary: str | None = None


def train_and_gate(config: str | None, overrides: list[str], cfg: "RunConfig", models: ModelLayout, *, base: str,
                   train_files: list[str], heldout: list[str], run_id: str, iterations: int, eval_size: int,
                   min_gain: float, export_merged_hf: bool, by: str, canary: CanaryPolicy | None = None) -> Outcome:
    """Steps 3-6, shared by the nightly and the retrain-on-arrival flows: train `run_id` from
    `base` on `train_files`, score the new checkpoint and `base` on the fixed held-out set (the
    run's validation after its last update and before its first), promote the new one as version `run_id` only if it is not worse (`min_gain`), recorded
    in the model's history as moved `by` -- or, with `canary`, published as that version with a
    canary of it started (see `_publish`). Every step is idempotent, so a resumed run id re-does
    nothing committed."""
    run = train_night(config, overrides, base=base, train_files=train_files, heldout=heldout, run_id=run_id,
                      iterations=iterations, eval_size=eval_size, preference=cfg.preference is not None)
    layout = RunLayout(cfg.root, run_id, cfg.storage)
    new_url = layout.policy(iterations)
    new_eval = evaluate.with_options(task_run_name="evaluate-new")(layout, iterations)
    cur_eval = evaluate.with_options(task_run_name="evaluate-promoted")(layout, 0)
    decision = decide(new_eval["mean_reward"], cur_eval["mean_reward"], min_gain)
    promoted_to, merged_to, canary_id = _publish(decision, new_url, models, run_id, export_merged_hf, cfg.storage,
                                                 by, canary)
    run_logger().info("decision: %s (%s)%s", "promote" if decision.promote else "refuse", decision.reason,
                   f"; canary {canary_id} started" if canary_id else "")
    return Outcome(run, new_url, new_eval, cur_eval, decision, promoted_to, merged_to, canary_id)


@flow(name="rl-nightly", log_prints=True)
def rl_nightly(config: str | None = "examples/grpo_arith.yaml", overrides: list[str] | None = None,
               model_name: str = "arith", new_data_prefix: str | None = None, iterations: int = 10,
               eval_size: int = 300, min_gain: float = 0.0, night: str | int | None = None,
               heldout_files: list[str] | None = None, export_merged_hf: bool = False, canary_share: float = 0.0,
               canary_test: dict[str, Any] | None = None) -> dict[str, Any]:
    """One night of retraining (see the module docstring).

    config/overrides: the run config (root, storage, model, algorithm ...); new_data_prefix:
    where new verl Parquet files land (default <root>/incoming/<model_name>); iterations: RL
    iterations per night; eval_size: held-out rows scored for the decision; min_gain: how much
    better (mean reward) the new model must be, 0.0 = not worse; night: YYYYMMDD (default today,
    UTC) names the run; heldout_files: the held-out set (default: data.val_files, else generated);
    export_merged_hf: also write the promoted version as a plain HF folder with full weights under
    models/<name>/merged/<version> (a LoRA run promotes its adapter + base pointer; this is the
    merged model for serving without peft); canary_share, canary_test: as rl-retrain's (a canary
    of that share of live users instead of a direct promotion; 0.0 promotes directly).
    """
    try:
        canary = canary_policy(canary_share, canary_test)
    except (TypeError, ValueError) as exc:
        return _refused(str(exc))
    overrides = list(overrides or [])
    cfg = load_run_config(config, overrides)
    models = ModelLayout(cfg.root, model_name, cfg.storage)
    state_file = state_url(models)
    state = read_state(state_file, cfg.storage)
    prefix = new_data_prefix or join(cfg.root, "incoming", model_name)
    night = str(night or _today())  # `-p night=20260101` on the CLI arrives as an int
    logger = get_run_logger()
    with tags("rlmill", "nightly", f"model:{model_name}"):
        # 1. new data
        new = find_new_data(prefix, state_file, cfg)
        if not new:
            logger.info("no new data under %s: nothing to do", prefix)
            _markdown_artifact(model_name, nothing_markdown(model_name, night, prefix, state), "nothing to do")
            return {"status": "nothing to do", "model": model_name, "prefix": prefix}
        base_version, base = models.current_version(), models.current_url() or cfg.model.path
        run_id = pick_run_id(night, state, [f.url for f in new], cfg.root, cfg.storage)
        logger.info("%d new file(s); run %s starts from %s", len(new), run_id, base)
        # 2. the gate, 3. training
        train_files = validate_new_data([f.url for f in new], cfg, base, join(models.root, "nightly", run_id))
        heldout = ensure_heldout(cfg, models, max(eval_size, cfg.data.val_size), heldout_files)
        # 4. evaluation, 5. decision, 6. promotion
        out = train_and_gate(config, overrides, cfg, models, base=base, train_files=train_files, heldout=heldout,
                             run_id=run_id, iterations=iterations, eval_size=eval_size, min_gain=min_gain,
                             export_merged_hf=export_merged_hf, by="nightly", canary=canary)
        decision = out.decision
        _markdown_artifact(model_name, decision_markdown(model_name, night, run_id, decision, out.new_eval,
                                                         out.cur_eval, out.new_url, base, base_version, new,
                                                         out.promoted_to),
                           f"Nightly {night}: {'promoted' if decision.promote else 'refused'}")
        # 7. record
        record = {"night": night, "run_id": run_id, "files": [f.rel for f in new], "new": out.new_eval,
                  "promoted_before": out.cur_eval, "base": base,
                  "decision": "promote" if decision.promote else "refuse", "reason": decision.reason,
                  "promoted_version": out.promoted_to, "merged_export": out.merged_to, "canary": out.canary}
        record_success(state_file, state, new, record, cfg.storage)
        return {"status": outcome_status(out), "model": model_name, **record,
                "run": run_summary(out.run)}


def outcome_status(out: Outcome) -> str:
    """"canary" (a canary of the candidate started), "promoted", "published" (passed the gate while
    a canary of another candidate runs: a version, not CURRENT) or "refused" (by the gate)."""
    if out.canary or out.promoted_to:
        return "canary" if out.canary else "promoted"
    return "published" if out.decision.promote else "refused"


def _refused(line: str):
    from prefect.states import Failed

    get_run_logger().error("rlmill: %s", line)
    return Failed(message=line)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from flows.cli import _quiet_env

    p = argparse.ArgumentParser(prog="python -m flows.nightly", description="one night of retraining")
    p.add_argument("--config", default="examples/grpo_arith.yaml")
    p.add_argument("--model-name", default="arith")
    p.add_argument("--new-data-prefix", default=None)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--eval-size", type=int, default=300)
    p.add_argument("--min-gain", type=float, default=0.0)
    p.add_argument("--night", default=None, help="YYYYMMDD (default: today, UTC)")
    p.add_argument("--export-merged-hf", action="store_true",
                   help="also write the promoted version as a plain HF folder under models/<name>/merged/<version>")
    p.add_argument("overrides", nargs="*", help="dotted run-config overrides, e.g. root=/tmp/rl")
    a = p.parse_args(argv)
    _quiet_env()
    out = rl_nightly(config=a.config, overrides=a.overrides, model_name=a.model_name,
                     new_data_prefix=a.new_data_prefix, iterations=a.iterations, eval_size=a.eval_size,
                     min_gain=a.min_gain, night=a.night,
                     **({"export_merged_hf": True} if a.export_merged_hf else {}))
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()

"""The canary's decision: a candidate served to a sticky share of live traffic (gpu_jobs/online/canary.py,
gpu_jobs/online/swap.py) is promoted or rolled back by a stated test on the two arms' feedback.

    prefect deployment run 'rl-canary/decide' -p model=arith -p root=s3://bucket/rl      # by hand
    python -m flows.online.canary --model arith --root /tmp/rl
    rlmill models canary arith --root /tmp/rl                                              # the numbers now

Started by its deployment trigger (deployments/prefect.yaml) on each `rlmill.feedback.segment.committed`
the feedback consumer emits for a model. One run:
  1. the record: models/<name>/CANARY; none -> Completed, nothing done (most segments arrive with
     no canary running);
  2. an outcome already committed for this canary (a decider that crashed after committing it)
     -> applied and finished, never decided again;
  3. the arms: every committed feedback row of the model given since the canary started, split
     by the version that answered (the `version` column): baseline = the record's baseline,
     candidate = its candidate, one sample per distinct voter and arm -- the mean of its votes,
     one vote per answer whatever its n (gpu_jobs.online.canary_stats.split_arms);
  4. the test: gpu_jobs.online.canary_stats.canary_test with the record's method (msprt, the
     always-valid sequential test, for new canaries; welch, the one-sided t-test of
     non-inferiority), min_samples (voters per arm), confidence, margin and max_duration_s;
  5. the decision: wait -> nothing changes; promote -> the outcome record (create-only), CURRENT
     -> candidate (history by "canary", its numbers as the reason), CANARY removed, serve swaps
     to the candidate it already holds; rollback -> the outcome record, a history record
     "canary-rollback" (CURRENT stays, its numbers as the reason), CANARY removed, serve retires
     the candidate. The decision and its numbers are a markdown and a table artifact.
The deployment's concurrency limit of 1 (CANCEL_NEW) keeps deciders from overlapping; the
create-only outcome record makes even two racing deciders settle one decision.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, tags, task
from prefect.cache_policies import NONE as NO_CACHE

from flows.reporting import artifact_key
from gpu_jobs.online.canary_stats import CanaryVerdict, canary_test, split_arms
from storage import ModelLayout, join, url_to_fs
from gpu_jobs.online.canary import Canary, end_canary, read_canary, read_outcome, remove_canary

__all__ = ["DEPLOYMENT", "arm_feedback", "measure", "rl_canary", "settle", "verdict_markdown", "verdict_table"]

DEPLOYMENT = "rl-canary/decide"
BY_PROMOTE, BY_ROLLBACK = "canary", "canary-rollback"  # the history records' `by`


# ------------------------------------------------------------------------------------ the arms
def arm_feedback(root: str, model: str, since: float, storage: Any = None) -> list[dict[str, Any]]:
    """Every committed feedback row of `model` in the hour folders that can hold feedback given at
    or after `since` (Unix s): a segment's hour is its events' `created` hour, so older hours are
    not read. Costs one listing, then one listing and the manifests of each hour folder read."""
    from gpu_jobs.online.consumer import FEEDBACK_DIR, SEGMENT_KIND, hour_of, manifest_rows, segment_manifests
    from gpu_jobs.online.governance import forgotten_users
    from storage import check_name

    base = join(root, FEEDBACK_DIR, check_name(model, "model name"))
    fs, path = url_to_fs(base, storage)
    if not fs.exists(path):
        return []
    first = hour_of(since)
    hours = sorted(h for h in (p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)) if h >= first)
    rows: list[dict[str, Any]] = []
    forgotten = forgotten_users(root, storage)  # rlmill feedback forget: their votes count for nothing
    for hour in hours:
        for m in segment_manifests(join(base, hour), storage):
            files = [f for f in m.files if f.path.startswith("feedback-")] if m.kind == SEGMENT_KIND else []
            if files:
                rows.extend(r for r in manifest_rows(m, files, storage) if r.get("user") not in forgotten)
    return rows


def measure(models: ModelLayout, canary: Canary, now: float | None = None) -> CanaryVerdict:
    """The stated test on `canary`'s two arms as storage holds them now."""
    since = canary.started_ts
    baseline, candidate = split_arms(arm_feedback(models.root_url, canary.model, since, models.storage),
                                     canary.baseline, canary.candidate, since)
    return canary_test(baseline, candidate, min_samples=canary.min_samples, confidence=canary.confidence,
                       margin=canary.margin, elapsed_s=(time.time() if now is None else now) - since,
                       max_duration_s=canary.max_duration_s, method=canary.method)


# ------------------------------------------------------------------------------------ the decision
def _summary(canary: Canary, outcome: str, numbers: dict[str, Any]) -> str:
    """One line for the history record: the canary, its outcome and its numbers."""
    def f(k: str) -> str:
        v = numbers.get(k)
        return f"{v:+.4f}" if isinstance(v, float) else str(v)

    verb = "promoted" if outcome == "promote" else "rolled back"
    return (f"canary {canary.id}: {canary.candidate} {verb} against {canary.baseline}: n {numbers.get('n_baseline')}"
            f"/{numbers.get('n_candidate')}, mean {f('mean_baseline')}/{f('mean_candidate')}, diff {f('diff')} "
            f"[{f('lower')}, {f('upper')}] at {numbers.get('confidence')}, margin {numbers.get('margin')}, "
            f"p {numbers.get('p_value')}; {numbers.get('reason', '')}")


def settle(models: ModelLayout, canary: Canary, outcome: str, numbers: dict[str, Any],
           by: str = "rl-canary") -> dict[str, Any]:
    """End `canary` with `outcome` ("promote" | "rollback"): commit its outcome record (or take the
    one committed before: that decision stands), apply it -- promote: CURRENT -> candidate,
    history by "canary"; rollback: a history record "canary-rollback" at CURRENT -- once (a
    history record naming the canary means it was applied), then remove CANARY. Returns the
    outcome record. Safe to re-run at any point."""
    record = end_canary(models, canary, outcome, numbers, by=by)
    outcome, numbers = record["outcome"], record["numbers"]
    line = _summary(canary, outcome, numbers)
    applied = any(str(r.get("reason") or "").startswith(f"canary {canary.id}:") for r in models.history())
    if not applied:
        if outcome == "promote":
            models.promote(canary.candidate, by=BY_PROMOTE, reason=line, user=record["by"])
        else:
            current = models.current_version() or canary.baseline
            models.record_move(current, current, by=BY_ROLLBACK, reason=line, user=record["by"])
    remove_canary(models, canary)
    return record


# ------------------------------------------------------------------------------------ artifacts
def _num(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else "-" if v is None else str(v)


def verdict_table(numbers: dict[str, Any]) -> list[dict[str, str]]:
    """One row per number of the test (a CanaryVerdict.as_dict())."""
    return [{"quantity": k, "value": _num(v)} for k, v in numbers.items() if k not in ("reason",)]


def verdict_markdown(canary: Canary, decision: str, numbers: dict[str, Any], finished: bool) -> str:
    verdict = {"promote": f"PROMOTED `{canary.candidate}`", "rollback": f"ROLLED BACK `{canary.candidate}`",
               "wait": "WAITING (nothing changed)"}[decision]
    n = numbers
    return (f"## Canary `{canary.id}` of `{canary.model}`: {verdict}\n\n"
            f"{n.get('test')}: H0 candidate - baseline <= -{n.get('margin')}; {canary.share:.0%} of voters "
            f"on the candidate since {canary.started}; min {n.get('min_samples')} voters per arm, confidence "
            f"{n.get('confidence')}, max duration {n.get('max_duration_s')} s "
            f"(elapsed {_num(n.get('elapsed_s'))} s).\n\n"
            "| arm | version | voters | mean score |\n|---|---|---|---|\n"
            f"| baseline | `{canary.baseline}` | {n.get('n_baseline')} | {_num(n.get('mean_baseline'))} |\n"
            f"| candidate | `{canary.candidate}` | {n.get('n_candidate')} | {_num(n.get('mean_candidate'))} |\n\n"
            f"**Difference:** {_num(n.get('diff'))}, "
            f"one-sided bounds [{_num(n.get('lower'))}, {_num(n.get('upper'))}], "
            f"df {_num(n.get('df'))}, p = {_num(n.get('p_value'))}.\n\n"
            f"**Decision:** {decision}: {n.get('reason')}"
            + ("" if not finished else ". CANARY removed; the outcome is under "
               f"models/{canary.model}/canaries/{canary.id}.json and in the model's history.") + "\n")


def _artifacts(canary: Canary, decision: str, numbers: dict[str, Any], finished: bool) -> None:
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    create_markdown_artifact(key=artifact_key(canary.model, "canary"),
                             markdown=verdict_markdown(canary, decision, numbers, finished),
                             description=f"Canary {canary.id}: {decision}")
    create_table_artifact(key=artifact_key(canary.model, "canary-numbers"), table=verdict_table(numbers),
                          description=f"Canary {canary.id}: the test's numbers")


# ------------------------------------------------------------------------------------ tasks
@task(name="read-canary", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def read_record(models: ModelLayout) -> Canary | None:
    return read_canary(models)


@task(name="measure-arms", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def measure_arms(models: ModelLayout, canary: Canary) -> CanaryVerdict:
    return measure(models, canary)


@task(name="settle-canary", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def settle_task(models: ModelLayout, canary: Canary, outcome: str, numbers: dict[str, Any]) -> dict[str, Any]:
    return settle(models, canary, outcome, numbers)


# ------------------------------------------------------------------------------------ the flow
def check_inputs(model: Any, root: Any) -> str | None:
    """What is wrong with the parameters, as one line with the fix; None when nothing is.

    >>> check_inputs("arith", ".rlmill") is None, check_inputs("../x", ".rlmill").startswith("invalid model name")
    (True, True)
    """
    from storage.errors import InvalidNameError
    from storage.layout import check_name, check_root

    try:
        check_root(root)
        check_name(model, "model name")
    except InvalidNameError as exc:
        return f"{exc} (the model/root parameters, which the trigger takes from the event)"
    return None


@flow(name="rl-canary", log_prints=True)
def rl_canary(model: str = "arith", root: str = ".rlmill") -> dict[str, Any]:
    """Decide `model`'s running canary under `root` (see the module docstring): promote, roll
    back, or wait. A wrong parameter ends the run Failed with one line and the fix."""
    from prefect.states import Failed

    logger = get_run_logger()
    if (line := check_inputs(model, root)) is not None:
        logger.error("rlmill: %s", line)
        return Failed(message=line)
    models = ModelLayout(root, model)
    with tags("rlmill", "canary", f"model:{model}"):
        canary = read_record(models)
        if canary is None:
            logger.info("no canary of %s runs: nothing to decide", model)
            return {"status": "no canary", "model": model}
        if (done := read_outcome(models, canary.id)) is not None:  # committed by a decider that crashed after
            decision, numbers = done["outcome"], done["numbers"]
        else:
            verdict = measure_arms(models, canary)
            decision, numbers = verdict.decision, verdict.as_dict()
        finished = decision != "wait"
        if finished:
            decision = settle_task(models, canary, decision, numbers)["outcome"]
        logger.info("canary %s: %s (%s)", canary.id, decision, numbers.get("reason"))
        _artifacts(canary, decision, numbers, finished)
        return {"status": decision, "model": model, "canary": canary.id, "candidate": canary.candidate,
                "baseline": canary.baseline, **{k: numbers.get(k) for k in ("n_baseline", "n_candidate",
                                                                             "mean_baseline", "mean_candidate",
                                                                             "diff", "lower", "upper", "p_value")}}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    import os

    p = argparse.ArgumentParser(prog="python -m flows.online.canary", description="decide a model's running canary")
    p.add_argument("--model", default="arith")
    p.add_argument("--root", default=".rlmill")
    a = p.parse_args(argv)
    # flows.cli's _quiet_env, by hand: importing flows.cli here would loop back through cli_models.
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    from flows.online import run_for_cli

    print(json.dumps(run_for_cli(rl_canary, model=a.model, root=a.root), indent=1, default=str))


if __name__ == "__main__":
    main()

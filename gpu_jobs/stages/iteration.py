"""The stages of one RL iteration, each declared once with `@stage` (shell.py: its compute
inside the commit shell, where it runs, when it is needed):
`stage(run, roles, k, *input_uris) -> manifest URI`.

A stage reads only committed inputs, computes, and returns its table and metrics; the shell
returns an existing commit instead of recomputing and writes the manifest last. In-memory state
(the warm roles) is only ever derived from committed data. The order they run in is written
once, in `graph.py`:

    rollout -> gate -> {reward model -> reward, logprobs, values} -> advantages -> update -> weight sync -> commit
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np
import pyarrow as pa

from gpu_jobs.stages.roles import Roles
from gpu_jobs.stages.resume import recover_lost_trainer
from gpu_jobs.stages.run import Run, sampling_seed
from gpu_jobs.stages.updates import train_on
from gpu_jobs.stages.samples import FLOAT_LIST, join_by_uid, response_masks, sample_table
from gpu_jobs.stages.scoring import evaluate, greedy_evaluate, reward_rows
from gpu_jobs.stages.shell import STAGES, Output, read, stage
from storage import INDEX_NAME, committed, exists, join, read_manifest


def _policy_ref(run: Run, version: int) -> str:
    """The committed thing the weights after update `version` came from: that update's manifest,
    a forked run's copy of its parent's checkpoint (gpu_jobs/stages/fork.py), or the start model."""
    if version == 0:
        return run.model_path
    return (committed(run.layout.stage(version, "update"), run.storage)
            or committed(run.layout.policy(version), run.storage, name=INDEX_NAME) or run.model_path)


# -------------------------------------------------------------------------------- rollout
@stage("rollout", where="rollout")
def rollout(run: Run, roles: Roles, k: int) -> Output:
    """Iteration k's samples, drawn with the weights the async schedule names for k (the
    previous update's in the synchronous loop); the manifest records that version."""
    from gpu_jobs.rollout.agent_loop import AgentLoopEngine, generate_with_rows  # multi-turn: Roles wraps the engine

    cfg = run.cfg
    version = cfg.async_training.weights_version(k)
    roles.put_rollout_at(run, version)
    t0 = time.perf_counter()
    if cfg.algorithm.filter_groups.enable:
        table, metrics = _refilled_rollout(run, roles, k)
    else:
        prompts, prompt_ids = run.batch_prompts(k)
        out = generate_with_rows(roles.rollout, prompts, prompt_ids, cfg.rollout.n,
                                 cfg.rollout.sampling(sampling_seed(cfg.data.seed, k)))
        table, metrics = sample_table(out, prompts, k), {"timing_s/gen": time.perf_counter() - t0}
    lens = np.asarray(table.column("response_len").to_pylist(), dtype=np.float64)
    metrics.update({
        "response_length/mean": float(lens.mean()), "response_length/max": float(lens.max()),
        "response_length/min": float(lens.min()),
        "response_length/clip_ratio": float(np.mean(np.asarray(table.column("finish_reason").to_pylist()) == "length")),
        # every round's tokens under dynamic sampling (the kept rows are a part of what was generated)
        "perf/gen_tokens_per_s": float(metrics.get("filter_groups/gen_response_tokens", lens.sum())
                                       / max(metrics["timing_s/gen"], 1e-9)),
        "data/epoch": run.sampler.epoch(k - 1),
        "async/weights_version": version,
        **(roles.rollout.last_metrics if isinstance(roles.rollout, AgentLoopEngine) else {}),
    })
    return Output(table, metrics, [_policy_ref(run, version)])


def _refilled_rollout(run: Run, roles: Roles, k: int) -> tuple[pa.Table, dict]:
    """DAPO dynamic sampling: generate rounds of prompts until data.train_batch_size groups
    survive the filter (algorithm.filter_groups), each round a pure function of (seed, k, round)."""
    from gpu_jobs.reward import score_batch
    from gpu_jobs.rollout.agent_loop import generate_with_rows
    from gpu_jobs.stages.dynamic_sampling import refill_rounds, refill_settings, round_plan

    cfg = run.cfg
    base_seed = sampling_seed(cfg.data.seed, k)

    def generate_round(r: int) -> pa.Table:
        plan = round_plan(run.sampler, k, r, base_seed)
        prompts, ids = run.prompts(run.train, plan.rows, cfg.data.max_prompt_length)
        out = generate_with_rows(roles.rollout, prompts, ids, cfg.rollout.n, cfg.rollout.sampling(plan.seed))
        return sample_table(out, prompts, k, tag=plan.tag)

    def score_round(table: pa.Table):
        scores, extras, _ = score_batch(reward_rows(run.tokenizer, table), cfg.reward)
        return scores, extras

    return refill_rounds(generate_round, score_round, **refill_settings(cfg))


# -------------------------------------------------------------------------------- baseline (ReMax)
@stage("baseline", timer="timing_s/baseline", needed=lambda cfg: cfg.algorithm.needs_reward_baselines)
def baseline(run: Run, roles: Roles, k: int, rollout_uri: str) -> Output:
    """ReMax's baseline: one greedy response per prompt of the batch, scored. Greedy decoding of
    the same weights is deterministic, so a retry is identical."""
    prompts, ids = run.batch_prompts(k)
    table, metrics = greedy_evaluate(roles.rollout, run.tokenizer, prompts, ids, run.cfg.reward,
                                     run.cfg.rollout.max_response_length, iteration=k)
    return Output(table.drop_columns(["response_text"]),
                  {"critic/baseline_score/mean": metrics["val/acc"]}, [rollout_uri])


# -------------------------------------------------------------------------------- gate
@stage("gate", timer="timing_s/gate")
def gate(run: Run, roles: Roles, k: int, rollout_uri: str) -> Output:
    from gpu_jobs.data.gates import validate_rollout

    cfg = run.cfg
    gate_cfg = cfg.gate.model_copy(update={"max_response_length": cfg.rollout.max_response_length})
    table = read(run, rollout_uri)
    where = run.layout.iteration(k)
    result = validate_rollout(table.to_pandas(), gate_cfg, join(where, "gate_report.json"),
                              quarantine_url=join(where, "quarantine", "rollout.parquet"), storage=run.storage)
    if result.n_quarantined:
        keep = set(result.clean["uid"].tolist())
        table = table.filter(pa.array([u in keep for u in table.column("uid").to_pylist()]))
    return Output(table, {"gate/rows": result.n_rows, "gate/quarantined": result.n_quarantined,
                          "gate/checked": float(cfg.gate.enable)}, [rollout_uri])


# -------------------------------------------------------------------------------- reward model
def needs_reward_model(cfg: Any) -> bool:
    return cfg.reward_model.enable


@stage("reward_model", timer="timing_s/reward_model", needed=needs_reward_model)
def reward_model(run: Run, roles: Roles, k: int, batch_uri: str) -> Output:
    """Each response's reward-model score (`rm_score`, a logit). The prompt is decoded with the
    policy's tokenizer and passed with the response as a user turn and an assistant turn, which
    the reward model renders with its own chat template (verl's way when the two differ)."""
    table = read(run, batch_uri, ["uid", "prompt_ids", "response_ids"])
    scorer = roles.load_reward_model(run)  # warm: loaded once per run
    prompts = run.tokenizer.batch_decode(table.column("prompt_ids").to_pylist(), skip_special_tokens=True)
    responses = run.tokenizer.batch_decode(table.column("response_ids").to_pylist(), skip_special_tokens=True)
    scores = np.asarray(scorer.score([[{"role": "user", "content": p}] for p in prompts], responses), np.float64)
    metrics = {"critic/rm_score/mean": float(scores.mean()), "critic/rm_score/max": float(scores.max()),
               "critic/rm_score/min": float(scores.min())} if len(scores) else {}
    return Output(pa.table({"uid": table.column("uid"), "rm_score": pa.array(scores, pa.float32())}), metrics,
                  [batch_uri])


# -------------------------------------------------------------------------------- reward
@stage("reward", timer="timing_s/reward")
def reward(run: Run, roles: Roles, k: int, batch_uri: str, rm_uri: str | None = None) -> Output:
    """The training score of each response: the rule reward, or with a reward model (rm_uri)
    reward_model.combined(rule score, rm score) (coef * rm, or rule + coef * rm), both kept as
    columns `rule_score` and `rm_score`."""
    table = read(run, batch_uri, ["uid", "data_source", "response_ids", "ground_truth", "extra_info"])
    rows = reward_rows(run.tokenizer, table)
    rm_only = bool(rm_uri) and run.cfg.reward_model.combine == "rm_only"
    scores, extras, metrics = rule_scores(rows, run.cfg, rm_only)
    cols = {"uid": table.column("uid")}
    if rm_uri:
        rm_scores = join_by_uid(table.select(["uid"]), read(run, rm_uri)).column("rm_score").to_pylist()
        cols.update(rule_score=pa.array(scores, pa.float32()), rm_score=pa.array(rm_scores, pa.float32()))
        metrics.update(_score_metrics("critic/rule_score", [x for x in scores if not np.isnan(x)]))
        scores = [run.cfg.reward_model.combined(r, m) for r, m in zip(scores, rm_scores)]
        metrics.update(_score_metrics("critic/score", scores))
    out = pa.table({**cols, "score": pa.array(scores, pa.float32()),
                    "reward_extra": pa.array([json.dumps(e, default=str) for e in extras]),
                    "response_text": pa.array([r["solution_str"] for r in rows])})
    return Output(out, metrics, [batch_uri, rm_uri])


def rule_scores(rows: list[dict], cfg: Any, rm_only: bool) -> tuple[list[float], list[dict], dict[str, float]]:
    """score_batch's (scores, extras, metrics) for `rows`. Under reward_model.combine=rm_only the
    rule score is only logged, so rows whose data_source no built-in rule scores (e.g. served
    feedback, rlmill/feedback/<model>, whose ground truth is the answer itself) get NaN instead of
    failing the run; everywhere else such a row is the configuration error score_batch raises."""
    from gpu_jobs.reward import score_batch
    from gpu_jobs.reward.registry import UnknownDataSourceError, get_reward_fn

    if not rm_only or cfg.reward.custom_reward_function.path is not None:
        return score_batch(rows, cfg.reward)

    def scored(ds: str) -> bool:
        try:
            return get_reward_fn(ds) is not None
        except UnknownDataSourceError:
            return False

    known = {ds: scored(ds) for ds in {r["data_source"] for r in rows}}
    keep = [i for i, r in enumerate(rows) if known[r["data_source"]]]
    part, part_extras, metrics = score_batch([rows[i] for i in keep], cfg.reward)
    scores, extras = [math.nan] * len(rows), [{} for _ in rows]
    for i, score, extra in zip(keep, part, part_extras):
        scores[i], extras[i] = score, extra
    return scores, extras, metrics


def _score_metrics(prefix: str, scores: list[float]) -> dict[str, float]:
    return {f"{prefix}/mean": float(np.mean(scores)), f"{prefix}/max": float(np.max(scores)),
            f"{prefix}/min": float(np.min(scores))} if len(scores) else {}


# -------------------------------------------------------------------------------- log-probs, values
def needs_logprobs(cfg: Any) -> bool:
    return cfg.old_logprobs_in_stage or cfg.needs_ref


@stage("logprobs", needed=needs_logprobs, where="trainer")
def logprobs(run: Run, roles: Roles, k: int, batch_uri: str) -> Output:
    """Old-policy (when recomputed and not taken from the update's own forward) and reference
    log-probs."""
    table = read(run, batch_uri, ["uid", "prompt_ids", "response_ids"])
    cols: dict[str, Any] = {"uid": table.column("uid")}
    t0 = time.perf_counter()
    if run.cfg.old_logprobs_in_stage:
        cols["old_logprobs"] = pa.array([x.tolist() for x in roles.trainer.compute_log_probs(table)], FLOAT_LIST)
    t1 = time.perf_counter()
    if run.cfg.needs_ref:
        cols["ref_logprobs"] = pa.array([x.tolist() for x in roles.ref.compute_log_probs(table)], FLOAT_LIST)
    metrics = {"timing_s/old_log_prob": t1 - t0, "timing_s/ref": time.perf_counter() - t1}
    return Output(pa.table(cols), metrics, [batch_uri])


@stage("values", timer="timing_s/values", needed=lambda cfg: cfg.critic is not None)
def values(run: Run, roles: Roles, k: int, batch_uri: str) -> Output:
    table = read(run, batch_uri, ["uid", "prompt_ids", "response_ids"])
    vals = roles.critic.compute_values(table)
    out = pa.table({"uid": table.column("uid"), "values": pa.array([v.tolist() for v in vals], FLOAT_LIST)})
    return Output(out, {}, [batch_uri])


# -------------------------------------------------------------------------------- advantages
def kl_controller_for(run: Run, k: int):
    """The KL-in-reward controller as iteration k starts: the state committed with the
    advantages of k-1 (a fresh one at k = 1). Read from storage, so a retried or resumed stage
    steps the same controller exactly once."""
    ctrl = run.cfg.algorithm.kl_ctrl.build()
    uri = committed(run.layout.stage(k - 1, "advantages"), run.storage) if k > 1 else None
    state = read_manifest(uri, run.storage).metrics.get("kl_ctrl_state") if uri else None
    if state:
        ctrl.load_state_dict(state)
    return ctrl


@stage("advantages", timer="timing_s/adv")
def advantages(run: Run, roles: Roles, k: int, batch_uri: str, reward_uri: str,
               logprobs_uri: str | None = None, values_uri: str | None = None,
               baseline_uri: str | None = None) -> Output:
    from gpu_jobs.stages.advantage_math import batch_advantages

    table = join_by_uid(read(run, batch_uri), read(run, reward_uri).drop_columns(["response_text"]),
                        read(run, logprobs_uri), read(run, values_uri))
    if baseline_uri:
        base = read(run, baseline_uri)
        by_group = dict(zip(base.column("group_id").to_pylist(), base.column("score").to_pylist()))
        table = table.append_column("reward_baseline", pa.array(
            [by_group[g] for g in table.column("group_id").to_pylist()], pa.float32()))
    kl_ctrl = kl_controller_for(run, k)
    table, metrics = batch_advantages(table, run.cfg, kl_ctrl)
    metrics["kl_ctrl_state"] = kl_ctrl.state_dict()
    return Output(table, metrics, [batch_uri, reward_uri, logprobs_uri, values_uri, baseline_uri])


# -------------------------------------------------------------------------------- update
def _agreement(run: Run, roles: Roles, k: int, table: pa.Table) -> dict[str, float]:
    """The trainer's log-probs of (some of) the batch's sampled tokens against the rollout
    engine's, from a forward of its own; raises AgreementError past the configured limit,
    before anything trains."""
    from gpu_jobs.stages.agreement import probe_rows, rows_agreement

    cfg = run.cfg
    if not len(table):
        return {}
    t0 = time.perf_counter()
    if "old_logprobs" in table.column_names and cfg.old_logprobs_in_stage:
        probe = table  # the logprobs stage already re-scored every row with these weights
        trainer_lp = probe.column("old_logprobs").to_pylist()
    else:
        probe = table.take(pa.array(probe_rows(len(table), cfg.agreement.rows), pa.int64()))
        trainer_lp = roles.trainer.compute_log_probs(probe)
    metrics = rows_agreement(probe.column("rollout_logprobs").to_pylist(), trainer_lp, response_masks(probe))
    _check_on_policy(run, k, metrics)
    metrics["timing_s/agreement"] = time.perf_counter() - t0
    return metrics


def _check_on_policy(run: Run, k: int, metrics: dict[str, float]) -> None:
    # A stale batch (async) was sampled with older weights than the trainer's: the gap is then
    # policy drift plus any mismatch, reported but not a fault; the limit applies on-policy.
    from gpu_jobs.stages.agreement import check_agreement

    cfg = run.cfg
    if cfg.async_training.weights_version(k) == k - 1:
        check_agreement(metrics, cfg.agreement.threshold(cfg.rollout, cfg.actor), f"the update of iteration {k}")


def _probed_by_the_update(run: Run, roles: Roles, k: int, table: pa.Table) -> bool:
    """Whether the update's own first mini-batch is the agreement probe (agreement.in_update): the
    trainer can (one process, ZeRO stage 0, no dropout), trains in this update (not a critic
    warm-up) and no logprobs stage already re-scored the batch."""
    cfg = run.cfg
    recomputed = "old_logprobs" in table.column_names and cfg.old_logprobs_in_stage
    warming_critic = roles.critic is not None and k <= cfg.critic.critic_warmup
    return (cfg.agreement.in_update and len(table) > 0 and not recomputed and not warming_critic
            and roles.trainer.probes_in_update)


def _update_probe(run: Run, k: int, found: dict[str, float]):
    """The probe PolicyTrainer.update calls on its first mini-batch, before its optimizer step: the
    agreement metrics go into `found`, and past the limit it raises AgreementError there."""
    from gpu_jobs.stages.agreement import agreement_metrics

    def probe(rollout_logprobs, trainer_logprobs, response_mask) -> None:
        t0 = time.perf_counter()
        found.update(agreement_metrics(rollout_logprobs, trainer_logprobs, response_mask))
        _check_on_policy(run, k, found)
        found["timing_s/agreement"] = time.perf_counter() - t0

    return probe


def _checkpoint_due(run: Run, k: int) -> bool:
    loop = run.cfg.trainer
    return k % loop.checkpoint_every == 0 or k == loop.total_iterations


def save_checkpoint(run: Run, roles: Roles, k: int, metrics: dict) -> None:
    """policy/ (HF), trainer/ (exact-resume state), critic/, metrics.json, then LATEST last."""
    from storage import write_pointer

    roles.trainer.save(run.layout.trainer(k))
    roles.trainer.save_hf(run.layout.policy(k))
    if roles.critic is not None:
        roles.critic.save(join(run.layout.checkpoint(k), "critic"))
    write_pointer(join(run.layout.checkpoint(k), "update_metrics.json"), json.dumps(metrics), run.storage)
    run.layout.set_latest(k)


def _metrics_of_applied_update(run: Run, roles: Roles, k: int) -> dict:
    """The warm roles already hold update k: this is a retry after a failed checkpoint write
    (metrics kept in memory), or the process died after checkpoint k was published but before
    the update's manifest (metrics saved with the checkpoint). Training again would apply the
    update twice."""
    from storage import read_pointer

    metrics = roles.update_metrics.get(k)
    if metrics is None:
        saved = read_pointer(join(run.layout.checkpoint(k), "update_metrics.json"), run.storage)
        if saved is None:
            raise RuntimeError(f"trainer holds update {k} but neither memory nor checkpoint {k} has its metrics")
        metrics = json.loads(saved)
    return metrics


@stage("update", where="trainer")
def update(run: Run, roles: Roles, k: int, adv_uri: str) -> Output:
    recover_lost_trainer(run, roles)  # a rank group that died with updates in it: restore first
    if roles.version >= k:
        metrics = _metrics_of_applied_update(run, roles, k)
    else:
        if roles.version != k - 1:
            raise RuntimeError(f"trainer holds update {roles.version}, cannot apply update {k}: restore first")
        table = read(run, adv_uri)
        if run.cfg.offline:  # nothing was sampled (DPO/KTO, SFT): no rollout/trainer agreement to check
            probe, trained = {}, train_on(run, roles, k, table)
        elif _probed_by_the_update(run, roles, k, table):  # no forward of its own: the update's first mini-batch
            probe: dict[str, float] = {}
            trained = train_on(run, roles, k, table, probe=_update_probe(run, k, probe))
        else:
            probe = _agreement(run, roles, k, table)
            trained = train_on(run, roles, k, table)
        staleness = float(k - 1 - run.cfg.async_training.weights_version(k))
        metrics = {**trained, **probe,
                   "async/staleness_mean": staleness, "async/staleness_max": staleness}
        if roles.trainer.groups_started is not None:  # a warm rank group: started once per process, or a restart
            metrics["perf/rank_group_starts"] = float(roles.trainer.groups_started)
        roles.update_metrics[k] = metrics
    if _checkpoint_due(run, k) and (run.layout.latest_checkpoint() or 0) < k:
        t0 = time.perf_counter()
        save_checkpoint(run, roles, k, metrics)
        metrics = {**metrics, "timing_s/save_checkpoint": time.perf_counter() - t0}
    elif run.cfg.async_training.staleness_threshold > 0:
        # Stale rollouts sample with older weights than the trainer's: publish every version, so
        # a resumed run (or a rollout on another pool) loads exactly the weights the schedule names.
        t0 = time.perf_counter()
        _publish_policy(run, roles, k)
        metrics = {**metrics, "timing_s/publish_weights": time.perf_counter() - t0}
    return Output(pa.table({"iteration": [k]}), metrics, [adv_uri])


def _publish_policy(run: Run, roles: Roles, k: int) -> None:
    from storage import INDEX_NAME

    if not exists(join(run.layout.policy(k), INDEX_NAME), run.storage):  # a retry after publishing
        roles.trainer.save_hf(run.layout.policy(k))


@stage("weight-sync", where="colocated", commits=False)
def weights_to_rollout(run: Run, roles: Roles, k: int) -> float:
    """Hand the trainer's full weights to the rollout engine in memory (nothing to commit: a
    retried or resumed run derives them from storage); returns seconds."""
    t0 = time.perf_counter()
    roles.put_rollout_at(run, roles.version)
    return time.perf_counter() - t0


# -------------------------------------------------------------------------------- commit
@stage("commit")
def commit(run: Run, roles: Roles, k: int, stage_uris: dict[str, str | None], extra_metrics: dict) -> Output:
    """The iteration's own manifest: every stage's metrics merged, inputs = the stage manifests."""
    metrics: dict[str, Any] = {}
    for uri in stage_uris.values():
        if uri:
            metrics.update({m: v for m, v in read_manifest(uri, run.storage).metrics.items()
                            if isinstance(v, (int, float))})
    metrics.update(extra_metrics)
    # Top-level timers only: timing_s/update_actor/forward etc. are parts of timing_s/update_actor.
    metrics["timing_s/step"] = sum(v for m, v in metrics.items()
                                   if m.startswith("timing_s/") and m.count("/") == 1 and m != "timing_s/step")
    return Output(pa.table({"iteration": [k]}), metrics, list(stage_uris.values()))


# -------------------------------------------------------------------------------- validation
@stage("validate", timer="timing_s/validate", where="rollout")
def validate(run: Run, roles: Roles, k: int) -> Output:
    """rollout.val_kwargs.n responses (greedy by default) to each held-out prompt with the weights
    after update k, scored by the rule reward: val/acc = mean score, and verl's val-core/val-aux
    metrics per data source (mean@N, best@N, maj@N with bootstrap std)."""
    cfg = run.cfg
    if cfg.offline:  # no rollout engine: held-out pairs' implicit rewards, or demonstrations' NLL (sft.py)
        from gpu_jobs.stages.preference import held_out_preferences
        from gpu_jobs.stages.sft import held_out_sft

        table, metrics = (held_out_sft if cfg.sft is not None else held_out_preferences)(run, roles, k)
        return Output(table, metrics, [committed(run.layout.stage(k, "update"), run.storage) or run.model_path])
    roles.put_rollout_at(run, roles.version)
    prompts, ids = run.prompts(run.val, list(range(len(run.val))), None)
    # Its own seed stream (not a training rollout's), fixed per k: a retried validation samples the same.
    seed = sampling_seed(cfg.data.seed + 1, k)
    table, metrics = evaluate(roles.rollout, run.tokenizer, prompts, ids, cfg.reward, cfg.rollout.max_response_length,
                              cfg.rollout.val_kwargs, seed=seed, iteration=k, tag="val")
    metrics["val/weights_of_iteration"] = roles.version
    return Output(table, metrics, [committed(run.layout.stage(k, "update"), run.storage) or run.model_path])


__all__ = ["STAGES", "rollout", "baseline", "gate", "reward_model", "reward", "logprobs", "values", "advantages",
           "update", "train_on", "weights_to_rollout", "commit", "validate", "save_checkpoint", "sampling_seed",
           "kl_controller_for", "needs_logprobs", "needs_reward_model"]

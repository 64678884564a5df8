"""The stages of one RL iteration as plain functions: `stage(ctx, k, *input_uris) -> manifest URI`.

Each stage first asks storage whether (run, k, stage) already committed and returns that
manifest if so: this is what makes Prefect retries and crash-resume recompute nothing.
Otherwise it reads only committed inputs, computes, writes new shards and commits a manifest
last. In-memory state (warm engines) is only ever *derived* from committed data.

    rollout -> gate -> {reward, logprobs, values} -> advantages -> update -> (weight sync) -> commit
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import numpy as np
import pyarrow as pa

from gpu_jobs.stages.context import RunContext
from gpu_jobs.stages.samples import FLOAT_LIST, join_by_uid, sample_table
from storage import committed, join, read_manifest, read_table, write_table

STAGES = ("rollout", "baseline", "gate", "reward", "logprobs", "values", "advantages", "update", "commit")


def optional_stages(cfg: Any) -> dict[str, bool]:
    """Whether the run's algorithm needs each optional stage (unneeded ones return None at once,
    so the flow does not even start a task for them)."""
    return {"baseline": cfg.algorithm.needs_reward_baselines,
            "logprobs": cfg.actor.recompute_old_logprobs or cfg.needs_ref,
            "values": cfg.critic is not None}


def _done(ctx: RunContext, k: int, stage: str) -> str | None:
    return committed(ctx.layout.stage(k, stage), ctx.storage)


def _commit(ctx: RunContext, k: int, stage: str, table: pa.Table, inputs: list[str], metrics: dict) -> str:
    return write_table(ctx.layout.stage(k, stage), table, inputs=[u for u in inputs if u],
                       metrics=metrics, storage=ctx.storage)


def sampling_seed(seed: int, k: int) -> int:
    """Per-iteration sampling seed: a retried rollout draws exactly the same responses."""
    return (seed * 1_000_003 + k * 7919) % (2**31 - 1)


def _policy_ref(ctx: RunContext, k: int) -> str:
    """The committed thing the iteration-k policy came from: update k-1, or the start model."""
    return (_done(ctx, k - 1, "update") if k > 1 else None) or ctx.model_path


def _prompts(ctx: RunContext, df: Any, rows: list[int], max_len: int | None) -> tuple[list[dict], list[list[int]]]:
    """Rows of a prompt dataset (verl fields plus `row`, their index) and their token ids."""
    from storage.datasets import render_prompt

    prompts = [dict(df.iloc[i].to_dict(), row=int(i)) for i in rows]
    return prompts, [render_prompt(p[ctx.cfg.data.prompt_key], ctx.tokenizer, max_len) for p in prompts]


def _batch_prompts(ctx: RunContext, k: int) -> tuple[list[dict], list[list[int]]]:
    """Iteration k's training prompts: a pure function of (seed, epoch, k)."""
    rows = ctx.sampler.indices(k - 1)  # iterations are 1-based, the sampler's steps 0-based
    return _prompts(ctx, ctx.train, rows, ctx.cfg.data.max_prompt_length)


# -------------------------------------------------------------------------------- rollout
def rollout(ctx: RunContext, k: int) -> str:
    if uri := _done(ctx, k, "rollout"):
        return uri
    cfg = ctx.cfg
    t0 = time.perf_counter()
    if cfg.algorithm.filter_groups.enable:
        table, metrics = _refilled_rollout(ctx, k)
    else:
        prompts, prompt_ids = _batch_prompts(ctx, k)
        out = ctx.engine.generate(prompt_ids, cfg.rollout.n, cfg.rollout.sampling(sampling_seed(cfg.data.seed, k)))
        table, metrics = sample_table(out, prompts, k), {"timing_s/gen": time.perf_counter() - t0}
    lens = np.asarray(table.column("response_len").to_pylist(), dtype=np.float64)
    metrics.update({
        "response_length/mean": float(lens.mean()), "response_length/max": float(lens.max()),
        "response_length/min": float(lens.min()),
        "response_length/clip_ratio": float(np.mean(np.asarray(table.column("finish_reason").to_pylist()) == "length")),
        "perf/gen_tokens_per_s": float(lens.sum() / max(metrics["timing_s/gen"], 1e-9)),
        "data/epoch": ctx.sampler.epoch(k - 1),
    })
    return _commit(ctx, k, "rollout", table, [_policy_ref(ctx, k)], metrics)


def _refilled_rollout(ctx: RunContext, k: int) -> tuple[pa.Table, dict]:
    """DAPO dynamic sampling: generate rounds of prompts until data.train_batch_size groups
    survive the filter (algorithm.filter_groups), each round a pure function of (seed, k, round)."""
    from gpu_jobs.reward import score_batch
    from gpu_jobs.stages.dynamic_sampling import refill_rounds, refill_settings, round_plan

    cfg = ctx.cfg
    base_seed = sampling_seed(cfg.data.seed, k)

    def generate_round(r: int) -> pa.Table:
        plan = round_plan(ctx.sampler, k, r, base_seed)
        prompts, ids = _prompts(ctx, ctx.train, plan.rows, cfg.data.max_prompt_length)
        out = ctx.engine.generate(ids, cfg.rollout.n, cfg.rollout.sampling(plan.seed))
        return sample_table(out, prompts, k, tag=plan.tag)

    def score_round(table: pa.Table):
        scores, extras, _ = score_batch(_reward_rows(ctx, table), cfg.reward)
        return scores, extras

    return refill_rounds(generate_round, score_round, **refill_settings(cfg))


# -------------------------------------------------------------------------------- baseline (ReMax)
def baseline(ctx: RunContext, k: int, rollout_uri: str) -> str | None:
    """ReMax's baseline: one greedy response per prompt of the batch, scored; None for other
    estimators. Greedy decoding of the same weights is deterministic, so a retry is identical."""
    if not ctx.cfg.algorithm.needs_reward_baselines:
        return None
    if uri := _done(ctx, k, "baseline"):
        return uri
    from gpu_jobs.reward import score_batch

    cfg = ctx.cfg
    prompts, ids = _batch_prompts(ctx, k)
    t0 = time.perf_counter()
    table = sample_table(ctx.engine.generate(ids, 1, cfg.rollout.greedy()), prompts, k)
    scores, _, _ = score_batch(_reward_rows(ctx, table), cfg.reward)
    table = table.append_column("score", pa.array(scores, pa.float32()))
    metrics = {"timing_s/baseline": time.perf_counter() - t0, "critic/baseline_score/mean": float(np.mean(scores))}
    return _commit(ctx, k, "baseline", table, [rollout_uri], metrics)


def _reward_rows(ctx: RunContext, table: pa.Table) -> list[dict]:
    texts = ctx.tokenizer.batch_decode(table.column("response_ids").to_pylist(), skip_special_tokens=True)
    return [{"data_source": d, "solution_str": s, "ground_truth": g, "extra_info": e}
            for d, s, g, e in zip(table.column("data_source").to_pylist(), texts,
                                  table.column("ground_truth").to_pylist(), table.column("extra_info").to_pylist())]


# -------------------------------------------------------------------------------- gate
def gate(ctx: RunContext, k: int, rollout_uri: str) -> str:
    if uri := _done(ctx, k, "gate"):
        return uri
    from storage.quality import validate_rollout

    cfg = ctx.cfg
    gate_cfg = cfg.gate.model_copy(update={"max_response_length": cfg.rollout.max_response_length})
    table = read_table(rollout_uri, storage=ctx.storage)
    t0 = time.perf_counter()
    where = ctx.layout.iteration(k)
    result = validate_rollout(table.to_pandas(), gate_cfg, join(where, "gate_report.json"),
                              quarantine_url=join(where, "quarantine", "rollout.parquet"), storage=ctx.storage)
    if result.n_quarantined:
        keep = set(result.clean["uid"].tolist())
        table = table.filter(pa.array([u in keep for u in table.column("uid").to_pylist()]))
    metrics = {"gate/rows": result.n_rows, "gate/quarantined": result.n_quarantined,
               "timing_s/gate": time.perf_counter() - t0}
    return _commit(ctx, k, "gate", table, [rollout_uri], metrics)


# -------------------------------------------------------------------------------- reward
def reward(ctx: RunContext, k: int, batch_uri: str) -> str:
    if uri := _done(ctx, k, "reward"):
        return uri
    from gpu_jobs.reward import score_batch

    table = read_table(batch_uri, columns=["uid", "data_source", "response_ids", "ground_truth", "extra_info"],
                       storage=ctx.storage)
    t0 = time.perf_counter()
    rows = _reward_rows(ctx, table)
    scores, extras, metrics = score_batch(rows, ctx.cfg.reward)
    out = pa.table({"uid": table.column("uid"), "score": pa.array(scores, pa.float32()),
                    "reward_extra": pa.array([json.dumps(e, default=str) for e in extras]),
                    "response_text": pa.array([r["solution_str"] for r in rows])})
    metrics = {**metrics, "timing_s/reward": time.perf_counter() - t0}
    return _commit(ctx, k, "reward", out, [batch_uri], metrics)


# -------------------------------------------------------------------------------- log-probs, values
def logprobs(ctx: RunContext, k: int, batch_uri: str) -> str | None:
    """Old-policy (when recomputed) and reference log-probs; None when the algorithm needs neither."""
    need_old, need_ref = ctx.cfg.actor.recompute_old_logprobs, ctx.cfg.needs_ref
    if not (need_old or need_ref):
        return None
    if uri := _done(ctx, k, "logprobs"):
        return uri
    table = read_table(batch_uri, columns=["uid", "prompt_ids", "response_ids"], storage=ctx.storage)
    cols: dict[str, Any] = {"uid": table.column("uid")}
    t0 = time.perf_counter()
    if need_old:
        cols["old_logprobs"] = pa.array([x.tolist() for x in ctx.trainer.compute_log_probs(table)], FLOAT_LIST)
    t1 = time.perf_counter()
    if need_ref:
        cols["ref_logprobs"] = pa.array([x.tolist() for x in ctx.ref.compute_log_probs(table)], FLOAT_LIST)
    metrics = {"timing_s/old_log_prob": t1 - t0, "timing_s/ref": time.perf_counter() - t1}
    return _commit(ctx, k, "logprobs", pa.table(cols), [batch_uri], metrics)


def values(ctx: RunContext, k: int, batch_uri: str) -> str | None:
    if ctx.critic is None:
        return None
    if uri := _done(ctx, k, "values"):
        return uri
    table = read_table(batch_uri, columns=["uid", "prompt_ids", "response_ids"], storage=ctx.storage)
    t0 = time.perf_counter()
    vals = ctx.critic.compute_values(table)
    out = pa.table({"uid": table.column("uid"), "values": pa.array([v.tolist() for v in vals], FLOAT_LIST)})
    return _commit(ctx, k, "values", out, [batch_uri], {"timing_s/values": time.perf_counter() - t0})


# -------------------------------------------------------------------------------- advantages
def advantages(ctx: RunContext, k: int, batch_uri: str, reward_uri: str,
               logprobs_uri: str | None = None, values_uri: str | None = None,
               baseline_uri: str | None = None) -> str:
    if uri := _done(ctx, k, "advantages"):
        _adopt_kl_ctrl(ctx, uri)
        return uri
    from gpu_jobs.stages.advantage_math import batch_advantages

    read = lambda u: read_table(u, storage=ctx.storage) if u else None  # noqa: E731
    table = join_by_uid(read(batch_uri), read(reward_uri).drop_columns(["response_text"]),
                        read(logprobs_uri), read(values_uri))
    if baseline_uri:
        base = read(baseline_uri)
        by_group = dict(zip(base.column("group_id").to_pylist(), base.column("score").to_pylist()))
        table = table.append_column("reward_baseline", pa.array(
            [by_group[g] for g in table.column("group_id").to_pylist()], pa.float32()))
    t0 = time.perf_counter()
    # The controller steps on a copy: the live one changes only after the commit, to the state
    # the commit recorded, so a retry after a failed commit cannot step it twice.
    kl_ctrl = copy.deepcopy(ctx.kl_ctrl)
    table, metrics = batch_advantages(table, ctx.cfg, kl_ctrl)
    metrics["timing_s/adv"] = time.perf_counter() - t0
    metrics["kl_ctrl_state"] = kl_ctrl.state_dict()
    uri = _commit(ctx, k, "advantages", table, [batch_uri, reward_uri, logprobs_uri, values_uri, baseline_uri],
                  metrics)
    _adopt_kl_ctrl(ctx, uri)
    return uri


def _adopt_kl_ctrl(ctx: RunContext, adv_uri: str) -> None:
    """Set the live KL controller to the state committed with `adv_uri` (idempotent)."""
    state = read_manifest(adv_uri, ctx.storage).metrics.get("kl_ctrl_state")
    if state:
        ctx.kl_ctrl.load_state_dict(state)


# -------------------------------------------------------------------------------- update
def _train_on(ctx: RunContext, k: int, table: pa.Table) -> dict[str, float]:
    """Apply update k to the trainer (and critic). Also used to replay committed updates on
    resume, so everything here must depend only on (k, table, trainer state)."""
    t0 = time.perf_counter()
    metrics: dict[str, float] = {}
    warming_critic = ctx.critic is not None and k <= ctx.cfg.critic.critic_warmup
    if len(table) and not warming_critic:
        metrics.update(ctx.trainer.update(table))
    t1 = time.perf_counter()
    if ctx.critic is not None and len(table):
        metrics.update(ctx.critic.update(table))
        metrics["critic/warmup"] = float(warming_critic)
    metrics["timing_s/update_actor"] = t1 - t0
    metrics["timing_s/update_critic"] = time.perf_counter() - t1
    ctx.trainer_k = k
    return metrics


def _agreement(ctx: RunContext, k: int, table: pa.Table) -> dict[str, float]:
    """The trainer's log-probs of (some of) the batch's sampled tokens against the rollout
    engine's; raises AgreementError past the configured limit, before anything trains."""
    from gpu_jobs.stages.agreement import check_agreement, probe_rows, rows_agreement

    cfg = ctx.cfg
    if not len(table):
        return {}
    t0 = time.perf_counter()
    if "old_logprobs" in table.column_names and cfg.actor.recompute_old_logprobs:
        probe = table  # the logprobs stage already re-scored every row with these weights
        trainer_lp = probe.column("old_logprobs").to_pylist()
    else:
        probe = table.take(pa.array(probe_rows(len(table), cfg.agreement.rows), pa.int64()))
        trainer_lp = ctx.trainer.compute_log_probs(probe)
    metrics = rows_agreement(probe.column("rollout_logprobs").to_pylist(), trainer_lp)
    check_agreement(metrics, cfg.agreement.threshold(cfg.rollout, cfg.actor), f"the update of iteration {k}")
    metrics["timing_s/agreement"] = time.perf_counter() - t0
    return metrics


def _checkpoint_due(ctx: RunContext, k: int) -> bool:
    loop = ctx.cfg.trainer
    return k % loop.checkpoint_every == 0 or k == loop.total_iterations


def save_checkpoint(ctx: RunContext, k: int, metrics: dict) -> None:
    """policy/ (HF), trainer/ (exact-resume state), critic/, metrics.json, then LATEST last."""
    from storage import write_pointer

    ctx.trainer.save(ctx.layout.trainer(k))
    ctx.trainer.save_hf(ctx.layout.policy(k))
    if ctx.critic is not None:
        ctx.critic.save(join(ctx.layout.checkpoint(k), "critic"))
    write_pointer(join(ctx.layout.checkpoint(k), "update_metrics.json"), json.dumps(metrics), ctx.storage)
    ctx.layout.set_latest(k)


def update(ctx: RunContext, k: int, adv_uri: str) -> str:
    if uri := _done(ctx, k, "update"):
        return uri
    from storage import read_pointer

    if ctx.trainer_k >= k:
        # The trainer already holds update k: either this is a retry after a failed checkpoint
        # write (metrics kept in memory), or the process died after checkpoint k was published
        # but before this manifest (metrics saved with the checkpoint). Training again would
        # apply the update twice.
        metrics = ctx.extra.get(("update_metrics", k))
        if metrics is None:
            saved = read_pointer(join(ctx.layout.checkpoint(k), "update_metrics.json"), ctx.storage)
            if saved is None:
                raise RuntimeError(f"trainer holds update {k} but neither memory nor checkpoint {k} has its metrics")
            metrics = json.loads(saved)
    else:
        if ctx.trainer_k != k - 1:
            raise RuntimeError(f"trainer holds update {ctx.trainer_k}, cannot apply update {k}: restore first")
        table = read_table(adv_uri, storage=ctx.storage)
        probe = _agreement(ctx, k, table)
        metrics = {**_train_on(ctx, k, table), **probe}
        ctx.extra[("update_metrics", k)] = metrics
    if _checkpoint_due(ctx, k) and (ctx.layout.latest_checkpoint() or 0) < k:
        t0 = time.perf_counter()
        save_checkpoint(ctx, k, metrics)
        metrics = {**metrics, "timing_s/save_checkpoint": time.perf_counter() - t0}
    return _commit(ctx, k, "update", pa.table({"iteration": [k]}), [adv_uri], metrics)


def replay_update(ctx: RunContext, k: int) -> None:
    """Re-apply committed update k to a restored trainer (crash-resume between checkpoints)."""
    adv_uri = _done(ctx, k, "advantages")
    if adv_uri is None:
        raise RuntimeError(f"update {k} committed but its advantages are missing: the run's storage is damaged")
    _train_on(ctx, k, read_table(adv_uri, storage=ctx.storage))


def probe_agreement(ctx: RunContext, where: str, n_prompts: int = 8) -> dict[str, float]:
    """Sample responses to a few held-out prompts with the rollout engine and re-score them with
    the trainer: run at start and after a resume, when the engine's weights were just loaded
    from storage or synced from a restored trainer. Raises AgreementError past the limit."""
    from gpu_jobs.stages.agreement import check_agreement, rows_agreement

    cfg = ctx.cfg
    _, ids = _prompts(ctx, ctx.val, list(range(min(n_prompts, len(ctx.val)))), None)
    rows = ctx.engine.generate(ids, 2, cfg.rollout.sampling(sampling_seed(cfg.data.seed, 0)))
    table = pa.table({"prompt_ids": pa.array([r["prompt_ids"] for r in rows], pa.list_(pa.int32())),
                      "response_ids": pa.array([r["response_ids"] for r in rows], pa.list_(pa.int32()))})
    metrics = rows_agreement([r["rollout_logprobs"] for r in rows], ctx.trainer.compute_log_probs(table))
    check_agreement(metrics, cfg.agreement.threshold(cfg.rollout, cfg.actor), where)
    return metrics


def sync_weights(ctx: RunContext) -> float:
    """Hand the trainer's full weights to the rollout engine in memory; returns seconds."""
    t0 = time.perf_counter()
    ctx.engine.update_weights(ctx.trainer.gathered_state_dict())
    return time.perf_counter() - t0


# -------------------------------------------------------------------------------- commit
def commit(ctx: RunContext, k: int, stage_uris: dict[str, str | None], extra_metrics: dict) -> str:
    """The iteration's own manifest: every stage's metrics merged, inputs = the stage manifests."""
    if uri := _done(ctx, k, "commit"):
        return uri
    metrics: dict[str, Any] = {}
    for name, uri in stage_uris.items():
        if uri:
            metrics.update({m: v for m, v in read_manifest(uri, ctx.storage).metrics.items()
                            if isinstance(v, (int, float))})
    metrics.update(extra_metrics)
    # Top-level timers only: timing_s/update_actor/forward etc. are parts of timing_s/update_actor.
    metrics["timing_s/step"] = sum(v for m, v in metrics.items()
                                   if m.startswith("timing_s/") and m.count("/") == 1 and m != "timing_s/step")
    return _commit(ctx, k, "commit", pa.table({"iteration": [k]}), list(stage_uris.values()), metrics)


# -------------------------------------------------------------------------------- validation
def validate(ctx: RunContext, k: int) -> str:
    """Greedy decoding on the held-out set with the current weights; metric val/acc (mean score)."""
    if uri := _done(ctx, k, "validate"):
        return uri
    from gpu_jobs.reward import score_batch

    cfg = ctx.cfg
    prompts, ids = _prompts(ctx, ctx.val, list(range(len(ctx.val))), None)
    t0 = time.perf_counter()
    out = ctx.engine.generate(ids, 1, cfg.rollout.greedy())
    table = sample_table(out, prompts, k, tag="val")
    rows = _reward_rows(ctx, table)
    scores, _, _ = score_batch(rows, cfg.reward)
    table = table.append_column("score", pa.array(scores, pa.float32())).append_column(
        "response_text", pa.array([r["solution_str"] for r in rows]))
    metrics = {"val/acc": float(np.mean(scores)) if scores else 0.0, "val/n": len(scores),
               "timing_s/validate": time.perf_counter() - t0, "val/weights_of_iteration": ctx.trainer_k}
    return _commit(ctx, k, "validate", table, [_done(ctx, k, "update") or ctx.model_path], metrics)


def stage_metrics(ctx: RunContext, uri: str) -> dict:
    return read_manifest(uri, ctx.storage).metrics


__all__ = ["STAGES", "rollout", "baseline", "gate", "reward", "logprobs", "values", "advantages", "update",
           "replay_update", "probe_agreement", "sync_weights", "commit", "validate", "save_checkpoint", "sampling_seed"]

"""From a joined batch (samples + scores [+ log-probs, values]) to advantages and returns.

Outcome rewards sit on each response's last model token, as in verl; optional shaping (DAPO
overlong penalty, KL in the reward) is applied to those token-level scores before the estimator
runs. With an environment (multi-turn), its reward for each stepped turn but the last (the last
is the score) is added at that turn's last token (`turn_rewards`): estimators that read rewards
per token (GAE, REINFORCE++, ReMax's returns) see them where they were earned; outcome estimators
(GRPO, RLOO, OPO, GPG, REINFORCE++-baseline, pass@k) sum the tokens, so they see score + turn rewards.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from gpu_jobs.stages.samples import FLOAT_LIST, padded, response_masks, unpadded


def token_level_scores(scores: np.ndarray, lengths: np.ndarray, width: int) -> torch.Tensor:
    """(bs,) sequence scores -> (bs, width) with each score on its row's last response token.

    A zero-length response has no token to carry its score; its row is all zeros (and masked).
    """
    out = torch.zeros(len(scores), width, dtype=torch.float32)
    rows = np.nonzero(lengths > 0)[0]
    out[rows, lengths[rows] - 1] = torch.as_tensor(scores[rows], dtype=torch.float32)
    return out


def last_model_token_ends(table: pa.Table) -> np.ndarray:
    """(bs,) one past the index of each response's last model token (response_mask 1): where its
    score goes. Single-turn rows: the response length; a multi-turn response that ends inside a
    tool turn (cut by the length budget) scores on the model's last token, not a masked one."""
    ends = [max((i + 1 for i, m in enumerate(mask) if m), default=0) for mask in response_masks(table)]
    return np.asarray(ends, dtype=np.int64)


def turn_rewards(table: pa.Table, width: int) -> torch.Tensor | None:
    """(bs, width) an environment's non-final turn rewards (`turn_scores[:-1]`) at their turns'
    last tokens (`turn_ends`); None without an environment. The final one is the score's.

    >>> t = pa.table({"turn_scores": [[0.5, 1.0]], "turn_ends": [[1, 3]]})
    >>> turn_rewards(t, 4).tolist()
    [[0.0, 0.5, 0.0, 0.0]]
    """
    if "turn_scores" not in table.column_names:
        return None
    out = torch.zeros(len(table), width, dtype=torch.float32)
    for i, (scores, ends) in enumerate(zip(table.column("turn_scores").to_pylist(),
                                           table.column("turn_ends").to_pylist())):
        for score, end in zip(scores[:-1], ends[:-1]):
            if 0 <= end < width:
                out[i, end] += score
    return out


def _token_rewards(table: pa.Table, scores: np.ndarray, width: int) -> torch.Tensor:
    """(bs, width): each score on its response's last model token, plus an environment's turn rewards."""
    rewards = token_level_scores(scores, last_model_token_ends(table), width)
    per_turn = turn_rewards(table, width)
    return rewards if per_turn is None else rewards + per_turn


def _metric_stats(prefix: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    vals = x[mask.bool()] if mask is not None else x
    if vals.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(vals.mean()), f"{prefix}/max": float(vals.max()), f"{prefix}/min": float(vals.min())}


def reward_extras(table: pa.Table) -> list[dict]:
    """The reward stage's `reward_extra` JSON column as one dict per row ({} when the column is
    absent: a table scored without extras)."""
    if "reward_extra" not in table.column_names:
        return [{} for _ in range(len(table))]
    return [json.loads(e) if e else {} for e in table.column("reward_extra").to_pylist()]


def _log_overlong(table: pa.Table, pen: torch.Tensor) -> tuple[pa.Table, dict[str, float]]:
    """overlong_buffer.log: verl's per-sample `overlong_reward` / `overlong` pair as columns, and
    the share of responses that were penalised."""
    overlong = (pen < 0).numpy()
    table = table.append_column("overlong_reward", pa.array(pen.numpy().astype(np.float32), pa.float32()))
    table = table.append_column("overlong", pa.array(overlong, pa.bool_()))
    return table, {"reward/overlong_frac": float(overlong.mean()) if len(overlong) else 0.0}


def _rollout_correction(table: pa.Table, rc: Any, adv: torch.Tensor, mask: torch.Tensor,
                        width: int) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """Scale the advantages by the truncated IS weights and zero them where rejection sampling
    rejects: for every policy loss here the pg loss is linear in a non-negative per-token factor
    on A (PPO clip: max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r))), so this equals verl's
    `pg_losses * rollout_is_weights` (rejected tokens still count in token-mean's denominator).
    Returns (advantages, metrics, the per-token factor applied)."""
    from gpu_jobs.algos import rollout_correction_metrics, rollout_is_weights, rollout_rs_mask

    old = torch.as_tensor(padded(table.column("old_logprobs").to_pylist(), width)[0])
    rollout = torch.as_tensor(padded(table.column("rollout_logprobs").to_pylist(), width)[0])
    weights = keep = None
    factor = mask.clone()
    if rc.rollout_is is not None:
        weights = rollout_is_weights(old, rollout, mask, rc.rollout_is, rc.rollout_is_threshold)
        factor = factor * weights
    if rc.rollout_rs is not None:
        keep = rollout_rs_mask(old, rollout, mask, rc.rollout_rs, rc.rs_lower, rc.rollout_rs_threshold)
        factor = factor * keep
    metrics = rollout_correction_metrics(old, rollout, mask, weights, keep,
                                         rc.rollout_is_threshold if rc.rollout_is else None)
    return adv * factor, {m: float(v) for m, v in metrics.items()}, factor


def _kept_groups(table: pa.Table, metric: str, raw_scores: np.ndarray, penalty: torch.Tensor | None,
                 index: list, metrics: dict[str, Any]) -> np.ndarray:
    """DAPO's group filter: which rows [B] (bool) belong to a group whose `metric` varies; adds
    the filter_groups/* metrics."""
    from gpu_jobs.algos import filter_groups, filter_metric

    keep, fmetrics = filter_groups(index, filter_metric(metric, raw_scores, reward_extras(table), penalty))
    metrics.update({m: float(v) for m, v in fmetrics.items()})
    return keep.numpy()


def _kl_in_reward(table: pa.Table, rewards: torch.Tensor, mask: torch.Tensor, width: int, algo: Any, kl_ctrl: Any,
                  metrics: dict[str, Any]) -> torch.Tensor:
    """verl's KL in reward: each token's reward minus kl_coef * KL(old policy || reference)
    (`algorithm.kl_penalty`); steps the KL controller once and adds its metrics. [B, T] -> [B, T]."""
    from gpu_jobs.algos import apply_kl_penalty

    old, _ = padded(table.column("old_logprobs" if "old_logprobs" in table.column_names
                                 else "rollout_logprobs").to_pylist(), width)
    ref, _ = padded(table.column("ref_logprobs").to_pylist(), width)
    rewards, kl_metrics = apply_kl_penalty(rewards, torch.as_tensor(old), torch.as_tensor(ref), mask,
                                           kl_coef=kl_ctrl.value, kl_penalty=algo.kl_penalty)
    metrics.update({m: float(v) for m, v in kl_metrics.items()})
    kl_ctrl.update(float(kl_metrics["actor/reward_kl_penalty"]), len(table))
    return rewards


def _value_baselines(table: pa.Table, width: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The critic's values [B, T] (GAE) and ReMax's reward baselines [B] (the greedy response's
    score per prompt), each None when the batch has no such column."""
    vals = baselines = None
    if "values" in table.column_names:
        vals = torch.as_tensor(padded(table.column("values").to_pylist(), width)[0])
    if "reward_baseline" in table.column_names:
        baselines = torch.as_tensor(np.asarray(table.column("reward_baseline").to_pylist(), dtype=np.float32))
    return vals, baselines


def batch_advantages(table: pa.Table, cfg: Any, kl_ctrl: Any) -> tuple[pa.Table, dict[str, Any]]:
    """Returns the table with `advantages`, `returns` (list<float32> per response token) and the
    metrics (critic/score/*, critic/rewards/*, critic/advantages/*, filter_groups/*, ...).

    With overlong_buffer.log the table also gets `overlong_reward` (float32) and `overlong` (bool).
    Filtering tests `filter_groups.metric` (`gpu_jobs.algos.filter_metric`: the reward function's
    score, the score plus the overlong penalty, or a `reward_extra` key); when the rollout stage
    already refilled the batch (`gpu_jobs.stages.dynamic_sampling`) on the same metric, this drops
    only groups that the gate changed.
    """
    from gpu_jobs.algos import compute_advantage, overlong_penalty

    algo = cfg.algorithm
    metrics: dict[str, Any] = {}
    lengths = np.asarray(table.column("response_len").to_pylist(), dtype=np.int64)
    scores = np.asarray(table.column("score").to_pylist(), dtype=np.float32)
    index = table.column("group_id").to_pylist()
    width = int(lengths.max()) if len(lengths) else 0
    _, mask_np = padded(table.column("response_ids").to_pylist(), width)
    # Multi-turn rows: tool tokens are in the sequence but not the policy's, so advantages,
    # returns, KL and their statistics leave them out (response_mask 0), as the loss does.
    mask = torch.as_tensor(mask_np * padded(response_masks(table), width)[0])
    metrics.update(_metric_stats("critic/score", torch.as_tensor(scores)))

    raw_scores, pen = scores, None
    if cfg.overlong_buffer.enable:
        pen = overlong_penalty(torch.as_tensor(lengths), cfg.rollout.max_response_length,
                               cfg.overlong_buffer.len, cfg.overlong_buffer.penalty_factor)
        scores = scores + pen.numpy().astype(np.float32)
        metrics["reward/overlong_penalty_mean"] = float(pen.mean())
        if cfg.overlong_buffer.log:
            # Appended before filtering so that the columns are filtered with their rows.
            table, overlong_metrics = _log_overlong(table, pen)
            metrics.update(overlong_metrics)

    if algo.filter_groups.enable:
        keep_np = _kept_groups(table, algo.filter_groups.metric, raw_scores, pen, index, metrics)
        if not keep_np.all():
            table = table.filter(pa.array(keep_np))
            lengths, scores, mask = lengths[keep_np], scores[keep_np], mask[torch.as_tensor(keep_np)]
            index = [g for g, kp in zip(index, keep_np) if kp]

    rewards = _token_rewards(table, scores, width)
    if algo.use_kl_in_reward:
        rewards = _kl_in_reward(table, rewards, mask, width, algo, kl_ctrl, metrics)
    vals, baselines = _value_baselines(table, width)
    adv, ret = compute_advantage(algo.adv_estimator, token_level_rewards=rewards, response_mask=mask,
                                 index=index, values=vals, reward_baselines=baselines, **algo.advantage_kwargs())
    metrics.update(_metric_stats("critic/rewards", rewards.sum(-1)))
    metrics.update(_metric_stats("critic/advantages", adv, mask))
    metrics.update(_metric_stats("critic/returns", ret, mask))
    if algo.rollout_correction.enabled:
        adv, rc_metrics, weights = _rollout_correction(table, algo.rollout_correction, adv, mask, width)
        metrics.update(rc_metrics)
        table = table.append_column("rollout_is_weights", pa.array(unpadded(weights.numpy(), lengths), FLOAT_LIST))
    table = table.append_column("advantages", pa.array(unpadded(adv.numpy(), lengths), FLOAT_LIST))
    table = table.append_column("returns", pa.array(unpadded(ret.numpy(), lengths), FLOAT_LIST))
    return table, metrics

"""DAPO (Yu et al., arXiv:2503.14476): dynamic sampling (filter groups) and the overlong penalty."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from .advantages import group_ids

__all__ = ["SEQUENCE_FILTER_METRICS", "filter_groups", "filter_metric", "overlong_penalty"]

# The filter metrics that are not keys of the reward function's extra dict (verl's names).
# 'score' is the reward function's score; 'seq_reward' and 'seq_final_reward' are the sequence
# reward after DAPO's overlong shaping (verl's DAPO reward manager adds the penalty into
# token_level_scores, so its seq_reward already includes it; seq_final_reward would add KL-in-reward,
# which rlmill refuses to combine with filtering: see AlgorithmConfig).
SEQUENCE_FILTER_METRICS = ("score", "seq_reward", "seq_final_reward")


def filter_metric(
    metric: str,
    scores: torch.Tensor | Sequence[float],
    reward_extra: Sequence[Mapping[str, Any]],
    overlong_penalties: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-response value whose within-group variance dynamic sampling tests.

    ``scores``: ``(bs,)`` the reward function's scores; ``reward_extra``: ``bs`` dicts, the
    reward function's extra info per response; ``overlong_penalties``: ``(bs,)`` (<= 0) or None
    when overlong shaping is off. Returns ``(bs,)`` float64:

    - ``'score'``: ``scores``;
    - ``'seq_reward'`` / ``'seq_final_reward'``: ``scores + overlong_penalties``;
    - any other name: ``reward_extra[i][metric]`` (bools count as 0/1). ``'acc'`` missing from a
      row falls back to that row's score, as verl's DAPO reward manager records ``acc = score``
      for a reward function that returns a plain float.

    A row whose reward call failed (its extra has ``error_kind``) has no extra keys: it gets NaN,
    which ``filter_groups`` reads as "variance unknown" and keeps the group. Any other row without
    the key raises ValueError naming the metrics that are available.
    """
    scores = torch.as_tensor(scores, dtype=torch.float64)
    if len(reward_extra) != scores.shape[0]:
        raise ValueError(f"{scores.shape[0]} scores but {len(reward_extra)} reward_extra dicts")
    if metric == "score":
        return scores
    if metric in ("seq_reward", "seq_final_reward"):
        if overlong_penalties is None:
            return scores
        return scores + torch.as_tensor(overlong_penalties, dtype=torch.float64)
    out = []
    for i, extra in enumerate(reward_extra):
        if "error_kind" in extra and metric not in extra:
            out.append(math.nan)
        elif metric in extra:
            value = extra[metric]
            if not isinstance(value, (bool, int, float)):
                raise ValueError(f"filter_groups.metric={metric!r} must be a number, but row {i}'s reward extra "
                                 f"holds {type(value).__name__} {value!r}")
            out.append(float(value))
        elif metric == "acc":
            out.append(float(scores[i]))
        else:
            ok = [set(e) for e in reward_extra if "error_kind" not in e]
            common = sorted(set.intersection(*ok)) if ok else []
            raise ValueError(
                f"filter_groups.metric={metric!r} is not in the reward function's extra info of row {i} "
                f"(its keys: {sorted(extra)}); use one of {list(SEQUENCE_FILTER_METRICS)} or a key that every "
                f"row's reward extra has: {common}"
            )
    return torch.tensor(out, dtype=torch.float64)


def filter_groups(index: Any, scores: torch.Tensor | Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dynamic sampling: drop every group whose responses all scored the same.

    ``index``: ``(bs,)`` group ids; ``scores``: ``(bs,)`` one metric per response (e.g. the
    sequence score or accuracy, see ``filter_metric``). Such a group has zero advantage under any
    group baseline, so it only dilutes the batch. A group of one is kept (verl: its std is
    undefined, not zero), and so is a group with a NaN (a failed reward call: flatness unknown).
    Returns ``(keep, metrics)``: ``keep`` ``(bs,)`` bool, and ``filter_groups/num_groups``,
    ``filter_groups/dropped_groups``, ``filter_groups/dropped_frac`` (share of groups).
    """
    scores = torch.as_tensor(scores, dtype=torch.float64)
    ids, n_groups = group_ids(index, scores.device)
    lo = torch.full((n_groups,), float("inf"), dtype=scores.dtype).scatter_reduce(0, ids, scores, "amin")
    hi = torch.full((n_groups,), float("-inf"), dtype=scores.dtype).scatter_reduce(0, ids, scores, "amax")
    size = torch.zeros(n_groups, dtype=torch.long).index_add(0, ids, torch.ones_like(ids))
    # amin/amax propagate NaN, so such a group would read as flat (hi > lo is False): count them.
    has_nan = torch.zeros(n_groups, dtype=torch.long).index_add(0, ids, scores.isnan().long()) > 0
    keep_group = (hi > lo) | (size == 1) | has_nan
    dropped = (~keep_group).sum()
    metrics = {
        "filter_groups/num_groups": torch.tensor(n_groups),
        "filter_groups/dropped_groups": dropped,
        "filter_groups/dropped_frac": dropped.double() / max(n_groups, 1),
    }
    return keep_group[ids], metrics


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float,
) -> torch.Tensor:
    """Soft overlong punishment: ``(bs,)`` lengths -> ``(bs,)`` penalties (<= 0) to add to scores.

    With ``L = max_response_length`` and ``B = overlong_buffer_len``, a response longer than
    ``L - B`` gets ``-penalty_factor * (len - (L - B)) / B``, reaching ``-penalty_factor`` at ``L``;
    shorter responses get 0.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len must be in (0, max_response_length={max_response_length}], "
            f"got {overlong_buffer_len}"
        )
    lengths = torch.as_tensor(response_lengths).to(torch.float32)
    exceed = lengths - (max_response_length - overlong_buffer_len)
    return torch.clamp(-exceed / overlong_buffer_len * penalty_factor, max=0.0)

"""DAPO (Yu et al., arXiv:2503.14476): dynamic sampling (filter groups) and the overlong penalty."""

from __future__ import annotations

from typing import Any

import torch

from .advantages import group_ids

__all__ = ["filter_groups", "overlong_penalty"]


def filter_groups(index: Any, scores: torch.Tensor | Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dynamic sampling: drop every group whose responses all scored the same.

    ``index``: ``(bs,)`` group ids; ``scores``: ``(bs,)`` one metric per response (e.g. the
    sequence score or accuracy). Such a group has zero advantage under any group baseline, so
    it only dilutes the batch. A group of one is kept (verl: its std is undefined, not zero).
    Returns ``(keep, metrics)``: ``keep`` ``(bs,)`` bool, and ``filter_groups/num_groups``,
    ``filter_groups/dropped_groups``, ``filter_groups/dropped_frac`` (share of groups).
    """
    scores = torch.as_tensor(scores, dtype=torch.float64)
    ids, n_groups = group_ids(index, scores.device)
    lo = torch.full((n_groups,), float("inf"), dtype=scores.dtype).scatter_reduce(0, ids, scores, "amin")
    hi = torch.full((n_groups,), float("-inf"), dtype=scores.dtype).scatter_reduce(0, ids, scores, "amax")
    size = torch.zeros(n_groups, dtype=torch.long).index_add(0, ids, torch.ones_like(ids))
    keep_group = (hi > lo) | (size == 1)
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

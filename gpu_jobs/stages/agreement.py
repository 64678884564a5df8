"""Trainer/rollout agreement: do the two engines give the same tokens the same log-probs?

The rollout engine (vLLM or transformers `generate`) samples each response and records the
log-prob of every sampled token; the trainer recomputes them by teacher forcing. With the same
weights, temperature and dtype the two agree to float noise (fp32 on CPU: ~1e-5 nats). A weight
missing from a sync (vLLM's tied output head), a temperature mismatch or a dtype change shows
up here first, and would otherwise train silently on a policy that is not the one sampled.

    metrics = agreement_metrics(rollout_logprobs, trainer_logprobs, response_mask)
    check_agreement(metrics, threshold=1e-3, where="update of iteration 3")   # raises

Metric names follow verl (`training/rollout_probs_diff_*`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["AgreementError", "agreement_metrics", "check_agreement", "probe_rows", "padded_pair", "rows_agreement"]


class AgreementError(RuntimeError):
    """The trainer and the rollout engine disagree on the log-probs of the same tokens."""


def agreement_metrics(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor,
                      response_mask: torch.Tensor) -> dict[str, float]:
    """Differences between two log-prob estimates of the same sampled tokens.

    All three are ``(batch, response_len)``; ``response_mask`` is 1 on real tokens. Returns
    ``training/rollout_probs_diff_{mean,max,std}`` (|p_rollout - p_trainer|, verl's names),
    ``training/rollout_logprobs_diff_{mean,max,std}`` (|log p_rollout - log p_trainer|, nats),
    ``training/rollout_actor_probs_pearson_corr`` and ``training/agreement_tokens``.
    """
    keep = response_mask.bool()
    a, b = rollout_logprobs[keep].double(), trainer_logprobs[keep].double()
    out: dict[str, float] = {"training/agreement_tokens": float(keep.sum())}
    if a.numel() == 0:
        return out
    for name, diff in (("probs", (a.exp() - b.exp()).abs()), ("logprobs", (a - b).abs())):
        out[f"training/rollout_{name}_diff_mean"] = float(diff.mean())
        out[f"training/rollout_{name}_diff_max"] = float(diff.max())
        out[f"training/rollout_{name}_diff_std"] = float(diff.std(unbiased=False))
    pa, pb = a.exp(), b.exp()
    if a.numel() > 1 and pa.std() > 0 and pb.std() > 0:
        out["training/rollout_actor_probs_pearson_corr"] = float(torch.corrcoef(torch.stack([pa, pb]))[0, 1])
    return out


def check_agreement(metrics: dict[str, float], threshold: float | None, where: str) -> None:
    """Raise AgreementError when the mean probability gap passes `threshold` (None: never)."""
    gap = metrics.get("training/rollout_probs_diff_mean")
    if threshold is None or gap is None or gap <= threshold:
        return
    raise AgreementError(
        f"trainer and rollout engine disagree at {where}: mean |p_rollout - p_trainer| = {gap:.3g} "
        f"(max {metrics['training/rollout_probs_diff_max']:.3g}, log-prob gap up to "
        f"{metrics['training/rollout_logprobs_diff_max']:.3g} nats) over "
        f"{int(metrics['training/agreement_tokens'])} tokens; the limit is {threshold:g} "
        "(agreement.max_probs_diff_mean). Usual causes: a weight missing from the sync to the rollout "
        "engine (e.g. a tied lm_head), a temperature other than rollout.temperature in the trainer, "
        "different dtypes (rollout.engine_options.dtype vs actor.dtype). Nothing of this step was committed.")


def probe_rows(n_rows: int, want: int) -> list[int]:
    """Up to `want` row indices spread evenly over `n_rows` (all when want is 0 or >= n_rows);
    a pure function of the two, so a retried stage probes the same rows."""
    if want <= 0 or want >= n_rows:
        return list(range(n_rows))
    return sorted({int(i) for i in np.linspace(0, n_rows - 1, want)})


def padded_pair(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> tuple[torch.Tensor, ...]:
    """Two ragged lists of per-token log-probs (same lengths row by row) -> (a, b, mask), each
    ``(rows, max_len)`` right-padded with 0."""
    lengths = [len(x) for x in a]
    if lengths != [len(x) for x in b]:
        raise ValueError("the two log-prob lists differ in length row by row: they are not of the same tokens")
    width = max(lengths, default=0)
    out = [torch.zeros(len(lengths), width, dtype=torch.float64) for _ in range(3)]
    for i, n in enumerate(lengths):
        out[0][i, :n] = torch.as_tensor(np.asarray(a[i], dtype=np.float64))
        out[1][i, :n] = torch.as_tensor(np.asarray(b[i], dtype=np.float64))
        out[2][i, :n] = 1.0
    return tuple(out)


def rows_agreement(rollout: Sequence[Sequence[float]], trainer: Sequence[Any],
                   response_masks: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
    """`agreement_metrics` of two ragged per-row log-prob lists, over the tokens whose
    `response_masks` entry is 1 when given (multi-turn: the model's tokens, not tool turns')."""
    a, b, mask = padded_pair(rollout, [np.asarray(x) for x in trainer])
    if response_masks is not None:
        mask = mask * padded_pair(response_masks, response_masks)[0]
    return agreement_metrics(a, b, mask)

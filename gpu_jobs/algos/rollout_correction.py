"""Rollout correction: importance sampling between the policy that sampled a batch (the rollout
engine, maybe some versions behind) and the policy the update starts from.

With ``log_ratio = old_logprobs - rollout_logprobs`` per token (the trainer's log-probs at the
update's starting weights minus the rollout engine's), as in verl's ``rollout_correction`` and
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (Yao et al. 2025, TIS):

- ``rollout_is`` reweights the policy-gradient loss by a truncated importance weight
  ``min(exp(log_ratio), threshold)``: per token (``token``) or one weight per response, the
  product over its tokens (``sequence``). Weights carry no gradient.
- ``rollout_rs`` rejects (masks out of the policy gradient) tokens or whole responses whose ratio
  lies outside ``[lower, upper]``.

Both are pure functions: tensors in, tensors out, shapes ``(batch, response_len)``.
"""

from __future__ import annotations

import torch

from gpu_jobs.registry import Registry

__all__ = ["ROLLOUT_IS", "ROLLOUT_RS", "rollout_is_weights", "rollout_rs_mask", "rollout_correction_metrics"]

ROLLOUT_IS: Registry = Registry("rollout importance-sampling level")
ROLLOUT_RS: Registry = Registry("rollout rejection-sampling level")


def _token_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return log_ratio * response_mask


def _sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Every token of a response gets the response's summed log-ratio: ``(bs, T)``."""
    return (log_ratio * response_mask).sum(-1, keepdim=True).expand_as(log_ratio)


ROLLOUT_IS.register("token")(_token_log_ratio)
ROLLOUT_IS.register("sequence")(_sequence_log_ratio)
ROLLOUT_RS.register("token")(_token_log_ratio)
ROLLOUT_RS.register("sequence")(_sequence_log_ratio)

# exp() of a summed sequence log-ratio overflows float32 past ~88; clamp before exponentiating
# (the weight is truncated far below that anyway).
_MAX_LOG = 20.0


def rollout_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
                       level: str, threshold: float) -> torch.Tensor:
    """Truncated importance weights ``(bs, T)``: ``min(exp(log_ratio), threshold)`` at ``level``
    ('token' or 'sequence'), 0 on padding. ``threshold`` is the truncation C of TIS (verl 2.0)."""
    log_ratio = ROLLOUT_IS[level](old_logprobs - rollout_logprobs, response_mask)
    weights = torch.exp(log_ratio.clamp(max=_MAX_LOG)).clamp(max=threshold)
    return (weights * response_mask).detach()


def rollout_rs_mask(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
                    level: str, lower: float, upper: float) -> torch.Tensor:
    """``(bs, T)`` 1 where the token (or its whole response, at 'sequence') has a ratio inside
    ``[lower, upper]``, else 0; 0 on padding."""
    log_ratio = ROLLOUT_RS[level](old_logprobs - rollout_logprobs, response_mask)
    inside = (log_ratio >= torch.log(torch.tensor(lower))) & (log_ratio <= torch.log(torch.tensor(upper)))
    return inside.to(response_mask.dtype) * response_mask


def rollout_correction_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                               response_mask: torch.Tensor, weights: torch.Tensor | None,
                               keep: torch.Tensor | None, threshold: float | None) -> dict[str, torch.Tensor]:
    """``rollout_corr/*`` metrics: the mismatch (mean log-ratio, i.e. the log-perplexity gap per
    token, and its KL estimate), the weights' mean/max and the share truncated, the share of
    tokens rejected."""
    mask = response_mask.bool()
    log_ratio = (old_logprobs - rollout_logprobs)[mask]
    out: dict[str, torch.Tensor] = {}
    if log_ratio.numel() == 0:
        return out
    out["rollout_corr/log_ratio_mean"] = log_ratio.mean()
    out["rollout_corr/kl"] = (log_ratio.exp() - 1 - log_ratio).mean()  # k3 of KL(rollout || old)
    if weights is not None:
        w = weights[mask]
        out["rollout_corr/is_weight_mean"] = w.mean()
        out["rollout_corr/is_weight_max"] = w.max()
        if threshold is not None:
            out["rollout_corr/is_truncated_frac"] = (w >= threshold).double().mean()
    if keep is not None:
        out["rollout_corr/rs_masked_frac"] = 1.0 - keep[mask].double().mean()
    return out

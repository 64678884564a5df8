"""Policy losses and the clipped value loss, chosen by name.

Every policy loss has the signature
``fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean", **params)``
with all tensors ``(bs, T)`` (``log_prob`` carries the gradient) and returns
``(loss, metrics)``: a scalar and ``{"actor/pg_loss", "actor/pg_clipfrac",
"actor/pg_clipfrac_lower", "actor/ppo_kl"}`` as detached scalar tensors (no device sync).
``ratio = exp(log_prob - old_log_prob)``; ``approx_kl`` reported as ``actor/ppo_kl`` is the
masked mean of ``old_log_prob - log_prob``.
"""

from __future__ import annotations

import inspect
from enum import Enum
from typing import Any

import torch

from .functional import agg_loss, masked_mean
from gpu_jobs.registry import Registry

__all__ = [
    "PolicyLossMode",
    "POLICY_LOSSES",
    "register_policy_loss",
    "get_policy_loss_fn",
    "compute_policy_loss",
    "known_policy_loss_params",
    "compute_value_loss",
]


class PolicyLossMode(str, Enum):
    VANILLA = "vanilla"
    GSPO = "gspo"
    CISPO = "cispo"
    GPG = "gpg"
    CLIP_COV = "clip_cov"
    KL_COV = "kl_cov"


POLICY_LOSSES: Registry = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register


def get_policy_loss_fn(name: str | PolicyLossMode):
    """The policy loss registered under ``name``; unknown names raise and list the valid ones."""
    return POLICY_LOSSES[name]


def _metrics(loss, clipfrac, ppo_kl, clipfrac_lower) -> dict[str, torch.Tensor]:
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    pick = lambda x: zero if x is None else x.detach().to(loss.dtype)  # noqa: E731
    return {
        "actor/pg_loss": loss.detach(),
        "actor/pg_clipfrac": pick(clipfrac),
        "actor/pg_clipfrac_lower": pick(clipfrac_lower),
        "actor/ppo_kl": pick(ppo_kl),
    }


def _bounds(clip_ratio, clip_ratio_low, clip_ratio_high) -> tuple[float, float]:
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return low, high


def _ppo_clip_terms(log_ratio, advantages, low, high):
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    return ratio, loss1, loss2


@register_policy_loss(PolicyLossMode.VANILLA)
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al., arXiv:1707.06347) with clip-higher
    (DAPO, arXiv:2503.14476) and dual-clip (Ye et al., arXiv:1912.09729).

    ``L = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``; for ``A < 0`` it is
    further capped at ``-A * clip_ratio_c``. ``log_ratio`` is clamped to [-20, 20] (verl).
    ``pg_clipfrac``: share of tokens where the clipped branch is taken;
    ``pg_clipfrac_lower``: share where the dual-clip cap is taken.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    low, high = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    _, loss1, loss2 = _ppo_clip_terms(log_ratio, advantages, low, high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    dual = torch.minimum(clipped, loss3)
    pg_losses = torch.where(advantages < 0, dual, clipped)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    clipfrac = masked_mean((loss2 > loss1).to(loss.dtype), response_mask)
    clipfrac_lower = masked_mean(((clipped > loss3) & (advantages < 0)).to(loss.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, masked_mean(-log_ratio, response_mask), clipfrac_lower)


@register_policy_loss(PolicyLossMode.GSPO)
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al., arXiv:2507.18071), token form ("GSPO-token").

    Sequence ratio ``s_i = exp(mean_t log_ratio_{i,t})``; each token uses
    ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]`` (value ``s_i``, gradient of ``log_prob``),
    clipped PPO-style. The paper's objective is ``loss_agg_mode="seq-mean-token-mean"``
    (verl forces that mode; here the caller's mode is honoured). The log ratio is capped at 10.
    """
    low, high = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]
    _, loss1, loss2 = _ppo_clip_terms(torch.clamp(token_log_ratio, max=10.0), advantages, low, high)
    loss = agg_loss(torch.maximum(loss1, loss2), response_mask, loss_agg_mode)
    clipfrac = masked_mean((loss2 > loss1).to(loss.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, masked_mean(-log_ratio, response_mask), None)


@register_policy_loss(PolicyLossMode.CISPO)
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): ``L = -sg[clip(r, 1 - low, 1 + high)] * A * log_prob``.

    The importance weight is clipped and detached, so no token loses its gradient (PPO zeroes
    clipped tokens). The paper leaves the lower bound open: use a ``clip_ratio_low`` near 1.
    ``pg_clipfrac`` / ``pg_clipfrac_lower``: share of tokens above / below the band.
    """
    low, high = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, 1 - low, 1 + high)
    loss = agg_loss(-weight * advantages * log_prob, response_mask, loss_agg_mode)
    above = masked_mean((ratio > 1 + high).to(loss.dtype), response_mask)
    below = masked_mean((ratio < 1 - low).to(loss.dtype), response_mask)
    return loss, _metrics(loss, above, masked_mean(-log_ratio, response_mask), below)


@register_policy_loss(PolicyLossMode.GPG)
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG (Chu et al., arXiv:2504.02546): plain policy gradient ``L = -A * log_prob``, no ratio,
    no clipping (clip fractions are 0)."""
    loss = agg_loss(-advantages * log_prob, response_mask, loss_agg_mode)
    ppo_kl = masked_mean((old_log_prob - log_prob).detach(), response_mask)
    return loss, _metrics(loss, None, ppo_kl, None)


def _token_covariance(advantages, log_prob, response_mask):
    # Centred product of advantage and log-prob over the valid tokens of the batch: the
    # per-token contribution to Cov(log pi, A), which drives entropy collapse (arXiv:2505.22617).
    lp = log_prob.detach()
    adv = advantages.detach()
    return (adv - masked_mean(adv, response_mask)) * (lp - masked_mean(lp, response_mask))


def _rank(keys: torch.Tensor) -> torch.Tensor:
    """Position of each element in ascending order of ``keys`` (same shape)."""
    flat = keys.reshape(-1)
    rank = torch.empty_like(flat, dtype=torch.long)
    rank[flat.argsort()] = torch.arange(flat.numel(), device=flat.device)
    return rank.reshape(keys.shape)


def _budget(ratio: float, response_mask: torch.Tensor) -> torch.Tensor:
    # max(1, floor(ratio * n_valid)) as a tensor, so no .item() sync is needed.
    n_valid = response_mask.to(torch.float64).sum()
    return torch.floor(ratio * n_valid).clamp(min=1)


@register_policy_loss(PolicyLossMode.CLIP_COV)
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617).

    PPO clip, plus: among tokens not already clipped whose covariance term lies in
    ``(clip_cov_lb, clip_cov_ub)``, ``max(1, floor(clip_cov_ratio * n_valid))`` chosen at random
    (``generator``) get their loss and gradient zeroed. ``pg_clipfrac`` is that share.
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    low, high = _bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    log_ratio = log_prob - old_log_prob
    _, loss1, loss2 = _ppo_clip_terms(log_ratio, advantages, low, high)
    valid = response_mask.bool()
    cov = _token_covariance(advantages, log_prob, response_mask)
    candidate = valid & ~(loss2 > loss1) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    keys = torch.rand(cov.shape, generator=generator, device=cov.device, dtype=torch.float64)
    keys = torch.where(candidate, keys, 2.0)  # non-candidates sort last
    selected = candidate & (_rank(keys) < _budget(clip_cov_ratio, response_mask))
    pg_losses = torch.where(selected, 0.0, torch.maximum(loss1, loss2))
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    clipfrac = masked_mean(selected.to(loss.dtype), response_mask)
    return loss, _metrics(loss, clipfrac, masked_mean(-log_ratio, response_mask), None)


@register_policy_loss(PolicyLossMode.KL_COV)
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al., arXiv:2505.22617): unclipped ``-A r``, plus ``ppo_kl_coef * |log r|``
    on the ``max(1, floor(kl_cov_ratio * n_valid))`` valid tokens with the largest covariance
    term. ``actor/ppo_kl`` is the masked mean of ``|log r|`` (as verl reports it).
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    pg_losses = -advantages * torch.exp(log_ratio)
    valid = response_mask.bool()
    cov = torch.where(valid, _token_covariance(advantages, log_prob, response_mask), float("-inf"))
    selected = valid & (_rank(-cov) < _budget(kl_cov_ratio, response_mask))
    pg_losses = torch.where(selected, pg_losses + ppo_kl_coef * log_ratio.abs(), pg_losses)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return loss, _metrics(loss, None, masked_mean(log_ratio.abs(), response_mask), None)


_INPUTS = ("old_log_prob", "log_prob", "advantages", "response_mask")


def known_policy_loss_params() -> set[str]:
    """Every keyword parameter any registered policy loss takes."""
    names: set[str] = set()
    for fn in POLICY_LOSSES.values():
        names |= {
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind is not p.VAR_KEYWORD and p.name not in _INPUTS
        }
    return names


def compute_policy_loss(
    name: str | PolicyLossMode,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    **params: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call the loss registered as ``name`` with the ``params`` it declares; params that only
    other losses use are ignored, params no loss knows raise ``TypeError``."""
    fn = POLICY_LOSSES[name]
    unknown = set(params) - known_policy_loss_params()
    if unknown:
        raise TypeError(
            f"unknown policy-loss parameter(s) {sorted(unknown)}; known: {sorted(known_policy_loss_params())}"
        )
    sig = inspect.signature(fn).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in sig.values())
    kwargs = {k: v for k, v in params.items() if takes_all or k in sig}
    return fn(old_log_prob, log_prob, advantages, response_mask, **kwargs)


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO, arXiv:1707.06347; as in OpenAI baselines / TRL).

    ``vpreds``, ``returns``, ``values`` (old predictions), ``response_mask``: ``(bs, T)``.
    ``L = 0.5 * agg(max((v - R)^2, (clip(v, V_old - c, V_old + c) - R)^2))``.
    Returns ``(loss, vf_clipfrac)``, the second detached: share of tokens where the clipped
    term is the larger one.
    """
    clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    loss1 = (vpreds - returns) ** 2
    loss2 = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(loss1, loss2), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean((loss2 > loss1).to(loss.dtype), response_mask).detach()
    return loss, vf_clipfrac

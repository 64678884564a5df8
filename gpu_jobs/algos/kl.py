"""KL estimators between the policy and a reference, KL-in-reward, and KL coefficient control.

Estimators follow J. Schulman, "Approximating KL divergence" (2020,
http://joschu.net/blog/kl-approx.html), with ``log_ratio = log_prob - ref_log_prob``:
k1 = log_ratio; abs = |log_ratio|; k2 = 0.5 * log_ratio^2; k3 = exp(-log_ratio) + log_ratio - 1.
A ``+`` suffix (``k1+``, ``k3+``, ...) keeps the estimator's value but takes the gradient of
k2, whose expected gradient is the gradient of KL (straight-through trick, as in verl).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from .functional import masked_mean
from gpu_jobs.registry import Registry

__all__ = [
    "KLPenalty",
    "KL_ESTIMATORS",
    "kl_penalty",
    "apply_kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
]


class KLPenalty(str, Enum):
    K1 = "k1"
    KL = "kl"
    ABS = "abs"
    K2 = "k2"
    MSE = "mse"
    K3 = "k3"
    LOW_VAR_KL = "low_var_kl"


KL_ESTIMATORS: Registry = Registry("kl_penalty")


@KL_ESTIMATORS.register(KLPenalty.K1)
def _k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register(KLPenalty.ABS)
def _abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


@KL_ESTIMATORS.register(KLPenalty.K2)
def _k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register(KLPenalty.K3)
def _k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    # Unbiased and always >= 0; clamped (verl) because exp() of a large log-ratio explodes.
    log_r = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_r) - log_r - 1, min=-10.0, max=10.0)


KL_ESTIMATORS.register(KLPenalty.KL)(_k1)
KL_ESTIMATORS.register(KLPenalty.MSE)(_k2)
KL_ESTIMATORS.register(KLPenalty.LOW_VAR_KL)(_k3)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate ``(bs, T)`` from ``log_prob`` and ``ref_log_prob`` ``(bs, T)``.

    ``kl_penalty``: ``k1``/``kl``, ``abs``, ``k2``/``mse``, ``k3``/``low_var_kl`` (clamped to
    [-10, 10]), each optionally suffixed ``+`` (value of the estimator, gradient of k2).
    Unknown names raise and list the valid ones.
    """
    name = kl_penalty.value if isinstance(kl_penalty, Enum) else kl_penalty
    straight_through = name.endswith("+")
    base = name[:-1] if straight_through else name
    value = KL_ESTIMATORS[base](log_prob, ref_log_prob)
    if not straight_through or KL_ESTIMATORS[base] is _k2:
        return value
    grad_path = _k2(log_prob, ref_log_prob)
    return grad_path - grad_path.detach() + value.detach()


_kl_penalty = kl_penalty  # apply_kl_penalty's argument of the same name shadows the function


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL in the reward (Ziegler et al., arXiv:1909.08593; InstructGPT):
    ``token_level_rewards = token_level_scores - kl_coef * KL_t`` on response tokens.

    All tensors ``(bs, T)``. Returns ``(token_level_rewards, metrics)`` with
    ``actor/reward_kl_penalty`` (mean over rows of each row's token-mean KL) and
    ``actor/reward_kl_penalty_coeff``. Feed the first to ``kl_ctrl.update(float(...), bs)``.
    """
    kld = torch.where(response_mask.bool(), _kl_penalty(old_log_prob, ref_log_prob, kl_penalty), 0.0)
    rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean()
    metrics = {
        "actor/reward_kl_penalty": current_kl.detach(),
        "actor/reward_kl_penalty_coeff": torch.tensor(float(kl_coef), dtype=kld.dtype, device=kld.device),
    }
    return rewards, metrics


class FixedKLController:
    """A constant KL coefficient.

    >>> ctrl = FixedKLController(kl_coef=0.001)
    >>> ctrl.update(current_kl=5.0, n_steps=64); ctrl.value
    0.001
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al., arXiv:1909.08593, section 2.2):
    ``e = clip(KL / target_kl - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n_steps / horizon)``.

    >>> ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    >>> ctrl.update(current_kl=2.0, n_steps=10); round(ctrl.value, 6)  # e = +0.2 -> x1.02
    0.102
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])

"""Typed configs for the RL math, with verl's field names and defaults.

The math in this package never reads these: a config produces the plain keyword arguments
(``AlgorithmConfig.advantage_kwargs()``, ``PolicyLossConfig.loss_kwargs()``) that the pure
functions take. Cross-field checks run at construction and say how to fix the value.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator, EstimatorTraits
from .functional import LOSS_AGG_MODES
from .kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController
from .policy_losses import POLICY_LOSSES

__all__ = [
    "KLControlConfig",
    "FilterGroupsConfig",
    "RolloutCorrectionConfig",
    "OverlongBufferConfig",
    "AlgorithmConfig",
    "PolicyLossConfig",
    "KLConfig",
]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _check_kl_name(value: str, field: str) -> str:
    base = value[:-1] if value.endswith("+") else value
    if base not in KL_ESTIMATORS:
        raise ValueError(
            f"{field}={value!r} is not a KL estimator; use one of {sorted(KL_ESTIMATORS)}, "
            "optionally with a '+' suffix (e.g. 'k3+')"
        )
    return value


class KLControlConfig(_Config):
    """How the KL-in-reward coefficient evolves.

    >>> KLControlConfig(type="adaptive", kl_coef=0.05, target_kl=0.1, horizon=10000).build().value
    0.05
    """

    type: Literal["fixed", "adaptive"] = Field(
        "fixed", description="'fixed' keeps kl_coef; 'adaptive' steers it toward target_kl (Ziegler et al. 2019)."
    )
    kl_coef: float = Field(0.001, ge=0, description="Initial (or fixed) KL coefficient beta.")
    horizon: int = Field(10000, description="Adaptive controller horizon, in samples.")
    target_kl: float = Field(0.1, description="Adaptive controller target KL per token.")

    @model_validator(mode="after")
    def _check_adaptive(self) -> KLControlConfig:
        if self.type == "adaptive":
            if self.target_kl <= 0:
                raise ValueError(
                    f"adaptive KL control needs target_kl > 0 (got {self.target_kl}); set kl_ctrl.target_kl, e.g. 0.1"
                )
            if self.horizon <= 0:
                raise ValueError(
                    f"adaptive KL control needs horizon > 0 (got {self.horizon}); set kl_ctrl.horizon, e.g. 10000"
                )
        return self

    def build(self) -> FixedKLController | AdaptiveKLController:
        """A fresh controller for this config."""
        if self.type == "adaptive":
            return AdaptiveKLController(self.kl_coef, self.target_kl, self.horizon)
        return FixedKLController(self.kl_coef)


class FilterGroupsConfig(_Config):
    """DAPO dynamic sampling: drop groups whose responses all have the same ``metric``, and
    generate more rounds of prompts until ``data.train_batch_size`` groups survive
    (``gpu_jobs.stages.dynamic_sampling``).

    >>> FilterGroupsConfig(enable=True, metric="acc", max_num_gen_batches=10).max_num_gen_batches
    10
    """

    enable: bool = Field(False, description="Drop zero-variance groups and sample more prompts to refill the batch.")
    metric: str | None = Field(
        None,
        description="Per-response metric whose variance is tested: 'score' (the reward function's score), "
        "'seq_reward' or 'seq_final_reward' (score plus the overlong penalty), or any key of the reward "
        "function's extra dict, e.g. 'acc' (a reward function returning a plain float has acc = score, as in verl).",
    )
    max_num_gen_batches: int = Field(
        0,
        ge=0,
        description="Most generation rounds per iteration, the first included; when they leave fewer than "
        "data.train_batch_size groups the rollout raises. 0 = no cap: rounds go on until enough groups survive "
        "or every prompt of the dataset was generated in the iteration (then it raises).",
    )

    @model_validator(mode="after")
    def _check_metric(self) -> FilterGroupsConfig:
        if self.enable and not self.metric:
            raise ValueError("filter_groups.enable=True needs filter_groups.metric (e.g. 'score' or 'acc')")
        return self


class OverlongBufferConfig(_Config):
    """DAPO soft overlong punishment over the last ``len`` tokens before max_response_length."""

    enable: bool = Field(False, description="Penalise responses that run into the buffer zone.")
    len: int = Field(
        0, ge=0, description="Buffer length in tokens; the penalty ramps from 0 to -penalty_factor across it."
    )
    penalty_factor: float = Field(0.0, ge=0, description="Penalty at max_response_length.")
    log: bool = Field(
        False,
        description="Add per-response columns overlong_reward (the penalty) and overlong (penalty < 0) to the "
        "advantages table, and the metric reward/overlong_frac (verl logs the same pair as reward extra info).",
    )

    @model_validator(mode="after")
    def _check_len(self) -> OverlongBufferConfig:
        if self.enable and self.len <= 0:
            raise ValueError(
                "overlong_buffer.enable=True needs overlong_buffer.len > 0 (e.g. a quarter of max_response_length)"
            )
        return self


class RolloutCorrectionConfig(_Config):
    """Importance sampling between the rollout engine's policy and the update's (verl's
    ``algorithm.rollout_correction``): needed when rollouts are stale (async_training) and
    useful whenever the two engines differ (bf16 rollout, fp32 trainer)."""

    rollout_is: Literal["token", "sequence"] | None = Field(
        None, description="Reweight the policy-gradient loss by min(p_old / p_rollout, rollout_is_threshold): "
        "per token, or one weight per response (product over its tokens); null = off.")
    rollout_is_threshold: float = Field(2.0, gt=0, description="Truncation C of the importance weights (TIS).")
    rollout_rs: Literal["token", "sequence"] | None = Field(
        None, description="Reject (zero the policy gradient of) tokens, or whole responses, whose ratio "
        "p_old / p_rollout is outside [rollout_rs_threshold_lower, rollout_rs_threshold]; null = off.")
    rollout_rs_threshold: float = Field(2.0, gt=0, description="Upper ratio bound of rejection sampling.")
    rollout_rs_threshold_lower: float | None = Field(
        None, gt=0, description="Lower ratio bound; null = 1 / rollout_rs_threshold.")

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None

    @model_validator(mode="after")
    def _check_bounds(self) -> "RolloutCorrectionConfig":
        lower = self.rs_lower
        if self.rollout_rs is not None and not lower < self.rollout_rs_threshold:
            raise ValueError(f"rollout_rs_threshold_lower ({lower}) must be below rollout_rs_threshold "
                             f"({self.rollout_rs_threshold})")
        return self

    @property
    def rs_lower(self) -> float:
        return self.rollout_rs_threshold_lower or 1.0 / self.rollout_rs_threshold


class AlgorithmConfig(_Config):
    """Advantage estimation and KL-in-reward (verl's ``algorithm.*``).

    >>> cfg = AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=False)  # Dr. GRPO
    >>> cfg.advantage_kwargs()
    {'epsilon': 1e-06, 'norm_adv_by_std_in_grpo': False}
    """

    adv_estimator: str = Field(
        AdvantageEstimator.GAE.value,
        description="Advantage estimator: a name registered in gpu_jobs.algos.ADVANTAGE_ESTIMATORS (built in: "
        + ", ".join(e.value for e in AdvantageEstimator) + "). What it needs is declared where it registers: "
        "'gae' a critic (values), 'remax' greedy-sample reward baselines, grpo/rloo/... groups (rollout.n >= 2).",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor (gae, reinforce_plus_plus).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (gae).")
    norm_adv_by_std_in_grpo: bool = Field(
        True, description="Divide GRPO advantages by the group std; False gives Dr. GRPO."
    )
    epsilon: float = Field(
        1e-6, gt=0, description="Added to the group std before dividing (grpo, grpo_passk): A = (s - mean) / "
        "(std + epsilon). verl's 1e-6; TRL's GRPOTrainer adds 1e-4 (set 1e-4 to take its steps exactly).",
    )
    use_kl_in_reward: bool = Field(False, description="Subtract kl_ctrl.value * KL(policy || ref) from token rewards.")
    kl_penalty: str = Field(
        "kl", description="KL estimator for the in-reward penalty: k1/kl, abs, k2/mse, k3/low_var_kl, '+' variants."
    )
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig, description="KL coefficient control.")
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig, description="DAPO dynamic sampling.")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,
        description="Importance sampling / rejection between rollout and trainer policies (needs the "
        "trainer's old log-probs: actor.recompute_old_logprobs=true).")

    @model_validator(mode="after")
    def _check_filter_metric(self) -> AlgorithmConfig:
        fg = self.filter_groups
        if fg.enable and fg.metric == "seq_final_reward" and self.use_kl_in_reward:
            # Groups are filtered at rollout time, before the log-probs that the KL penalty needs
            # exist; filtering on a reward without it would silently differ from verl's.
            raise ValueError(
                "filter_groups.metric='seq_final_reward' with use_kl_in_reward=True is not supported: groups are "
                "filtered before the KL penalty is known; use filter_groups.metric='seq_reward' (or 'score'/'acc')"
            )
        return self

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        ADVANTAGE_ESTIMATORS[value]  # raises, listing the valid names
        return value

    @field_validator("kl_penalty")
    @classmethod
    def _known_kl(cls, value: str) -> str:
        return _check_kl_name(value, "kl_penalty")

    @property
    def traits(self) -> EstimatorTraits:
        """What the chosen estimator declared at its registration."""
        return ADVANTAGE_ESTIMATORS.traits(self.adv_estimator)

    @property
    def needs_critic(self) -> bool:
        """True when the estimator reads critic values (gae): a critic must be trained."""
        return self.traits.needs_critic

    @property
    def needs_groups(self) -> bool:
        """True when the estimator compares responses to one prompt (grpo, rloo, ...): rollout.n >= 2."""
        return self.traits.needs_groups

    @property
    def needs_reward_baselines(self) -> bool:
        """True when the estimator reads greedy-sample reward baselines (remax)."""
        return self.traits.needs_reward_baselines

    def advantage_kwargs(self) -> dict[str, Any]:
        """The estimator's keyword parameters (read from its signature) that this config has a
        field for, for ``compute_advantage(**kwargs)``; the others keep the function's defaults."""
        fields = type(self).model_fields
        return {k: getattr(self, k) for k in self.traits.params if k in fields}


class PolicyLossConfig(_Config):
    """Actor policy loss (verl's ``actor_rollout_ref.actor`` clip fields + ``policy_loss.*``).

    >>> PolicyLossConfig(loss_mode="gpg").loss_kwargs()
    {'loss_agg_mode': 'token-mean'}
    """

    loss_mode: str = Field(
        "vanilla", description="Policy loss: vanilla (PPO clip), gspo, cispo, gpg, clip_cov, kl_cov."
    )
    clip_ratio: float = Field(0.2, description="PPO clip epsilon; the default for clip_ratio_low/high.")
    clip_ratio_low: float | None = Field(0.2, description="Lower clip: ratio >= 1 - clip_ratio_low. None = clip_ratio.")
    clip_ratio_high: float | None = Field(
        0.2, description="Upper clip: ratio <= 1 + clip_ratio_high; DAPO's clip-higher uses 0.28. None = clip_ratio."
    )
    clip_ratio_c: float = Field(3.0, description="Dual-clip bound for negative advantages (vanilla); must be > 1.")
    loss_agg_mode: str = Field(
        "token-mean", description="token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."
    )
    clip_cov_ratio: float = Field(0.0002, description="clip_cov: share of tokens whose gradient is dropped.")
    clip_cov_lb: float = Field(1.0, description="clip_cov: lower bound of the covariance window.")
    clip_cov_ub: float = Field(5.0, description="clip_cov: upper bound of the covariance window.")
    kl_cov_ratio: float = Field(0.0002, description="kl_cov: share of tokens that get the |log ratio| penalty.")
    ppo_kl_coef: float = Field(0.1, ge=0, description="kl_cov: coefficient of the |log ratio| penalty.")

    @field_validator("loss_mode")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        POLICY_LOSSES[value]
        return value

    @field_validator("loss_agg_mode")
    @classmethod
    def _known_agg(cls, value: str) -> str:
        LOSS_AGG_MODES[value]
        return value

    @model_validator(mode="after")
    def _check_ranges(self) -> PolicyLossConfig:
        if not 0 < self.clip_ratio < 1:
            raise ValueError(f"clip_ratio must be in (0, 1), got {self.clip_ratio}; PPO uses 0.2")
        if self.clip_ratio_low is not None and not 0 < self.clip_ratio_low < 1:
            raise ValueError(
                f"clip_ratio_low must be in (0, 1) so that 1 - clip_ratio_low > 0, got {self.clip_ratio_low}"
            )
        if self.clip_ratio_high is not None and self.clip_ratio_high <= 0:
            raise ValueError(f"clip_ratio_high must be > 0, got {self.clip_ratio_high}; DAPO uses 0.28")
        if self.clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1 (dual-clip bound), got {self.clip_ratio_c}; verl uses 3.0")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}; the paper uses 0.0002")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb ({self.clip_cov_lb}) must be below clip_cov_ub ({self.clip_cov_ub})")
        return self

    def loss_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the chosen loss, ``loss_agg_mode`` included:
        ``get_policy_loss_fn(cfg.loss_mode)(old, new, adv, mask, **cfg.loss_kwargs())``."""
        params = inspect.signature(POLICY_LOSSES[self.loss_mode]).parameters
        fields = type(self).model_fields
        out = {k: getattr(self, k) for k in params if k in fields and k != "loss_mode"}
        for side in ("clip_ratio_low", "clip_ratio_high"):
            if side in out and out[side] is None:
                out[side] = self.clip_ratio
        return out


class KLConfig(_Config):
    """KL as a loss term on the actor (verl's ``actor.use_kl_loss``; GRPO's choice)."""

    use_kl_loss: bool = Field(False, description="Add kl_loss_coef * KL(policy || ref) to the actor loss.")
    kl_loss_coef: float = Field(0.001, ge=0, description="Weight of the KL loss term.")
    kl_loss_type: str = Field(
        "low_var_kl", description="KL estimator: k1/kl, abs, k2/mse, k3/low_var_kl; '+' = straight-through k2 gradient."
    )

    @field_validator("kl_loss_type")
    @classmethod
    def _known_kl(cls, value: str) -> str:
        return _check_kl_name(value, "kl_loss_type")

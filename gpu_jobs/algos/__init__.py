"""Pure RL math for rlmill: advantage estimators, policy/value losses, KL, DAPO helpers, and
the offline preference losses (DPO, KTO).

Tensors and plain numbers in, tensors out; variants are chosen by name through registries
(``ADVANTAGE_ESTIMATORS``, ``POLICY_LOSSES``, ``KL_ESTIMATORS``, ``LOSS_AGG_MODES``,
``PREFERENCE_LOSSES``, ``PREFERENCE_ALGORITHMS``).
Names, defaults and metric keys follow verl. Run the tests with
``.venv/bin/python -m pytest -q tests/algos``.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    EstimatorRegistry,
    EstimatorTraits,
    compute_advantage,
    get_adv_estimator_fn,
    group_ids,
    known_advantage_params,
    register_adv_est,
)
from .config import (
    AlgorithmConfig,
    FilterGroupsConfig,
    KLConfig,
    KLControlConfig,
    OverlongBufferConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
)
from .dapo import SEQUENCE_FILTER_METRICS, filter_groups, filter_metric, overlong_penalty
from .rollout_correction import (
    ROLLOUT_IS,
    ROLLOUT_RS,
    rollout_correction_metrics,
    rollout_is_weights,
    rollout_rs_mask,
)
from .functional import (
    LOSS_AGG_MODES,
    LossAggMode,
    agg_loss,
    entropy_from_logits,
    logprobs_and_entropy,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from .kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLPenalty,
    apply_kl_penalty,
    kl_penalty,
)
from .policy_losses import (
    POLICY_LOSSES,
    PolicyLossMode,
    compute_policy_loss,
    compute_value_loss,
    get_policy_loss_fn,
    known_policy_loss_params,
    register_policy_loss,
)
from .preference import (
    PREFERENCE_ALGORITHMS,
    PREFERENCE_LOSSES,
    DPOLossType,
    PreferenceConfig,
    SequenceLogprobs,
    dpo_loss,
    kto_kl_indices,
    kto_loss,
    register_preference_loss,
    sequence_logprobs,
)
from gpu_jobs.registry import DuplicateNameError, Registry, UnknownNameError

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "EstimatorRegistry",
    "EstimatorTraits",
    "compute_advantage",
    "get_adv_estimator_fn",
    "group_ids",
    "known_advantage_params",
    "register_adv_est",
    "AlgorithmConfig",
    "FilterGroupsConfig",
    "KLConfig",
    "KLControlConfig",
    "OverlongBufferConfig",
    "PolicyLossConfig",
    "RolloutCorrectionConfig",
    "ROLLOUT_IS",
    "ROLLOUT_RS",
    "rollout_correction_metrics",
    "rollout_is_weights",
    "rollout_rs_mask",
    "SEQUENCE_FILTER_METRICS",
    "filter_groups",
    "filter_metric",
    "overlong_penalty",
    "LOSS_AGG_MODES",
    "LossAggMode",
    "agg_loss",
    "entropy_from_logits",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLPenalty",
    "apply_kl_penalty",
    "kl_penalty",
    "POLICY_LOSSES",
    "PolicyLossMode",
    "compute_policy_loss",
    "compute_value_loss",
    "get_policy_loss_fn",
    "known_policy_loss_params",
    "register_policy_loss",
    "PREFERENCE_ALGORITHMS",
    "PREFERENCE_LOSSES",
    "DPOLossType",
    "PreferenceConfig",
    "SequenceLogprobs",
    "dpo_loss",
    "kto_kl_indices",
    "kto_loss",
    "register_preference_loss",
    "sequence_logprobs",
    "DuplicateNameError",
    "Registry",
    "UnknownNameError",
]

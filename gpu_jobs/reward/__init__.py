"""Reward scoring: built-in rule scorers routed by data_source, users' verl reward files run in
a guarded worker pool, and a sequence-classifier reward model.

    >>> from gpu_jobs.reward import RewardConfig, score_batch, default_compute_score
    >>> default_compute_score("openai/gsm8k", "She pays 18 dollars.\\n#### 18", "18")
    1.0

Importing this package is light (no torch): worker processes import it to run user functions.
`ModelRewardScorer` imports torch and transformers when it is constructed.
"""

from .batch import coerce_result, score_batch
from .config import CustomRewardFunctionConfig, RewardConfig, RewardModelConfig
from .custom import load_custom_reward_function
from .ground_truth import decode_ground_truth, encode_ground_truth
from .model_reward import ModelRewardScorer
from .registry import (
    REWARD_FNS,
    REWARD_PREFIXES,
    UnknownDataSourceError,
    default_compute_score,
    get_reward_fn,
    known_data_sources,
    register_reward_fn,
)
from .rules import arith_score, gsm8k_extract, gsm8k_score, math_score, reasoning_gym_score

__all__ = [
    "RewardConfig",
    "RewardModelConfig",
    "CustomRewardFunctionConfig",
    "score_batch",
    "coerce_result",
    "default_compute_score",
    "get_reward_fn",
    "register_reward_fn",
    "known_data_sources",
    "REWARD_FNS",
    "REWARD_PREFIXES",
    "UnknownDataSourceError",
    "load_custom_reward_function",
    "encode_ground_truth",
    "decode_ground_truth",
    "ModelRewardScorer",
    "gsm8k_extract",
    "gsm8k_score",
    "arith_score",
    "math_score",
    "reasoning_gym_score",
]

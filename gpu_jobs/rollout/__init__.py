"""Rollout roles: one interface (`RolloutEngine`), backends "hf" and "vllm".

Importing this package is light; torch/transformers/vllm load when an engine is built.
"""

from gpu_jobs.rollout.base import (
    ROLLOUT_ENGINES,
    RolloutEngineConfig,
    RolloutEngine,
    SamplingConfig,
    get_rollout_engine,
    register_rollout_engine,
)
from gpu_jobs.rollout.hf_engine import HFRolloutEngine
from gpu_jobs.rollout.vllm_engine import VLLMRolloutEngine

__all__ = [
    "ROLLOUT_ENGINES",
    "HFRolloutEngine",
    "RolloutEngineConfig",
    "RolloutEngine",
    "SamplingConfig",
    "VLLMRolloutEngine",
    "get_rollout_engine",
    "register_rollout_engine",
]

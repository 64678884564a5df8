"""The stages of an RL iteration as plain functions over a RunContext (no Prefect here).

tasks/ wraps each in a Prefect task; tests call them directly.
"""

from gpu_jobs.stages.context import RunConfigMismatchError, RunContext, last_committed
from gpu_jobs.stages.iteration import (
    STAGES,
    advantages,
    baseline,
    commit,
    gate,
    logprobs,
    probe_agreement,
    replay_update,
    reward,
    rollout,
    sync_weights,
    update,
    validate,
    values,
)

__all__ = ["RunContext", "RunConfigMismatchError", "last_committed", "STAGES", "rollout", "baseline", "gate", "reward",
           "logprobs", "values", "advantages", "update", "replay_update", "probe_agreement", "sync_weights", "commit", "validate"]

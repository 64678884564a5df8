"""The stage layer: the run config, the frozen run, its warm engines, the stages of an iteration
inside one commit shell, and the iteration graph written once (no Prefect here).

    run, engines = open_warm(cfg)
    uris = run_iteration(DirectCalls(run, engines), cfg, k=1)

tasks/ wraps each stage in a Prefect task and flows/ passes those to the same graph.
"""

from gpu_jobs.stages.engines import Engines
from gpu_jobs.stages.graph import DirectCalls, StageCalls, optional_stages, run_iteration
from gpu_jobs.stages.iteration import (
    STAGE_FUNCTIONS,
    STAGES,
    advantages,
    baseline,
    commit,
    gate,
    logprobs,
    reward,
    rollout,
    sync_weights,
    update,
    validate,
    values,
)
from gpu_jobs.stages.resume import load_policy_into_rollout, open_warm, probe_agreement, replay_update, restore
from gpu_jobs.stages.run import Run, RunConfigMismatchError, last_committed

__all__ = ["Run", "Engines", "RunConfigMismatchError", "last_committed", "open_warm", "restore", "replay_update",
           "probe_agreement", "load_policy_into_rollout", "StageCalls", "DirectCalls", "run_iteration",
           "optional_stages", "STAGES", "STAGE_FUNCTIONS", "rollout", "baseline", "gate", "reward", "logprobs",
           "values", "advantages", "update", "sync_weights", "commit", "validate"]

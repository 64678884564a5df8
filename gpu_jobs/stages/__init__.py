"""The stage layer: the run config, the frozen run, its warm roles, the stages of an iteration
inside one commit shell, and the iteration graph written once (no Prefect here).

    run, roles = open_warm(cfg)
    uris = run_iteration(DirectCalls(run, roles), cfg, k=1)

A run with a `preference:` section (DPO/KTO) runs preference_batch -> preference_ref -> update
-> commit instead (preference.py), one with an `sft:` section sft_batch -> update -> commit (sft.py). Each stage is declared once (`@stage`: a `StageSpec`, listed in `STAGES`); tasks/ wraps each in a
Prefect task and flows/ passes those to the same graph.
"""

from gpu_jobs.stages.roles import Roles
from gpu_jobs.stages.graph import DirectCalls, StageCalls, run_iteration
from gpu_jobs.stages.iteration import (
    STAGES,
    advantages,
    baseline,
    commit,
    gate,
    logprobs,
    reward,
    rollout,
    update,
    validate,
    values,
    weights_to_rollout,
)
from gpu_jobs.stages.preference import held_out_preferences, preference_batch, preference_ref
from gpu_jobs.stages.sft import held_out_sft, sft_batch
from gpu_jobs.stages.resume import load_policy_into_rollout, open_warm, probe_agreement, replay_update, restore
from gpu_jobs.stages.run import Run, RunConfigMismatchError, last_committed
from gpu_jobs.stages.scoring import artifact_samples
from gpu_jobs.stages.shell import Output, StageSpec, read, stage

__all__ = ["Run", "Roles", "RunConfigMismatchError", "last_committed", "open_warm", "restore", "replay_update",
           "probe_agreement", "load_policy_into_rollout", "StageCalls", "DirectCalls", "run_iteration",
           "artifact_samples", "STAGES", "StageSpec", "stage", "Output", "read", "rollout", "baseline", "gate", "reward", "logprobs",
           "values", "advantages", "update", "weights_to_rollout", "commit", "validate", "preference_batch",
           "preference_ref", "held_out_preferences", "sft_batch", "held_out_sft"]

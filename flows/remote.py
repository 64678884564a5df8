"""Disaggregated placement: GPU stages as runs of their own deployments.

With `trainer.placement: remote`, the rl-iteration flow does not load any model. The trainer's
stages (declared `where="trainer"`: the update, and the old-log-prob pass when
actor.recompute_old_logprobs asks for it) start runs of `trainer.stage_deployment`
(`rl-stage/gpu`); rollout and validation (`where="rollout"`), which only generate, start runs of
`trainer.rollout_deployment` (e.g. `rl-stage/rollout` on a pool of its own; empty =
the stage deployment). Each runs on its work pool — Kubernetes jobs with GPU requests on a
cluster, a local `process` pool in tests — and everything crosses through storage: the stage reads
committed inputs and the weights checkpointed after the update it needs, and commits its manifest
(the update also commits checkpoint k, which later rollouts load).

With async_training.staleness_threshold = 1 the rollout of k+1 (weights of update k-1) runs on the
rollout pool while update k runs on the other: the overlap that makes async pay.

    prefect deployment run 'rl-stage/gpu' -p root=s3://bucket/rl -p run_id=r -p k=3 -p stage=rollout
"""

from __future__ import annotations

import uuid

from prefect import flow
from prefect.deployments import run_deployment

from gpu_jobs import stages
from gpu_jobs.stages import STAGES, Roles, Run, StageSpec
from storage import committed

REMOTE_POOLS = ("trainer", "rollout")  # the `where` of the stages placement=remote runs on a pool


def remote_stage(name: str) -> StageSpec:
    """The declared stage `name`, which must be one that runs on a pool."""
    spec = STAGES.get(name)
    if spec is None or spec.where not in REMOTE_POOLS:
        pooled = sorted(n for n, s in STAGES.items() if s.where in REMOTE_POOLS)
        raise ValueError(f"stage {name!r} does not run on a work pool; the stages that do: {', '.join(pooled)}")
    return spec


@flow(name="rl-stage", log_prints=True)
def rl_stage(root: str, run_id: str, k: int, stage: str, inputs: list[str] | None = None) -> str:
    """Run one pool stage of iteration k in this process, from storage only; returns its manifest URI."""
    spec = remote_stage(stage)
    run = Run.from_storage(root, run_id)
    if uri := committed(run.layout.stage(k, spec.name), run.storage):  # a retried run: nothing to load
        return uri
    if spec.where == "trainer":
        roles = Roles.load(run, rollout=False)
        stages.restore(run, roles)  # trainer state of checkpoint k-1 (checkpoint_every is 1 in remote placement)
        if spec is stages.logprobs and roles.version != k - 1:
            # the batch's old log-probs are those of the weights update k starts from
            raise RuntimeError(f"log-probs of iteration {k} need the trainer after update {k - 1}, but storage "
                               f"holds committed updates up to {roles.version}")
    else:
        roles = Roles.load(run, trainer=False)
        version = run.cfg.async_training.weights_version(k) if spec is stages.rollout else k
        stages.load_policy_into_rollout(run, roles, version)
    return spec(run, roles, k, *(inputs or []))


def _attempt_key(run: Run, k: int, stage: StageSpec) -> str:
    """One deployment run per attempt of the calling task or flow run: the API creates a flow run
    once per key, so a create the client sends again (an answer lost to a busy server: seen on
    SQLite under load, two `logprobs-0001` runs) returns the first run instead of starting a
    second. A new attempt (a task retry, the iteration run again, a resumed run) has a new key."""
    from prefect.context import FlowRunContext, TaskRunContext

    ctx = TaskRunContext.get() or FlowRunContext.get()
    owner = ctx.task_run if isinstance(ctx, TaskRunContext) else getattr(ctx, "flow_run", None)
    attempt = f"{owner.id}-{owner.run_count}" if owner is not None else uuid.uuid4().hex
    return f"rlmill-{run.run_uid}-{k}-{stage.name}-{attempt}"


def run_remote(run: Run, k: int, stage: StageSpec, inputs: list[str] = ()) -> str:
    """Start the deployment of (k, stage)'s pool (trainer.deployment_for) and wait; returns the
    manifest it committed.

    Idempotent like every stage: an already committed stage is returned without a remote run.
    """
    dest = run.layout.stage(k, stage.name)
    if uri := committed(dest, run.storage):
        return uri
    flow_run = run_deployment(
        name=run.cfg.trainer.deployment_for(stage.where),
        parameters={"root": run.cfg.root, "run_id": run.cfg.run_id, "k": k, "stage": stage.name,
                    "inputs": list(inputs)},
        flow_run_name=f"{stage.name}-{k:04d}",
        tags=["rlmill", f"run:{run.cfg.run_id}"],  # explicit: the iteration's tasks run untagged
        idempotency_key=_attempt_key(run, k, stage),
        timeout=None,
    )
    uri = committed(dest, run.storage)
    if uri is None:
        state = flow_run.state.name if flow_run.state else "unknown"
        raise RuntimeError(f"remote {stage.name} of iteration {k} ended {state} without committing {dest}; "
                           f"see flow run {flow_run.id} in the Prefect UI")
    return uri

"""Bringing warm roles to a run's committed state: start, resume after a crash, remote stages.

    run, roles = open_warm(cfg)     # Run.open + Roles.load + restore + agreement probe

`restore` loads the newest intact checkpoint (weights, optimizer, RNG, data cursor) and replays
the committed updates after it from their committed batches: updates are deterministic given
that state, so the weights equal those of a run that never stopped. A forked run
(gpu_jobs/stages/fork.py) starts the same way, from its copy of the parent's checkpoint. Then the
rollout engine gets those weights and the trainer/rollout agreement is checked once.
"""

from __future__ import annotations

import logging

from gpu_jobs.stages.roles import Roles
from gpu_jobs.stages.updates import train_on
from gpu_jobs.stages.run import Run, last_committed, sampling_seed
from gpu_jobs.stages.shell import read
from storage import committed, join

log = logging.getLogger("rlmill")

__all__ = ["open_warm", "restore", "recover_lost_trainer", "replay_update", "load_policy_into_rollout",
           "probe_agreement"]


def open_warm(cfg, *, probe: bool = True) -> tuple[Run, Roles]:
    """The run and its warm roles at the state after its last committed update."""
    run = Run.open(cfg)
    roles = Roles.load(run, rollout=not cfg.offline)  # a preference or SFT run never generates
    restore(run, roles)
    if probe and roles.rollout is not None:
        metrics = probe_agreement(run, roles, f"run start (weights after iteration {roles.version})")
        log.info("trainer/rollout agreement at start: mean |dp| %.2g, max |dlogp| %.2g nats",
                 metrics.get("training/rollout_probs_diff_mean", 0.0),
                 metrics.get("training/rollout_logprobs_diff_max", 0.0))
    return run, roles


def restore(run: Run, roles: Roles) -> int:
    """Bring the trainer to the state after the last committed update, then sync the rollout
    engine (if any); returns that iteration. A checkpoint damaged after it was published (a file
    missing or failing its checksum) is skipped for the next older one, down to the start model,
    with more updates replayed."""
    last = last_committed(run.layout, "update")
    ckpt = run.layout.latest_checkpoint()
    if ckpt is not None and ckpt > roles.version:
        _load_checkpoint(run, roles, ckpt)
    if roles.version < (base := run.layout.fork_base()):  # a fork has no updates before its fork point to replay
        raise RuntimeError(f"run {run.cfg.run_id} was forked at iteration {base}, but its checkpoint {base} (the copy "
                           f"of the parent's) is damaged or gone: `rlmill verify` names it; fork the parent again")
    for k in range(roles.version + 1, last + 1):
        log.info("replaying committed update of iteration %d", k)
        replay_update(run, roles, k)
    if roles.rollout is not None:
        roles.put_rollout_at(run, roles.version)
    return roles.version


def recover_lost_trainer(run: Run, roles: Roles) -> None:
    """A trainer rank group that died holding updates lost them with it: start a fresh group at
    the start model and restore it from storage (checkpoint + replay), as a fresh process would.
    A no-op for an in-process trainer and for a group that lost nothing."""
    trainer = roles.trainer
    if trainer is None or not trainer.state_lost:
        return  # only a rank group (GroupTrainer, which has reset()) ever loses its state
    log.warning("the trainer's rank group died holding updates 1..%d: restoring from storage", roles.version)
    trainer.reset()
    roles.version = 0
    roles.update_metrics.clear()
    restore(run, roles)


def replay_update(run: Run, roles: Roles, k: int) -> None:
    """Re-apply committed update k to restored roles (crash-resume between checkpoints), from the
    table it trained on: the advantages, a preference run's preference_ref, an SFT run's sft_batch."""
    stage = run.cfg.update_table_stage
    adv_uri = committed(run.layout.stage(k, stage), run.storage)
    if adv_uri is None:
        raise RuntimeError(f"update {k} committed but its {stage} table is missing: the run's storage is damaged")
    train_on(run, roles, k, read(run, adv_uri))


def _load_checkpoint(run: Run, roles: Roles, newest: int) -> None:
    """Load the newest intact checkpoint <= `newest` into the trainer (and critic)."""
    from storage import CorruptShardError

    # Each load checks every file before it touches a weight; only a damaged critic after a
    # good policy load leaves a half-loaded pair, which an older checkpoint overwrites.
    half_loaded = False
    for k in range(newest, roles.version, -1):
        if not committed(run.layout.trainer(k), run.storage):
            continue  # never checkpointed there, or the save did not finish
        critic = join(run.layout.checkpoint(k), "critic")
        log.info("resuming %s from checkpoint %d", run.cfg.run_id, k)
        try:
            roles.trainer.load(run.layout.trainer(k))
            half_loaded = roles.critic is not None
            if roles.critic is not None and committed(critic, run.storage):
                roles.critic.load(critic)
        except CorruptShardError as e:
            log.warning("checkpoint %d of %s is damaged (%s); trying an older one", k, run.cfg.run_id, e)
            continue
        roles.version = k
        return
    if half_loaded:  # back to the start model's weights before replaying from it
        roles.load_trainers(run)
    log.warning("no intact checkpoint of %s at or below %d: replaying committed updates from the start model",
                run.cfg.run_id, newest)


def load_policy_into_rollout(run: Run, roles: Roles, k: int) -> None:
    """Remote placement: the rollout engine takes the weights checkpointed after update k.
    (The update stage that consumes its samples checks them against its trainer.)"""
    roles.put_rollout_at(run, k)
    roles.version = k


def probe_agreement(run: Run, roles: Roles, where: str, n_prompts: int = 8) -> dict[str, float]:
    """Sample responses to a few held-out prompts with the rollout engine and re-score them with
    the trainer: at start and after a resume, when the engine's weights were just loaded or
    synced from a restored trainer. Raises AgreementError past the limit."""
    import pyarrow as pa

    from gpu_jobs.rollout.agent_loop import generate_with_rows
    from gpu_jobs.stages.agreement import check_agreement, rows_agreement

    cfg = run.cfg
    prompts, ids = run.prompts(run.val, list(range(min(n_prompts, len(run.val)))), None)
    rows = generate_with_rows(roles.rollout, prompts, ids, 2, cfg.rollout.sampling(sampling_seed(cfg.data.seed, 0)))
    table = pa.table({"prompt_ids": pa.array([r["prompt_ids"] for r in rows], pa.list_(pa.int32())),
                      "response_ids": pa.array([r["response_ids"] for r in rows], pa.list_(pa.int32()))})
    masks = [r.get("response_mask", [1] * len(r["response_ids"])) for r in rows]  # multi-turn: model tokens only
    metrics = rows_agreement([r["rollout_logprobs"] for r in rows], roles.trainer.compute_log_probs(table), masks)
    check_agreement(metrics, cfg.agreement.threshold(cfg.rollout, cfg.actor), where)
    return metrics

"""Applying an update to the warm roles: shared by the update stage and by replay on resume,
so both depend only on (k, the committed batch, the roles' state)."""

from __future__ import annotations

import time

import pyarrow as pa

from gpu_jobs.stages.roles import Roles
from gpu_jobs.stages.run import Run

__all__ = ["train_on"]


def train_on(run: Run, roles: Roles, k: int, table: pa.Table, probe=None) -> dict[str, float]:
    """Apply update k to the trainer (and critic): the RL loss on an advantages table, with a
    `preference:` section the DPO/KTO loss on a preference_ref table, with `sft:` the SFT loss on
    an sft_batch table. Also replays committed updates on resume, so
    everything here depends only on (k, table, the roles' state). `probe`: the agreement check
    the trainer runs on its first mini-batch (PolicyTrainer.update), before anything trains."""
    t0 = time.perf_counter()
    metrics: dict[str, float] = {}
    warming_critic = roles.critic is not None and k <= run.cfg.critic.critic_warmup
    if len(table) and not warming_critic and run.cfg.preference is not None:
        metrics.update(roles.trainer.preference_update(table, run.cfg.preference))  # DPO/KTO: ActorTrainer protocol
    elif len(table) and run.cfg.sft is not None:
        metrics.update(roles.trainer.sft_update(table))  # demonstrations: the token-mean NLL
    elif len(table) and not warming_critic:
        metrics.update(roles.trainer.update(table, probe=probe))
    t1 = time.perf_counter()
    if roles.critic is not None and len(table):
        metrics.update(roles.critic.update(table))
        metrics["critic/warmup"] = float(warming_critic)
    metrics["timing_s/update_actor"] = t1 - t0
    metrics["timing_s/update_critic"] = time.perf_counter() - t1
    roles.version = k
    return metrics

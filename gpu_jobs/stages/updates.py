"""Applying an update to the warm engines: shared by the update stage and by replay on resume,
so both depend only on (k, the committed batch, the engines' state)."""

from __future__ import annotations

import time

import pyarrow as pa

from gpu_jobs.stages.engines import Engines
from gpu_jobs.stages.run import Run

__all__ = ["train_on"]


def train_on(run: Run, engines: Engines, k: int, table: pa.Table, probe=None) -> dict[str, float]:
    """Apply update k to the trainer (and critic). Also replays committed updates on resume, so
    everything here depends only on (k, table, the engines' state). `probe`: the agreement check
    the trainer runs on its first mini-batch (PolicyTrainer.update), before anything trains."""
    t0 = time.perf_counter()
    metrics: dict[str, float] = {}
    warming_critic = engines.critic is not None and k <= run.cfg.critic.critic_warmup
    if len(table) and not warming_critic:
        metrics.update(engines.trainer.update(table, probe=probe))
    t1 = time.perf_counter()
    if engines.critic is not None and len(table):
        metrics.update(engines.critic.update(table))
        metrics["critic/warmup"] = float(warming_critic)
    metrics["timing_s/update_actor"] = t1 - t0
    metrics["timing_s/update_critic"] = time.perf_counter() - t1
    engines.version = k
    return metrics

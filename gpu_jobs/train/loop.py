"""The update loop the DeepSpeed trainers share (zero_module.ZeroModule, pipeline.PipelinePolicyTrainer):
the optimizer, the lr schedule, ppo_epochs passes of shuffled mini-batches with one optimizer
step each, and the sums and timers their metrics come from.

    lr = optimizer_steps(config, optimizer, step, rows, shuffle, lambda mini, first: ...)
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from .batch import Rows, plan_minibatches
from .ranks import dist

__all__ = ["MetricSums", "PhaseTimer", "adamw", "optimizer_steps"]


def adamw(config: Any, params: list[Any]) -> Any:
    """torch AdamW over ``params`` at the schedule's first lr. Not DeepSpeed's FusedAdam/CPUAdam:
    those JIT-compile C++ for minutes."""
    import torch

    return torch.optim.AdamW(params, lr=config.lr_at(0), betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay)


def optimizer_steps(config: Any, optimizer: Any, step: int, rows: Rows, shuffle: Any,
                    train_minibatch: Callable[[Any, bool], None]) -> float:
    """Update ``step``'s optimizer steps: the lr ``config.lr_at(step)`` on every param group, then
    ``ppo_epochs`` passes over the rows in mini-batches of ``ppo_mini_batch_size`` prompts
    (shuffled by the generator ``shuffle`` when ``config.shuffle``); ``train_minibatch(indices,
    first)`` takes one optimizer step on each (``first``: the update's first). Returns the lr."""
    lr = config.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    rows_per_mini = config.ppo_mini_batch_size * rows.samples_per_prompt
    first = True
    for _ in range(config.ppo_epochs):
        for mini in plan_minibatches(len(rows), rows_per_mini, shuffle if config.shuffle else None):
            train_minibatch(mini, first)
            first = False
    return lr


class MetricSums:
    """Share-weighted metric sums; ``mean()`` sums them over ranks and divides by the steps."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.steps = 0

    def add(self, metrics: dict[str, Any], share: float) -> None:
        for k, v in metrics.items():
            self.sums[k] += float(v) * share

    def mean(self) -> dict[str, float]:
        keys = sorted(self.sums)
        totals = dist.all_reduce_sum([self.sums[k] for k in keys]) if keys else []
        return {k: t / max(1, self.steps) for k, t in zip(keys, totals)}


class PhaseTimer:
    """Wall time per named phase: ``with timer("forward"): ...``; ``timer.seconds`` sums them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

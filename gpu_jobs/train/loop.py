"""The update loop every DeepSpeed trainer update shares (zero_module.ZeroModule's policy, critic and
preference updates, pipeline.PipelinePolicyTrainer): the optimizer, the lr schedule, ppo_epochs
passes of (shuffled) mini-batches with one optimizer step each, and the sums and timers their
metrics come from.

    lr = optimizer_steps(config, optimizer, step, rows, shuffle, lambda mini, first: ...)  # RL: row mini-batches
    lr = update_steps(config, optimizer, step, plan, lambda mini, first: ...)  # any plan (preference: units)
    optimizer_step(engine, [(micro, share), ...], forward, scale, sums, timer)  # what each mini-batch does
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from .batch import Rows, plan_minibatches
from .ranks import dist

__all__ = ["MetricSums", "PhaseTimer", "adamw", "optimizer_steps", "update_steps", "optimizer_step",
           "pre_clip_grad_norm"]

Forward = Callable[[Any], tuple[Any, dict[str, Any]]]
"""``forward(micro) -> (scalar loss, metrics)`` of one micro-batch (its row indices, or whatever
the mini-batch plan hands out)."""


class Sums(Protocol):
    """Where an update's metrics accumulate: MetricSums, preference.NanWeightedMeans."""

    def add(self, metrics: dict[str, Any], weight: float) -> None: ...


def adamw(config: Any, params: list[Any]) -> Any:
    """torch AdamW over ``params`` at the schedule's first lr. Not DeepSpeed's FusedAdam/CPUAdam:
    those JIT-compile C++ for minutes. torch's fused kernel where it has one (CPU, CUDA): one pass
    over each tensor instead of a dozen element-wise ops, 0.07 s against 0.32 s per step for
    SmolLM2-135M on 2 cores; the same update to float rounding."""
    import torch

    fused = bool(params) and all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=config.lr_at(0), betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay, fused=fused or None)


def update_steps(config: Any, optimizer: Any, step: int, plan: Callable[[], Iterable[Any]],
                 train_minibatch: Callable[[Any, bool], None]) -> float:
    """Update ``step``'s optimizer steps: the lr ``config.lr_at(step)`` on every param group, then
    ``ppo_epochs`` passes, each over the mini-batches ``plan()`` lays out for it (called once per
    pass, so a shuffling plan draws a new order each time); ``train_minibatch(mini, first)`` takes
    one optimizer step on each (``first``: the update's first). Returns the lr.

    The lr is set here, once per update, so every update kind follows the same schedule by the
    same update count (``step``)."""
    lr = config.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    first = True
    for _ in range(config.ppo_epochs):
        for mini in plan():
            train_minibatch(mini, first)
            first = False
    return lr


def optimizer_steps(config: Any, optimizer: Any, step: int, rows: Rows, shuffle: Any,
                    train_minibatch: Callable[[Any, bool], None]) -> float:
    """``update_steps`` of an RL update: ``train_minibatch(indices, first)`` on the row indices of
    mini-batches of ``ppo_mini_batch_size`` prompts (all their samples), shuffled by the generator
    ``shuffle`` when ``config.shuffle``. Returns the lr."""
    rows_per_mini = config.ppo_mini_batch_size * rows.samples_per_prompt
    return update_steps(config, optimizer, step,
                        lambda: plan_minibatches(len(rows), rows_per_mini, shuffle if config.shuffle else None),
                        train_minibatch)


def optimizer_step(engine: Any, micros: Sequence[tuple[Any, float]], forward: Forward, scale: float, sums: Sums,
                   timer: "PhaseTimer", before_step: Callable[[], None] | None = None) -> None:
    """One optimizer step on a mini-batch given as micro-batches ``(micro, share)``: each one's
    ``forward(micro)`` loss times ``share * scale`` goes backward, the gradients accumulating up
    to the last micro-batch (the accumulation boundary); then ``before_step()``; then
    ``engine.step()``, in which DeepSpeed clips to ``gradient_clipping``, steps the optimizer and
    zeroes the gradients. ``sums`` gets each micro-batch's metrics weighted by its share and the
    pre-clip gradient norm as ``grad_norm`` weighted ``1 / scale``.

    ``share``: the micro-batch's part of the mini-batch's loss (they add up to 1 over all ranks),
    so the step equals one on the whole mini-batch whatever the micro-batching; ``scale``: the
    data-parallel world size, which undoes DeepSpeed's mean of the gradients over ranks. If
    ``before_step`` raises, the accumulated gradients are dropped (ZeRO-0 keeps them in
    ``param.grad``) and nothing trains."""
    for k, (micro, share) in enumerate(micros):
        engine.set_gradient_accumulation_boundary(k == len(micros) - 1)
        with timer("forward"):
            loss, metrics = forward(micro)
        with timer("backward"):
            engine.backward(loss * (share * scale), scale_wrt_gas=False)
        sums.add(metrics, share)
    if before_step is not None:
        try:
            before_step()
        except BaseException:
            engine.zero_grad()
            raise
    with timer("optimizer"):
        norm = pre_clip_grad_norm(engine)
        engine.step()
    if norm is None:
        norm = float(engine.get_global_grad_norm() or 0.0)
    sums.add({"grad_norm": norm}, 1 / scale)


def pre_clip_grad_norm(engine: Any) -> float | None:
    """The pre-clip global gradient norm where DeepSpeed records none (ZeRO-0 in fp32: a plain
    torch optimizer; its gradients are already averaged over ranks here), else None: read
    ``engine.get_global_grad_norm()`` after the step."""
    if hasattr(engine.optimizer, "_global_grad_norm"):
        return None
    import torch

    norms = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


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

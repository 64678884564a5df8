"""The preference update (DPO / KTO) on a PolicyTrainer's engine, and the objectives' batch layout.

    metrics = trainer.preference_update(table, PreferenceConfig(algorithm="dpo", beta=0.1))

``table`` is a committed preference batch (gpu_jobs/stages/preference_data.py lays it out): one
row per scored sequence with ``prompt_ids``, ``response_ids``, ``ref_logprobs`` (the reference
model's per-token log-probs), ``role`` and ``unit``. A *unit* is what is never split: a DPO pair
(its ``chosen`` and ``rejected`` rows), or a KTO group (its ``desirable``/``undesirable``
examples and one ``kl`` row per example: the mismatched (prompt, completion) pairs KTO's
reference point is estimated from, TRL's rotation within the group). Mini-batches are shuffled
units adding up to ``ppo_mini_batch_size`` pairs/examples, one optimizer step each; a DPO
micro-batch holds ``ppo_micro_batch_size_per_gpu`` whole pairs, a KTO micro-batch one group.
Each micro-batch's loss is scaled by its share of the mini-batch's pairs/examples, so the step
equals one on the whole mini-batch whatever the micro-batching.

One rank only (the run config refuses more for preference runs): KTO's reference point would
need an all-reduce across ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_jobs.registry import Registry

from .memory import trim_heap

__all__ = ["PREFERENCE_OBJECTIVES", "Objective", "units_of", "preference_update", "sequence_sums",
           "NanWeightedMeans"]


@dataclass(frozen=True)
class Objective:
    """How one preference algorithm reads a micro-batch.

    ``roles``: the row roles of a unit, in the order a unit lists them; ``counted``: the roles
    that are one pair/example each (the loss is a mean over them); ``units_per_micro(m)``: units
    in a micro-batch for ppo_micro_batch_size_per_gpu ``m``; ``loss(seq, ref, length, roles,
    kwargs)``: per-row summed policy and reference log-probs and response lengths ``(b,)`` and
    the rows' roles ``(b,)`` -> (scalar loss, metrics)."""

    roles: tuple[str, ...]
    counted: tuple[str, ...]
    units_per_micro: Callable[[int], int]
    loss: Callable[..., tuple[Any, dict[str, Any]]]


PREFERENCE_OBJECTIVES: Registry = Registry("preference algorithm")


def _dpo(seq, ref, length, roles: np.ndarray, kwargs: dict[str, Any]):
    import torch

    from gpu_jobs.algos.preference import dpo_loss

    c, r = (torch.from_numpy(roles == name).to(seq.device) for name in ("chosen", "rejected"))
    return dpo_loss(seq[c], seq[r], ref[c], ref[r], chosen_lengths=length[c], rejected_lengths=length[r], **kwargs)


def _kto(seq, ref, length, roles: np.ndarray, kwargs: dict[str, Any]):
    import torch

    from gpu_jobs.algos.preference import kto_loss

    ex = torch.from_numpy(np.isin(roles, ("desirable", "undesirable"))).to(seq.device)
    kl = torch.from_numpy(roles == "kl").to(seq.device)
    desirable = torch.from_numpy(roles == "desirable").to(seq.device)[ex]
    loss, metrics = kto_loss(seq[ex], ref[ex], desirable, seq[kl], ref[kl], **kwargs)
    # TRL's KTO logs no accuracy; the held-out score needs one: the share of examples on their
    # label's side of the reference point (what each example's loss term pushes toward).
    logratios = (seq[ex] - ref[ex]).detach()
    right = torch.where(desirable, logratios > metrics["kl"], logratios < metrics["kl"])
    return loss, {**metrics, "rewards/accuracies": right.to(logratios.dtype).mean()}


PREFERENCE_OBJECTIVES.register("dpo")(Objective(("chosen", "rejected"), ("chosen",), lambda m: m, _dpo))
PREFERENCE_OBJECTIVES.register("kto")(Objective(("desirable", "undesirable", "kl"), ("desirable", "undesirable"),
                                                lambda m: 1, _kto))


def units_of(unit_ids: Sequence[int]) -> list[list[int]]:
    """Row indices of each unit, units in order of first appearance, rows in table order.

    >>> units_of([0, 0, 1, 1, 2, 2])
    [[0, 1], [2, 3], [4, 5]]
    """
    out: dict[int, list[int]] = {}
    for i, u in enumerate(unit_ids):
        out.setdefault(int(u), []).append(i)
    return list(out.values())


def sequence_sums(log_prob: Any, mask: Any) -> tuple[Any, Any]:
    """Summed response log-probs and response lengths ``(b,)`` from per-token ``(b, R)`` values."""
    return (log_prob * mask).sum(-1), mask.sum(-1)


class NanWeightedMeans:
    """Weighted means of scalar metrics that skip NaN entries (KTO reports NaN for a side a
    micro-batch has no example of; a NaN must not poison the update's mean)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, Any], weight: float) -> None:
        for k, v in metrics.items():
            v = float(v)
            if not math.isnan(v):
                self.sums[k] = self.sums.get(k, 0.0) + v * weight
                self.weights[k] = self.weights.get(k, 0.0) + weight

    def mean(self) -> dict[str, float]:
        return {k: s / self.weights[k] for k, s in self.sums.items() if self.weights[k] > 0}


def _minibatches(units: list[list[int]], counts: list[int], per_step: int) -> list[list[int]]:
    """Unit indices of each mini-batch: consecutive units until they hold ``per_step`` pairs/examples."""
    out, cur, n = [], [], 0
    for u, c in zip(units, counts):
        cur.append(u)
        n += c
        if n >= per_step:
            out.append(cur)
            cur, n = [], 0
    return out + ([cur] if cur else [])


def preference_update(trainer: Any, batch: Any, preference: Any) -> dict[str, float]:
    """One preference update of ``trainer`` (a one-rank PolicyTrainer) on ``batch`` (module doc);
    ``preference``: a gpu_jobs.algos.preference.PreferenceConfig. Returns TRL-named metrics
    (rewards/*, logps/*, kl for KTO) averaged over the update, with actor/preference_loss,
    actor/grad_norm and actor/lr."""
    import torch

    t0 = time.perf_counter()
    c = trainer.config
    objective: Objective = PREFERENCE_OBJECTIVES[preference.algorithm]
    rows = trainer._read(batch, ("ref_logprobs",))
    roles = np.asarray(batch.column("role").to_pylist(), dtype=object)
    units = units_of(batch.column("unit").to_pylist())
    counts = [int(np.isin(roles[u], objective.counted).sum()) for u in units]
    lr = c.lr_at(trainer.step)
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr
    means = NanWeightedMeans()
    trainer.engine.train()
    for _ in range(c.ppo_epochs):
        order = torch.randperm(len(units), generator=trainer._shuffle).tolist() if c.shuffle else range(len(units))
        for mini in _minibatches([units[i] for i in order], [counts[i] for i in order], c.ppo_mini_batch_size):
            _step(trainer, rows, roles, mini, objective, preference.loss_kwargs(), means)
    trim_heap()
    trainer.step += 1
    trainer.samples_seen += len(rows)
    out = means.mean()
    out.update({"actor/lr": lr, "timing_s/update_actor": time.perf_counter() - t0})
    return out


def _step(trainer: Any, rows: Any, roles: np.ndarray, mini: list[list[int]], objective: Objective,
          kwargs: dict[str, Any], means: NanWeightedMeans) -> None:
    """Accumulate the mini-batch's micro-batches (whole units each), then one optimizer step."""
    engine = trainer.engine
    per_micro = objective.units_per_micro(trainer.config.ppo_micro_batch_size_per_gpu)
    micros = [mini[s : s + per_micro] for s in range(0, len(mini), per_micro)]
    total = sum(int(np.isin(roles[u], objective.counted).sum()) for u in mini)
    for j, micro in enumerate(micros):
        idx = [i for unit in micro for i in unit]
        mb = trainer._collate(rows, idx, idx[0])
        log_prob, _ = trainer._response_terms(mb, with_entropy=False)
        seq, length = sequence_sums(log_prob, mb["response_mask"])
        ref, _ = sequence_sums(mb["ref_logprobs"], mb["response_mask"])
        loss, metrics = objective.loss(seq, ref, length, roles[idx], kwargs)
        share = int(np.isin(roles[idx], objective.counted).sum()) / total
        engine.set_gradient_accumulation_boundary(j == len(micros) - 1)
        engine.backward(loss * share, scale_wrt_gas=False)
        means.add({**metrics, "actor/preference_loss": loss.detach()}, share)
    norm = trainer._grad_norm_untracked_by_deepspeed()
    engine.step()
    if norm is None:
        norm = float(engine.get_global_grad_norm() or 0.0)
    means.add({"actor/grad_norm": norm}, 1.0)

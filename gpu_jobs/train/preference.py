"""The preference objectives (DPO / KTO) and how a preference batch is laid out for an update;
PolicyTrainer.preference_update takes the steps, with the optimizer-step loop of every update
(loop.update_steps / loop.optimizer_step).

    metrics = trainer.preference_update(table, PreferenceConfig(algorithm="dpo", beta=0.1))
    batch = PreferenceBatch.of(table, preference)      # roles, units and their pair/example counts
    for mini in batch.minibatches(config.ppo_mini_batch_size, generator):    # shuffled units
        micros = batch.micro_batches(mini, config.ppo_micro_batch_size_per_gpu)  # [(rows, share)]

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

One rank only (the run config refuses more for preference runs, PolicyTrainer.preference_update
refuses it too): KTO's reference point would need an all-reduce across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_jobs.registry import Registry

__all__ = ["PREFERENCE_OBJECTIVES", "Objective", "PreferenceBatch", "units_of", "sequence_sums",
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


def _minibatches(units: list[list[int]], counts: list[int], per_step: int) -> list[list[list[int]]]:
    """The units of each mini-batch: consecutive units until they hold ``per_step`` pairs/examples."""
    out, cur, n = [], [], 0
    for u, c in zip(units, counts):
        cur.append(u)
        n += c
        if n >= per_step:
            out.append(cur)
            cur, n = [], 0
    return out + ([cur] if cur else [])


@dataclass(frozen=True)
class PreferenceBatch:
    """A committed preference batch (module doc) as the update reads it: ``roles`` ``(rows,)``,
    ``units`` (row indices of each, as units_of), ``counts`` (pairs/examples in each unit), the
    algorithm's ``objective`` and its loss ``kwargs`` (PreferenceConfig.loss_kwargs())."""

    objective: Objective
    roles: np.ndarray
    units: list[list[int]]
    counts: list[int]
    kwargs: dict[str, Any]

    @classmethod
    def of(cls, table: Any, preference: Any) -> "PreferenceBatch":
        """``table``: pyarrow with ``role`` and ``unit``; ``preference``: a PreferenceConfig."""
        objective: Objective = PREFERENCE_OBJECTIVES[preference.algorithm]
        roles = np.asarray(table.column("role").to_pylist(), dtype=object)
        units = units_of(table.column("unit").to_pylist())
        counts = [int(np.isin(roles[u], objective.counted).sum()) for u in units]
        return cls(objective, roles, units, counts, preference.loss_kwargs())

    def minibatches(self, per_step: int, generator: Any | None) -> list[list[list[int]]]:
        """One pass's mini-batches (the units of each) of ``per_step`` pairs/examples, the units
        in an order drawn from the torch ``generator`` (None: table order)."""
        import torch

        order = torch.randperm(len(self.units), generator=generator).tolist() if generator is not None \
            else range(len(self.units))
        return _minibatches([self.units[i] for i in order], [self.counts[i] for i in order], per_step)

    def micro_batches(self, mini: list[list[int]], micro_size: int) -> list[tuple[list[int], float]]:
        """``(rows, share)`` of each micro-batch of a mini-batch: ``objective.units_per_micro
        (micro_size)`` whole units each, its share the part of the mini-batch's pairs/examples it
        holds (so the step equals one on the whole mini-batch)."""
        per_micro = self.objective.units_per_micro(micro_size)
        total = sum(self._counted(u) for u in mini)
        micros = [[i for unit in mini[s : s + per_micro] for i in unit] for s in range(0, len(mini), per_micro)]
        return [(rows, self._counted(rows) / total) for rows in micros]

    def loss(self, log_prob: Any, mb: dict[str, Any], rows: list[int]) -> tuple[Any, dict[str, Any]]:
        """The objective's (scalar loss, metrics) on a collated micro-batch of ``rows``, from the
        policy's per-token ``log_prob`` ``(b, R)`` and ``mb``'s ref_logprobs and response_mask;
        the metrics add ``actor/preference_loss``."""
        seq, length = sequence_sums(log_prob, mb["response_mask"])
        ref, _ = sequence_sums(mb["ref_logprobs"], mb["response_mask"])
        loss, metrics = self.objective.loss(seq, ref, length, self.roles[rows], self.kwargs)
        return loss, {**metrics, "actor/preference_loss": loss.detach()}

    def _counted(self, rows: list[int]) -> int:
        return int(np.isin(self.roles[rows], self.objective.counted).sum())

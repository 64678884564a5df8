"""Offline preference losses: DPO and its variants on pairs, KTO on single labelled answers.

    seq = sequence_logprobs(policy(input_ids).logits, input_ids, response_mask)   # sum, mean, length
    loss, metrics = dpo_loss(pol_c.sum, pol_r.sum, ref_c.sum, ref_r.sum,
                             chosen_lengths=pol_c.length, rejected_lengths=pol_r.length, **cfg.loss_kwargs())

Shapes: ``B`` pairs (DPO) or examples (KTO), ``L`` token positions (prompt + response),
``V`` vocabulary entries. Every input is a summed sequence log-prob ``(B,)``; the reference's
inputs are detached here, so the gradient reaches only the policy. Metrics use TRL's names
(``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen``, ``logps/rejected``; KTO adds ``kl``) as detached scalars, no device sync.

DPO's variants are chosen by ``loss_type`` through ``PREFERENCE_LOSSES``; each entry maps the
per-pair log-ratios ``log pi(y|x) - log pi_ref(y|x)`` to a per-pair loss ``(B,)``.
Run the tests with ``.venv/bin/python -m pytest -q tests/algos/test_preference.py``.
"""

from __future__ import annotations

import inspect
from enum import Enum
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpu_jobs.registry import Registry

from .functional import logprobs_from_logits, masked_sum

__all__ = [
    "DPOLossType",
    "PREFERENCE_LOSSES",
    "PREFERENCE_ALGORITHMS",
    "register_preference_loss",
    "SequenceLogprobs",
    "sequence_logprobs",
    "dpo_loss",
    "kto_loss",
    "kto_kl_indices",
    "PreferenceConfig",
]


class SequenceLogprobs(NamedTuple):
    """Per-sequence response log-probs, each ``(B,)``: ``sum`` (DPO, KTO), ``mean`` = sum /
    length (IPO's per-token scale) and ``length`` = response token count (float)."""

    sum: torch.Tensor
    mean: torch.Tensor
    length: torch.Tensor


def sequence_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor, chunk_size: int = 1024
) -> SequenceLogprobs:
    """Summed and mean log-probs of the response tokens of each sequence.

    ``logits``: ``(B, L, V)``, the model's output over ``input_ids`` ``(B, L)`` (prompt and
    response, any padding); ``response_mask``: ``(B, L)``, set on the response tokens *of
    input_ids*. Token ``t`` is scored by the logits at ``t - 1``, so position 0 (no prefix)
    never counts, even if set. Returns ``SequenceLogprobs`` of ``(B,)`` tensors.

    The labels are rolled left instead of slicing ``logits[:, :-1]``: a slice would make
    ``logprobs_from_logits`` copy the whole ``(B, L-1, V)`` tensor. The last position's
    (wrapped) label is computed and then masked out, which costs one row of work.
    """
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape or input_ids.shape != response_mask.shape:
        raise ValueError(
            f"sequence_logprobs needs logits (B, L, V) with input_ids and response_mask (B, L); got "
            f"{tuple(logits.shape)}, {tuple(input_ids.shape)}, {tuple(response_mask.shape)}"
        )
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    scored = torch.zeros_like(response_mask, dtype=torch.bool)
    scored[:, :-1] = response_mask[:, 1:].bool()
    token = logprobs_from_logits(logits, labels, chunk_size)
    total = masked_sum(token, scored, dim=-1)
    length = scored.to(torch.promote_types(logits.dtype, torch.float32)).sum(dim=-1)
    return SequenceLogprobs(total, total / length.clamp(min=1), length)


# ---------------------------------------------------------------------------------------------
# DPO (Rafailov et al., arXiv:2305.18290) and its variants, chosen by loss_type (TRL's names).


class DPOLossType(str, Enum):
    SIGMOID = "sigmoid"
    ROBUST = "robust"
    IPO = "ipo"
    HINGE = "hinge"


PREFERENCE_LOSSES: Registry = Registry("preference loss_type")
register_preference_loss = PREFERENCE_LOSSES.register

# Loss types whose formula reads label_smoothing; the config refuses it elsewhere.
SMOOTHED_LOSS_TYPES = frozenset({DPOLossType.SIGMOID.value, DPOLossType.ROBUST.value})


@register_preference_loss(DPOLossType.SIGMOID)
def _sigmoid(chosen_logratios, rejected_logratios, chosen_lengths, rejected_lengths, *, beta, label_smoothing):
    """DPO: ``-log sigmoid(beta * h)`` with ``h = chosen_logratio - rejected_logratio``; with
    ``label_smoothing = eps`` the conservative cDPO mix (Mitchell 2023)
    ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``, as TRL's ``sigmoid`` computed
    it until its DPO refactor (huggingface/trl#3906; its ``sigmoid`` now ignores label_smoothing)."""
    h = beta * (chosen_logratios - rejected_logratios)
    return -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)


@register_preference_loss(DPOLossType.ROBUST)
def _robust(chosen_logratios, rejected_logratios, chosen_lengths, rejected_lengths, *, beta, label_smoothing):
    """Robust DPO (Chowdhury et al., arXiv:2403.00409): the unbiased loss under labels flipped
    with probability ``eps``: ``((1 - eps) l(h) - eps l(-h)) / (1 - 2 eps)``, ``l = -log sigmoid``."""
    h = beta * (chosen_logratios - rejected_logratios)
    return (-(1 - label_smoothing) * F.logsigmoid(h) + label_smoothing * F.logsigmoid(-h)) / (1 - 2 * label_smoothing)


@register_preference_loss(DPOLossType.IPO)
def _ipo(chosen_logratios, rejected_logratios, chosen_lengths, rejected_lengths, *, beta, label_smoothing):
    """IPO (Azar et al., arXiv:2310.12036, eq. 17): ``(h - 1 / (2 beta))^2`` with ``h`` the
    difference of the *per-token* log-ratios (each log-ratio divided by its response length),
    as TRL computes it with the IPO authors' agreement; ``beta`` is the paper's ``tau``."""
    if chosen_lengths is None or rejected_lengths is None:
        raise ValueError(
            "loss_type='ipo' compares per-token log-ratios: pass chosen_lengths and rejected_lengths "
            "(the response token counts, sequence_logprobs(...).length)"
        )
    h = chosen_logratios / chosen_lengths.clamp(min=1) - rejected_logratios / rejected_lengths.clamp(min=1)
    return (h - 1 / (2 * beta)) ** 2


@register_preference_loss(DPOLossType.HINGE)
def _hinge(chosen_logratios, rejected_logratios, chosen_lengths, rejected_lengths, *, beta, label_smoothing):
    """SLiC hinge (Zhao et al., arXiv:2305.10425): ``relu(1 - beta * h)``."""
    return torch.relu(1 - beta * (chosen_logratios - rejected_logratios))


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0 (it scales the implicit reward), got {beta}; TRL's default is 0.1")


def _check_label_smoothing(label_smoothing: float) -> None:
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) (a probability that a label is flipped), got "
                         f"{label_smoothing}; the Robust DPO paper uses 0.1")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    beta: float = 0.1,
    loss_type: str | DPOLossType = DPOLossType.SIGMOID,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO loss (Rafailov et al., arXiv:2305.18290) averaged over ``B`` pairs.

    All four log-prob inputs are summed response log-probs ``(B,)``; the two ``ref_*`` are
    detached. ``chosen_lengths``/``rejected_lengths`` ``(B,)`` are the response token counts
    (only ``ipo`` reads them, and needs them). The implicit rewards are
    ``beta * (log pi - log pi_ref)``; ``rewards/accuracies`` is the share of pairs whose chosen
    reward is strictly higher. Returns ``(loss, metrics)``.
    """
    _check_beta(beta)
    _check_label_smoothing(label_smoothing)
    chosen_logratios = policy_chosen_logps - ref_chosen_logps.detach()
    rejected_logratios = policy_rejected_logps - ref_rejected_logps.detach()
    losses = PREFERENCE_LOSSES[loss_type](
        chosen_logratios, rejected_logratios, chosen_lengths, rejected_lengths,
        beta=beta, label_smoothing=label_smoothing,
    )
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": policy_chosen_logps.detach().mean(),
        "logps/rejected": policy_rejected_logps.detach().mean(),
    }
    return losses.mean(), metrics


# ---------------------------------------------------------------------------------------------
# KTO (Ethayarajh et al., arXiv:2402.01306) with TRL's KTOTrainer semantics.


def kto_kl_indices(batch_size: int) -> torch.Tensor:
    """Which completion each example is mismatched with for KTO's KL estimate: ``(B,)`` int64
    ``[B-1, 0, 1, ..., B-2]``, TRL's rotation by one, (x_i, y_{i-1}), so the mismatched
    completions are the batch's own completions paired with other prompts. Needs ``B > 1``:
    with one example the "mismatched" pair is the matched one and the KL equals the reward."""
    if batch_size < 2:
        raise ValueError(
            f"KTO's KL estimate needs at least 2 examples per batch (got {batch_size}): a batch of one "
            "pairs its prompt with its own completion; raise the batch size"
        )
    return torch.roll(torch.arange(batch_size), shifts=1)


def _mean_or_nan(x: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    # NaN, not 0, when nothing is picked: TRL logs nothing for a side absent from the batch,
    # and a 0 would read as a real reward. Aggregate these with nanmean.
    n = picked.to(x.dtype).sum()
    total = torch.where(picked, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    return torch.where(n > 0, total / n.clamp(min=1), torch.full((), float("nan"), dtype=x.dtype, device=x.device))


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    policy_kl_logps: torch.Tensor,
    ref_kl_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO loss (Ethayarajh et al., arXiv:2402.01306, eq. 7) averaged over ``B`` examples.

    ``policy_logps``, ``ref_logps``: summed response log-probs ``(B,)`` of each example's own
    completion; ``desirable``: ``(B,)`` bool label; ``policy_kl_logps``, ``ref_kl_logps``:
    ``(B',)`` summed log-probs of mismatched (prompt, completion) pairs (see ``kto_kl_indices``).

    The reference point ``z0 = clamp(mean(policy_kl_logps - ref_kl_logps), min=0)``, detached
    (TRL averages it over all ranks first; a caller with several ranks all-reduces the
    mismatched log-probs' mean before calling). With ``r = log pi - log pi_ref``:
    desirable ``w_D (1 - sigmoid(beta (r - z0)))``, undesirable ``w_U (1 - sigmoid(beta (z0 - r)))``;
    the loss is the plain mean over all ``B`` (the weights are not renormalised, as in TRL).
    Metrics are NaN for a side that has no example in the batch; ``kl`` is ``z0``.
    """
    _check_beta(beta)
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(
            f"desirable_weight and undesirable_weight must be >= 0, got {desirable_weight} and {undesirable_weight}"
        )
    desirable = desirable.bool()
    kl = (policy_kl_logps.detach() - ref_kl_logps.detach()).mean().clamp(min=0)
    logratios = policy_logps - ref_logps.detach()
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios))),
    )
    rewards = beta * logratios.detach()
    chosen, rejected = _mean_or_nan(rewards, desirable), _mean_or_nan(rewards, ~desirable)
    metrics = {
        "kl": kl,
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected,
        "logps/chosen": _mean_or_nan(policy_logps.detach(), desirable),
        "logps/rejected": _mean_or_nan(policy_logps.detach(), ~desirable),
    }
    return losses.mean(), metrics


# ---------------------------------------------------------------------------------------------
# Configuration: TRL's key names; the math above never reads it.

PREFERENCE_ALGORITHMS: Registry = Registry("preference algorithm")
PREFERENCE_ALGORITHMS.register("dpo")(dpo_loss)
PREFERENCE_ALGORITHMS.register("kto")(kto_loss)

# The keys only one algorithm reads: setting one under the other is refused.
_ALGORITHM_KEYS = {"dpo": ("loss_type", "label_smoothing"), "kto": ("desirable_weight", "undesirable_weight")}


class PreferenceConfig(BaseModel):
    """Offline preference training: DPO on pairs or KTO on thumbs.

    >>> PreferenceConfig(algorithm="dpo", beta=0.2, loss_type="ipo").loss_kwargs()
    {'beta': 0.2, 'loss_type': 'ipo', 'label_smoothing': 0.0}
    >>> PreferenceConfig(algorithm="kto", undesirable_weight=1.33).loss_kwargs()
    {'beta': 0.1, 'desirable_weight': 1.0, 'undesirable_weight': 1.33}
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    algorithm: Literal["dpo", "kto"] = Field(
        "dpo", description="'dpo' trains on preference pairs (dpo_loss); 'kto' on answers labelled "
        "desirable/undesirable, e.g. by thumbs (kto_loss).")
    beta: float = Field(
        0.1, description="Strength of the pull toward the reference model: the implicit reward is "
        "beta * (log pi - log pi_ref); for ipo it is the paper's tau. Must be > 0.")
    loss_type: str = Field(
        DPOLossType.SIGMOID.value, description="DPO only: sigmoid (the paper's), robust (label-noise "
        "corrected), ipo (squared, per-token log-ratios), hinge (SLiC).")
    label_smoothing: float = Field(
        0.0, description="DPO sigmoid/robust only: the assumed probability that a preference label is "
        "flipped, in [0, 0.5); sigmoid becomes cDPO, robust its unbiased correction.")
    desirable_weight: float = Field(
        1.0, description="KTO only: weight of desirable examples' losses (>= 0); the KTO paper advises "
        "desirable_weight * n_desirable / (undesirable_weight * n_undesirable) in [1, 4/3].")
    undesirable_weight: float = Field(1.0, description="KTO only: weight of undesirable examples' losses (>= 0).")

    @field_validator("beta")
    @classmethod
    def _positive_beta(cls, value: float) -> float:
        _check_beta(value)
        return value

    @field_validator("loss_type")
    @classmethod
    def _known_loss_type(cls, value: str) -> str:
        PREFERENCE_LOSSES[value]  # raises, listing the valid names
        return value

    @field_validator("label_smoothing")
    @classmethod
    def _smoothing_range(cls, value: float) -> float:
        _check_label_smoothing(value)
        return value

    @field_validator("desirable_weight", "undesirable_weight")
    @classmethod
    def _nonnegative_weight(cls, value: float, info) -> float:
        if value < 0:
            raise ValueError(f"{info.field_name} must be >= 0, got {value}; 1.0 weighs every example the same")
        return value

    @model_validator(mode="after")
    def _keys_of_the_algorithm(self) -> PreferenceConfig:
        for other, keys in _ALGORITHM_KEYS.items():
            unused = sorted(set(keys) & self.model_fields_set) if other != self.algorithm else []
            if unused:
                verb = "applies" if len(unused) == 1 else "apply"
                raise ValueError(f"{', '.join(unused)} {verb} only to algorithm={other!r} and does nothing with "
                                 f"algorithm={self.algorithm!r}; remove it or set algorithm={other!r}")
        if self.algorithm == "dpo" and self.label_smoothing and self.loss_type not in SMOOTHED_LOSS_TYPES:
            raise ValueError(f"label_smoothing does nothing with loss_type={self.loss_type!r}; use it with "
                             f"{' or '.join(sorted(SMOOTHED_LOSS_TYPES))}, or set it to 0")
        if self.algorithm == "kto" and self.desirable_weight == 0 and self.undesirable_weight == 0:
            raise ValueError("desirable_weight and undesirable_weight are both 0, so the KTO loss is 0; "
                             "set at least one above 0")
        return self

    def loss_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``dpo_loss`` (algorithm='dpo') or ``kto_loss`` (algorithm='kto')."""
        params = inspect.signature(PREFERENCE_ALGORITHMS[self.algorithm]).parameters
        return {k: getattr(self, k) for k in type(self).model_fields if k in params}

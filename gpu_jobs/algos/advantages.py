"""Advantage estimators: per-token rewards -> (advantages, returns), chosen by name.

Shapes: ``token_level_rewards``, ``response_mask``, ``values``: ``(bs, T)``; ``index``: ``(bs,)``
group ids (one per response; responses to the same prompt share an id — any hashable
str/int, a numpy array or an integer tensor). Groups are found by id, never by position.
Every estimator returns ``(advantages, returns)``, both ``(bs, T)`` and zero wherever
``response_mask`` is 0, computed under ``torch.no_grad()``.

Outcome estimators use the sequence score ``s_i = sum_t token_level_rewards[i, t]`` (over
masked positions only). Like verl, a group of one response has baseline 0 (and std 1).

An estimator declares what it needs where it registers (``EstimatorTraits``): groups of responses
to one prompt (``rollout.n >= 2``), a critic's values, or greedy reward baselines; its keyword
arguments are read from its signature. The run config asks the registry, so a new estimator is one
module: its function under ``@register_adv_est(name, needs_groups=...)``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import torch

from .functional import masked_whiten
from gpu_jobs.registry import Registry

__all__ = [
    "AdvantageEstimator",
    "ADVANTAGE_ESTIMATORS",
    "EstimatorRegistry",
    "EstimatorTraits",
    "register_adv_est",
    "get_adv_estimator_fn",
    "compute_advantage",
    "known_advantage_params",
    "group_ids",
]


class AdvantageEstimator(str, Enum):
    GAE = "gae"
    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    OPO = "opo"
    GPG = "gpg"
    GRPO_PASSK = "grpo_passk"


# The inputs every estimator may read; anything else in its signature is a keyword parameter.
_INPUTS = ("token_level_rewards", "response_mask", "index", "values", "reward_baselines")


def _params_of(fn) -> tuple[str, ...]:
    return tuple(
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind is not p.VAR_KEYWORD and p.name not in _INPUTS
    )


@dataclasses.dataclass(frozen=True)
class EstimatorTraits:
    """What an advantage estimator needs from a run, declared at its registration.

    >>> grpo = ADVANTAGE_ESTIMATORS.traits("grpo")
    >>> grpo.needs_groups, grpo.needs_critic, grpo.params
    (True, False, ('epsilon', 'norm_adv_by_std_in_grpo'))
    """

    needs_groups: bool = False  # compares responses to one prompt: the run samples rollout.n >= 2
    needs_critic: bool = False  # reads ``values``: the run trains a critic
    needs_reward_baselines: bool = False  # reads ``reward_baselines``: the run scores a greedy sample per prompt
    params: tuple[str, ...] = ()  # keyword parameters beyond the inputs, from the signature


class EstimatorRegistry(Registry):
    """The advantage-estimator registry: name -> function, and name -> ``EstimatorTraits``.

    >>> toy = EstimatorRegistry()
    >>> @toy.register("mean_baseline", needs_groups=True)
    ... def mean_baseline(token_level_rewards, response_mask, index=None, scale: float = 1.0):
    ...     ...
    >>> toy.traits("mean_baseline").params
    ('scale',)
    """

    def __init__(self) -> None:
        super().__init__("advantage estimator")
        self._traits: dict[str, EstimatorTraits] = {}

    def register(self, name: str | Enum, *, needs_groups: bool = False, needs_critic: bool = False,
                 needs_reward_baselines: bool = False) -> Callable:
        """Decorator: add ``fn`` under ``name`` with what it needs. A declared need must be an
        argument of ``fn`` (``index``, ``values``, ``reward_baselines``), else this raises."""
        add = super().register(name)

        def decorator(fn):
            takes = inspect.signature(fn).parameters
            for needed, arg in ((needs_groups, "index"), (needs_critic, "values"),
                                (needs_reward_baselines, "reward_baselines")):
                if needed and arg not in takes:
                    raise TypeError(f"advantage estimator {_name(name)!r} declares that it needs {arg} but its "
                                    f"signature has no {arg!r} argument")
            fn = add(fn)  # a name taken twice raises here, before any trait is recorded
            self._traits[_name(name)] = EstimatorTraits(needs_groups, needs_critic, needs_reward_baselines,
                                                        _params_of(fn))
            return fn

        return decorator

    def traits(self, name: str | Enum) -> EstimatorTraits:
        """What ``name`` needs; an unknown name raises and lists the valid ones."""
        self[name]
        return self._traits[_name(name)]


def _name(name: str | Enum) -> str:
    return str(name.value) if isinstance(name, Enum) else name


ADVANTAGE_ESTIMATORS: EstimatorRegistry = EstimatorRegistry()
register_adv_est = ADVANTAGE_ESTIMATORS.register


def get_adv_estimator_fn(name: str | AdvantageEstimator):
    """The estimator registered under ``name``; unknown names raise and list the valid ones."""
    return ADVANTAGE_ESTIMATORS[name]


# --------------------------------------------------------------------------------------------
# Group helpers (vectorised: one scatter per statistic, no Python loop over groups).


def group_ids(index: Any, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids ``(bs,)`` to dense ints ``0..G-1`` (first-seen order) and ``G``."""
    if isinstance(index, torch.Tensor):
        uniq, inverse = torch.unique(index, return_inverse=True)  # data-dependent size: one sync
        return inverse.to(device=device, dtype=torch.long), len(uniq)
    items = index.tolist() if hasattr(index, "tolist") else list(index)
    dense: dict[Any, int] = {}
    ids = [dense.setdefault(k, len(dense)) for k in items]
    return torch.tensor(ids, dtype=torch.long, device=device), len(dense)


def _group_stats(scores: torch.Tensor, ids: torch.Tensor, n_groups: int):
    """Per-row group size, mean and unbiased std; singletons get mean 0, std 1 (verl)."""
    zeros = scores.new_zeros(n_groups)
    count = zeros.index_add(0, ids, torch.ones_like(scores))
    mean_g = zeros.index_add(0, ids, scores) / count
    sq = zeros.index_add(0, ids, (scores - mean_g[ids]) ** 2)
    std_g = torch.sqrt(sq / (count - 1).clamp(min=1))
    n, mean, std = count[ids], mean_g[ids], std_g[ids]
    single = n == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return n, mean, std


def _scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return torch.where(response_mask.bool(), token_level_rewards, 0.0).sum(dim=-1)


def _broadcast(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return per_row[:, None] * response_mask.to(per_row.dtype)


def _need(name: str, **tensors: Any) -> None:
    for key, value in tensors.items():
        if value is None:
            raise ValueError(f"advantage estimator {name!r} needs {key}; pass {key}=...")


# --------------------------------------------------------------------------------------------
# Estimators


@register_adv_est(AdvantageEstimator.GAE, needs_critic=True)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al., arXiv:1506.02438).

    ``delta_t = r_t + gamma * V_{t'} - V_t`` with ``t'`` the next *unmasked* position, and
    ``A_t = delta_t + gamma * lam * A_{t'}``: masked positions are skipped, not treated as
    episode ends, so interior masks (e.g. tool-output tokens) do not break the recursion.
    ``returns = A + V`` (before whitening); advantages are then whitened over the mask.
    Needs ``values`` ``(bs, T)`` from a critic.
    """
    _need("gae", values=values)
    mask = response_mask.to(values.dtype)
    rewards = torch.where(response_mask.bool(), token_level_rewards, 0.0)
    next_value = values.new_zeros(values.shape[0])
    last_adv = values.new_zeros(values.shape[0])
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        v = torch.where(response_mask[:, t].bool(), values[:, t], 0.0)
        delta = rewards[:, t] + gamma * next_value - v
        cand = delta + gamma * lam * last_adv
        last_adv = m * cand + (1 - m) * last_adv
        next_value = m * v + (1 - m) * next_value
        adv[:, t] = last_adv
    returns = (adv + torch.where(response_mask.bool(), values, 0.0)) * mask
    advantages = masked_whiten(adv, response_mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.GRPO, needs_groups=True)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al., arXiv:2402.03300): ``A_i = (s_i - mean_g) / (std_g + epsilon)``.

    ``std_g`` is the unbiased std of the group's scores. With ``norm_adv_by_std_in_grpo=False``
    this is Dr. GRPO (Liu et al., arXiv:2503.20783): ``A_i = s_i - mean_g``.
    The advantage is broadcast over the response's tokens; returns equal advantages.
    """
    _need("grpo", index=index)
    scores = _scores(token_level_rewards, response_mask)
    ids, n_groups = group_ids(index, scores.device)
    _, mean, std = _group_stats(scores, ids, n_groups)
    adv = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.GRPO_PASSK, needs_groups=True)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage (Chen et al., arXiv:2503.19595): only each group's best response gets
    ``s_max - s_second_max`` (divided by ``std_g + epsilon`` when ``norm_adv_by_std_in_grpo``);
    all others get 0. On ties the first best row (batch order) wins. Every group needs >= 2
    responses, otherwise this raises.
    """
    _need("grpo_passk", index=index)
    scores = _scores(token_level_rewards, response_mask)
    ids, n_groups = group_ids(index, scores.device)
    n, _, std = _group_stats(scores, ids, n_groups)
    if bool((n < 2).any()):  # a validity check on the inputs, once per batch
        raise ValueError("grpo_passk needs at least 2 responses per group (rollout n >= 2)")
    rows = torch.arange(scores.shape[0], device=scores.device)
    neg_inf = torch.full((n_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    best = neg_inf.scatter_reduce(0, ids, scores, reduce="amax")
    is_best = scores == best[ids]
    big = torch.full((n_groups,), scores.shape[0], dtype=torch.long, device=scores.device)
    winner = big.scatter_reduce(0, ids, torch.where(is_best, rows, scores.shape[0]), reduce="amin")
    is_winner = rows == winner[ids]
    others = torch.where(is_winner, float("-inf"), scores)
    second = neg_inf.scatter_reduce(0, ids, others, reduce="amax")
    gap = best[ids] - second[ids]
    if norm_adv_by_std_in_grpo:
        gap = gap / (std + epsilon)
    adv = _broadcast(torch.where(is_winner, gap, 0.0), response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.RLOO, needs_groups=True)
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al., arXiv:2402.14740): ``A_i = s_i - mean_{j != i} s_j``
    ``= (s_i - mean_g) * n / (n - 1)``. A group of one keeps its raw score (verl).
    """
    _need("rloo", index=index)
    scores = _scores(token_level_rewards, response_mask)
    ids, n_groups = group_ids(index, scores.device)
    n, mean, _ = _group_stats(scores, ids, n_groups)
    adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), scores)
    adv = _broadcast(adv, response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.OPO)
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al., arXiv:2505.23585): length-weighted baseline
    ``b_g = sum_j |y_j| s_j / sum_j |y_j|``, ``A_i = s_i - b_g`` (``b = 0`` for a group of one).
    """
    _need("opo", index=index)
    scores = _scores(token_level_rewards, response_mask)
    lengths = response_mask.to(scores.dtype).sum(dim=-1)
    ids, n_groups = group_ids(index, scores.device)
    zeros = scores.new_zeros(n_groups)
    count = zeros.index_add(0, ids, torch.ones_like(scores))[ids]
    num = zeros.index_add(0, ids, lengths * scores)[ids]
    den = zeros.index_add(0, ids, lengths)[ids]
    baseline = torch.where(count > 1, num / den.clamp(min=1e-8), 0.0)
    adv = _broadcast(scores - baseline, response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.GPG)
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al., arXiv:2504.02546): ``A_i = alpha * (s_i - mean_g) / f_norm`` with
    ``alpha = bs / max(1, #{i: s_i != 0})`` (verl's choice of the paper's valid-sample count).
    """
    _need("gpg", index=index)
    scores = _scores(token_level_rewards, response_mask)
    ids, n_groups = group_ids(index, scores.device)
    _, mean, _ = _group_stats(scores, ids, n_groups)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    adv = _broadcast(alpha * (scores - mean) / f_norm, response_mask)
    return adv, adv


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE, needs_groups=True)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu, arXiv:2501.03262): ``s_i - mean_g`` broadcast over tokens, then
    whitened over all masked tokens of the batch (global normalisation)."""
    _need("reinforce_plus_plus_baseline", index=index)
    scores = _scores(token_level_rewards, response_mask)
    ids, n_groups = group_ids(index, scores.device)
    _, mean, _ = _group_stats(scores, ids, n_groups)
    centred = _broadcast(scores - mean, response_mask)
    adv = masked_whiten(centred, response_mask) * response_mask.to(centred.dtype)
    return adv, adv


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, arXiv:2501.03262): discounted return-to-go ``G_t = r_t + gamma G_{t'}``
    (``t'`` the next unmasked position; masked rewards are ignored), whitened over the batch's
    masked tokens. Returns are the un-whitened ``G``.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    rewards = torch.where(response_mask.bool(), token_level_rewards, 0.0)
    running = rewards.new_zeros(rewards.shape[0])
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = m * (rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    advantages = masked_whiten(returns, response_mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.REMAX, needs_reward_baselines=True)
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al., arXiv:2310.10505): ``returns_t = sum_{k>=t} r_k`` and
    ``A_t = returns_t - b`` where ``reward_baselines`` ``(bs,)`` is the score of a greedy
    response to the same prompt."""
    _need("remax", reward_baselines=reward_baselines)
    mask = response_mask.to(token_level_rewards.dtype)
    rewards = torch.where(response_mask.bool(), token_level_rewards, 0.0)
    returns = rewards.flip(-1).cumsum(-1).flip(-1) * mask
    advantages = returns - reward_baselines.to(returns.dtype)[:, None] * mask
    return advantages, returns


# --------------------------------------------------------------------------------------------
# Uniform entry point

def known_advantage_params() -> set[str]:
    """Every keyword parameter any registered estimator takes (e.g. gamma, lam, epsilon)."""
    return set().union(*(ADVANTAGE_ESTIMATORS.traits(name).params for name in ADVANTAGE_ESTIMATORS))


def compute_advantage(
    name: str | AdvantageEstimator,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | Any = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    **params: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as ``name``; returns ``(advantages, returns)``, each ``(bs, T)``.

    Each estimator receives the inputs and ``params`` it declares. A param that some other
    estimator uses (say ``lam`` for ``grpo``) is ignored; one that no estimator knows raises
    ``TypeError``, so typos do not pass silently.

    >>> import torch
    >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0]]); m = torch.ones(2, 2)
    >>> adv, _ = compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=["a", "a"])
    >>> [round(a, 4) for a in adv[:, 0].tolist()]  # (1 - 0.5) / std([0, 1]) = 0.5 / 0.7071
    [0.7071, -0.7071]
    """
    fn = ADVANTAGE_ESTIMATORS[name]
    unknown = set(params) - known_advantage_params()
    if unknown:
        raise TypeError(
            f"unknown advantage parameter(s) {sorted(unknown)}; known: {sorted(known_advantage_params())}"
        )
    sig = inspect.signature(fn).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in sig.values())
    given = dict(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        index=index,
        values=values,
        reward_baselines=reward_baselines,
        **params,
    )
    return fn(**{k: v for k, v in given.items() if takes_all or k in sig})

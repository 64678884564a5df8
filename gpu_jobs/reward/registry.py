"""Reward functions routed by `data_source`, with verl's signature.

    >>> from gpu_jobs.reward import default_compute_score
    >>> default_compute_score("openai/gsm8k", "... #### 72", "72")
    1.0
    >>> default_compute_score("rlmill/arith", "82", "82")
    1.0

A reward function is `fn(data_source, solution_str, ground_truth, extra_info=None)` returning a
float or a dict with "score" plus extras (shown in reward_extra). Exact names are looked up
first, then prefixes ("reasoning_gym/<task>"). Registering a name twice raises; an unknown
data_source raises and lists the known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpu_jobs.registry import Registry

from .rules import arith_score, gsm8k_score, last_number_score, math_score, reasoning_gym_score

__all__ = [
    "RewardFn",
    "REWARD_FNS",
    "REWARD_PREFIXES",
    "UnknownDataSourceError",
    "register_reward_fn",
    "get_reward_fn",
    "known_data_sources",
    "default_compute_score",
]

RewardFn = Callable[..., "float | dict[str, Any]"]

REWARD_FNS: Registry = Registry("reward function for data_source")
REWARD_PREFIXES: Registry = Registry("reward function for data_source prefix")


class UnknownDataSourceError(KeyError, NotImplementedError):
    """No reward function for this data_source (verl raises NotImplementedError here too)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def register_reward_fn(*data_sources: str, prefix: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: route the given data_source names (or name prefixes) to the function."""
    table = REWARD_PREFIXES if prefix else REWARD_FNS

    def deco(fn: RewardFn) -> RewardFn:
        for name in data_sources:
            table.register(name)(fn)
        return fn

    return deco


def known_data_sources() -> list[str]:
    return sorted(REWARD_FNS) + sorted(p + "<task>" for p in REWARD_PREFIXES)


def get_reward_fn(data_source: str) -> RewardFn:
    """The registered function for `data_source`; raises UnknownDataSourceError listing the known ones."""
    if data_source in REWARD_FNS:
        return REWARD_FNS[data_source]
    for prefix, fn in REWARD_PREFIXES.items():
        if data_source.startswith(prefix) and len(data_source) > len(prefix):
            return fn
    raise UnknownDataSourceError(
        f"no reward function for data_source={data_source!r}; known: {known_data_sources()}. "
        "Set reward.custom_reward_function.path to score other sources."
    )


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs):
    """Score one response with the built-in function for its data_source (verl's
    `default_compute_score`). Returns a float, or the function's dict unchanged."""
    res = get_reward_fn(data_source)(data_source, solution_str, ground_truth, extra_info, **kwargs)
    if isinstance(res, dict):
        return res
    return float(res)


@register_reward_fn("openai/gsm8k", "gsm8k")
def _gsm8k(data_source, solution_str, ground_truth, extra_info=None, method: str = "strict", **_):
    return gsm8k_score(solution_str, ground_truth, method=method)


@register_reward_fn("rlmill/arith")
def _arith(data_source, solution_str, ground_truth, extra_info=None, **_):
    return arith_score(solution_str, ground_truth)


@register_reward_fn("rlmill/times", "rlmill/times25")
def _times(data_source, solution_str, ground_truth, extra_info=None, **_):
    return last_number_score(solution_str, ground_truth)


@register_reward_fn(
    "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math", "math_boxed"
)
def _math(data_source, solution_str, ground_truth, extra_info=None, **_):
    return math_score(solution_str, ground_truth)


@register_reward_fn("reasoning_gym/", prefix=True)
def _reasoning_gym(data_source, solution_str, ground_truth, extra_info=None, **_):
    return reasoning_gym_score(data_source, solution_str, ground_truth, extra_info)

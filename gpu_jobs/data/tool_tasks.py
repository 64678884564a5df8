"""The built-in tool task: 3-digit additions, beyond what the built-in model can add, which it
solves by calling the calculator (rollout.multi_turn).

    >>> from gpu_jobs.data import make_dataset
    >>> make_dataset("arith_tools", "/tmp/data/arith_tools", train_size=512, test_size=64, seed=0)

A row: prompt "123+456=", ground truth "579", data_source "rlmill/arith_tools". Its scorer
reads the model's final answer, the text after the last tool turn ("[calculator(123+456)]<579>579"
-> "579"), so the calculator's own output never earns the reward.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu_jobs.data.generators import arith_row, register_generator
from gpu_jobs.reward.registry import register_reward_fn
from gpu_jobs.data.tool_calls import get_tool_format

ARITH_TOOLS_SOURCE = "rlmill/arith_tools"
LOW, HIGH = 100, 999  # operands: 3 digits, one more than the built-in model was taught
_TEST_BUCKET = 10  # one problem in ten belongs to the test split: the splits never share one

__all__ = ["ARITH_TOOLS_SOURCE", "arith_tools_row", "arith_tools_pairs", "arith_tools_score", "final_answer"]


def arith_tools_pairs(n: int, split: str, seed: int) -> list[tuple[int, int]]:
    """`n` distinct (a, b), a and b in 100..999, of `split` ("test" or anything else = train):
    a pair belongs to test when a seeded hash of it falls in one bucket of ten, so train and
    test never overlap whatever their sizes; deterministic in (n, split, seed)."""
    span = HIGH - LOW + 1
    keys = np.arange(span * span, dtype=np.int64)
    bucket = np.random.default_rng([seed, 7]).integers(0, _TEST_BUCKET, size=len(keys))
    pool = keys[(bucket == 0) == (split == "test")]
    if n > len(pool):
        raise ValueError(f"arith_tools has {len(pool)} distinct {split} problems; asked for {n}")
    chosen = np.random.default_rng([seed, 11, split == "test"]).choice(pool, size=n, replace=False)
    return [(LOW + int(k) // span, LOW + int(k) % span) for k in chosen]


def arith_tools_row(a: int, b: int, split: str, index: int) -> dict[str, Any]:
    return arith_row(a, b, split, index, data_source=ARITH_TOOLS_SOURCE)


@register_generator("arith_tools")
def _arith_tools(split: str, size: int, seed: int) -> list[dict[str, Any]]:
    return [arith_tools_row(a, b, split, i) for i, (a, b) in enumerate(arith_tools_pairs(size, split, seed))]


def final_answer(solution_str: str, tool_format: str = "brackets") -> str:
    """The model's text after the last tool turn of a decoded multi-turn response."""
    return get_tool_format(tool_format).final_answer(solution_str)


def arith_tools_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the final answer (after the last tool turn), stripped, is the ground truth."""
    return 1.0 if final_answer(solution_str).strip() == str(ground_truth).strip() else 0.0


@register_reward_fn(ARITH_TOOLS_SOURCE)
def _score(data_source, solution_str, ground_truth, extra_info=None, **_):
    return arith_tools_score(solution_str, ground_truth)

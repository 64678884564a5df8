"""The calculator task: 3-digit multiplications, which SmolLM2-135M-Instruct cannot do unaided,
for a model that may call the calculator tool (rollout.multi_turn, the `calculator` environment).

    >>> from gpu_jobs.data import make_dataset
    >>> make_dataset("calc3", "/tmp/data/calc3", train_size=512, test_size=64, seed=0)
    >>> calc3_score("The product is 56,088.", "56088")
    1.0

A row: prompt "What is 123 times 456? Use the calculator, then answer with only the number.",
ground truth "56088", data_source "rlmill/calc3". Its scorer reads the last number of the
model's final answer: the text after the last tool result (`</tool_response>` in the hermes
format, `<...>` in brackets), so a copied tool output inside a result never counts by itself.
Train and test never share a pair (a seeded hash puts one pair in ten in test).
"""

from __future__ import annotations

import re
from typing import Any

from gpu_jobs.data.generators import product_row, register_generator
from gpu_jobs.data.tool_calls import get_tool_format
from gpu_jobs.data.tool_tasks import arith_tools_pairs
from gpu_jobs.reward.registry import register_reward_fn

CALC3_SOURCE = "rlmill/calc3"
CALC3_PROMPT = "What is {a} times {b}? Use the calculator, then answer with only the number."
_NUMBER = re.compile(r"-?\d[\d,]*")

__all__ = ["CALC3_SOURCE", "CALC3_PROMPT", "calc3_row", "calc3_score", "last_number"]


def calc3_row(a: int, b: int, split: str, index: int) -> dict[str, Any]:
    """One row: a 3-digit product."""
    return product_row(CALC3_SOURCE, CALC3_PROMPT, a, b, split, index)


@register_generator("calc3")
def _calc3(split: str, size: int, seed: int) -> list[dict[str, Any]]:
    # The same disjoint pair pools as arith_tools: a test product is never trained on.
    return [calc3_row(a, b, split, i) for i, (a, b) in enumerate(arith_tools_pairs(size, split, seed))]


def last_number(text: str) -> int | None:
    """The last integer written in `text` (thousands commas allowed), None when there is none.

    >>> last_number("12 x 3 = 36, so 1,234")
    1234
    """
    found = [m.group().replace(",", "").strip(",") for m in _NUMBER.finditer(text)]
    for number in reversed(found):
        try:
            return int(number)
        except ValueError:
            continue
    return None


def calc3_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the last number of the final answer (after the last tool result) is the product."""
    final = solution_str.rsplit("</tool_response>", 1)[-1]
    final = get_tool_format("brackets").final_answer(final)
    try:
        return 1.0 if last_number(final) == int(str(ground_truth).strip()) else 0.0
    except ValueError:
        return 0.0


@register_reward_fn(CALC3_SOURCE)
def _score(data_source, solution_str, ground_truth, extra_info=None, **_):
    return calc3_score(solution_str, ground_truth)

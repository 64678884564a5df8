"""Built-in prompt datasets, generated offline in verl's Parquet format.

    >>> from gpu_jobs.data import make_dataset
    >>> train_url, test_url = make_dataset("arith", "/tmp/data/arith", train_size=512, test_size=64, seed=0)

Generators are registered by name (`dataset_names()` lists them): "arith" (the built-in 2-digit
addition task), "times" (times tables up to 12 x 12 in words, the real-model task SmolLM2-135M
learns on CPU), "times25" (the same up to 25 x 25: 200+ held-out prompts), "gsm_symbolic" (reasoning-gym's GSM8K-style word problems), "arith_tools"
(gpu_jobs/data/tool_tasks.py), "calc3" (3-digit products for the calculator environment,
gpu_jobs/data/calc_tasks.py) and "rg:<task>" for any other reasoning-gym task. A reasoning-gym row keeps the generated entry as a JSON string in
`extra_info["rg_entry"]`, which is what the reward needs to call that task's `score_answer`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from gpu_jobs.registry import Registry
from storage import join
from storage.datasets import write_prompts

ARITH_SOURCE = "rlmill/arith"
TIMES_SOURCE = "rlmill/times"
TIMES25_SOURCE = "rlmill/times25"
RG_SOURCE_PREFIX = "reasoning_gym/"

__all__ = ["ARITH_SOURCE", "RG_SOURCE_PREFIX", "GENERATORS", "register_generator", "get_generator", "make_dataset",
           "dataset_names", "arith_pairs", "arith_row", "TIMES_SOURCE", "TIMES25_SOURCE", "TIMES_TABLES", "TimesTables",
           "held_out_size"]


def _json_safe(value: Any) -> Any:
    """Metadata from task generators -> JSON-representable data.

    Tuples and sets become {"__tuple__": [...]} / {"__set__": [...]} so the scorer can rebuild
    them (`gpu_jobs.reward.rules.decode_rg_entry`): some tasks' score_answer compares a parsed
    answer with a tuple in the metadata, and a list would never be equal. Fractions and other
    objects become their str().
    """
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {"__tuple__": [_json_safe(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [_json_safe(v) for v in sorted(value, key=repr)]}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Fraction):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


Generator = Callable[[str, int, int], list[dict[str, Any]]]
"""(split, size, seed) -> verl rows. Must be deterministic in its arguments."""

GENERATORS: Registry = Registry("dataset generator")
register_generator = GENERATORS.register
"""Decorator: register a dataset generator under `name`; registering a name twice raises."""


def dataset_names() -> list[str]:
    """Every name `make_dataset` takes, as help and errors list them: the registered generators,
    then reasoning-gym's pattern ("rg:<reasoning-gym task>")."""
    return [*sorted(GENERATORS), "rg:<reasoning-gym task>"]


def get_generator(name: str) -> Generator:
    """The generator for `name`; "rg:<task>" builds any reasoning-gym task. Unknown names raise."""
    if name.startswith("rg:") and len(name) > 3:
        task = name[3:]
        return lambda split, size, seed: _reasoning_gym_rows(task, split, size, seed)
    return GENERATORS[name]  # raises UnknownNameError (a KeyError) listing the known names


def _split_seed(seed: int, split: str) -> int:
    # Train and test draw from different streams, so test is not a prefix of train.
    return int(np.random.SeedSequence([seed, {"train": 0, "test": 1}.get(split, 2)]).generate_state(1)[0])


def arith_pairs(n_total: int, seed: int) -> list[tuple[int, int]]:
    """n_total distinct (a, b) pairs with a, b in 10..99, in a seeded random order."""
    if n_total > 90 * 90:
        raise ValueError(f"arith has only {90 * 90} distinct prompts; asked for {n_total}")
    order = np.random.default_rng(seed).permutation(90 * 90)[:n_total]
    return [(10 + int(k) // 90, 10 + int(k) % 90) for k in order]


def arith_row(a: int, b: int, split: str, index: int, data_source: str = ARITH_SOURCE) -> dict[str, Any]:
    """One row of the built-in task (the contract): prompt "a+b=", ground truth str(a+b);
    `data_source` routes it to its scorer (the arith_tools task has its own)."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{a}+{b}="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


@register_generator("arith")
def _arith(split: str, size: int, seed: int) -> list[dict[str, Any]]:
    # Standalone use: one split's stream. make_dataset uses _arith_splits so that test
    # prompts never appear in train.
    return [arith_row(a, b, split, i) for i, (a, b) in enumerate(arith_pairs(size, _split_seed(seed, split)))]


def _arith_splits(train_size: int, test_size: int, seed: int):
    pairs = arith_pairs(train_size + test_size, seed)
    test = [arith_row(a, b, "test", i) for i, (a, b) in enumerate(pairs[:test_size])]
    train = [arith_row(a, b, "train", i) for i, (a, b) in enumerate(pairs[test_size:])]
    return train, test


# Times tables: "What is 7 times 8? Answer with only the number." SmolLM2-135M-Instruct answers
# a third of them greedily and two thirds within 4 samples at temperature 0.8 (it often explains
# instead of answering), which is the headroom GRPO needs. A fact and its mirror (7 x 8, 8 x 7)
# always land in the same split, so a held-out fact was never trained on in either order.
TIMES_PROMPT = "What is {a} times {b}? Answer with only the number."


@dataclass(frozen=True)
class TimesTables:
    """A times-table family: every product of two factors in `factors`, asked in TIMES_PROMPT's
    words, held out by whole facts (both orders), at most `max_held_out` prompts so that at least
    half the facts stay for training."""

    name: str
    source: str  # data_source: scored on the response's last number (gpu_jobs.reward.registry)
    factors: range
    max_held_out: int
    default_held_out: int  # `rlmill data make`'s --test-size when not given

    @property
    def prompts(self) -> int:
        return len(self.factors) ** 2

    def facts(self, seed: int) -> list[tuple[int, int]]:
        """The unordered facts a <= b, in a seeded random order."""
        facts = [(a, b) for a in self.factors for b in self.factors if a <= b]
        return [facts[int(k)] for k in np.random.default_rng(seed).permutation(len(facts))]

    def row(self, a: int, b: int, split: str, index: int) -> dict[str, Any]:
        return product_row(self.source, TIMES_PROMPT, a, b, split, index)

    def splits(self, train_size: int, test_size: int, seed: int) -> tuple[list[dict], list[dict]]:
        """Test takes whole facts from the front of the seeded order until it has `test_size`
        prompts (one more when the last fact has a mirror); train is the rest, repeated in order
        when `train_size` asks for more than there are."""
        facts, test_pairs = self.facts(seed), []
        while facts and len(test_pairs) < test_size:
            test_pairs += _both_orders([facts.pop(0)])
        train_pairs = _both_orders(facts)
        if test_size and len(test_pairs) < test_size or train_size and not train_pairs:
            raise ValueError(f"{self.name} has {self.prompts} prompts in all; "
                             f"asked for {test_size} held out and {train_size} to train on")
        train_pairs = [train_pairs[i % len(train_pairs)] for i in range(train_size)]
        return ([self.row(a, b, "train", i) for i, (a, b) in enumerate(train_pairs)],
                [self.row(a, b, "test", i) for i, (a, b) in enumerate(test_pairs)])

    def generate(self, split: str, size: int, seed: int) -> list[dict[str, Any]]:
        # Standalone use: one split's prompts (make_dataset keeps the splits' facts apart).
        train, test = self.splits(size if split != "test" else 0, size if split == "test" else 0, seed)
        return test if split == "test" else train


# times: the 12 x 12 tables (121 prompts, 40 held out by default). times25: 2..25 (576 prompts),
# wide enough to hold out 200+ prompts of never-trained facts, on which SmolLM2-135M-Instruct
# starts at 27 % greedy (82 of 300 random prompts; 40 % on the 12 x 12 ones, 28 % on those with a
# factor of 13..20): a held-out set where one prompt is half a point, not 2.5.
TIMES_TABLES: dict[str, TimesTables] = {
    "times": TimesTables("times", TIMES_SOURCE, range(2, 13), max_held_out=60, default_held_out=40),
    "times25": TimesTables("times25", TIMES25_SOURCE, range(2, 26), max_held_out=288, default_held_out=200),
}
def product_row(source: str, prompt: str, a: int, b: int, split: str, index: int) -> dict[str, Any]:
    """One verl row asking for a * b (`prompt` formatted with a and b); the ground truth is
    str(a * b), scored on the response's last number; `extra_info` keeps the operands."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": prompt.format(a=a, b=b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a * b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def _both_orders(facts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [pair for a, b in facts for pair in ([(a, b)] if a == b else [(a, b), (b, a)])]


for _family in TIMES_TABLES.values():
    register_generator(_family.name)(_family.generate)


def held_out_size(name: str, val_size: int) -> int:
    """Rows a run generates for `name`'s held-out split. At least 300, so that a later run with a
    larger data.val_size, or the nightly evaluation, reads the same first rows; a times-table
    family has few prompts, so it holds out exactly `val_size` (at most its max_held_out)."""
    return val_size if name in TIMES_TABLES else max(val_size, 300)


# Generators whose train and test splits must be drawn together, so no test problem is trained on.
_SPLIT_GENERATORS: dict[str, Callable[[int, int, int], tuple[list, list]]] = {
    "arith": lambda train_size, test_size, seed: _arith_splits(train_size, test_size, seed),
    **{name: family.splits for name, family in TIMES_TABLES.items()},
}


def _reasoning_gym_rows(task: str, split: str, size: int, seed: int) -> list[dict[str, Any]]:
    import reasoning_gym

    if size == 0:  # reasoning-gym refuses size 0
        return []
    ds = reasoning_gym.create_dataset(task, size=size, seed=_split_seed(seed, split))
    rows = []
    for i in range(size):
        entry = ds[i]
        answer = entry.get("answer")
        stored = _json_safe({"question": entry["question"], "answer": answer, "metadata": entry.get("metadata", {})})
        rows.append(
            {
                "data_source": RG_SOURCE_PREFIX + task,
                "prompt": [{"role": "user", "content": entry["question"]}],
                "ability": "reasoning",
                "reward_model": {"style": "rule", "ground_truth": "" if answer is None else str(answer)},
                "extra_info": {"split": split, "index": i, "rg_task": task, "rg_entry": json.dumps(stored)},
            }
        )
    return rows


@register_generator("gsm_symbolic")
def _gsm_symbolic(split: str, size: int, seed: int) -> list[dict[str, Any]]:
    return _reasoning_gym_rows("gsm_symbolic", split, size, seed)


def make_dataset(
    name: str, out_url: str, *, train_size: int, test_size: int, seed: int, storage=None
) -> tuple[str, str]:
    """Generate `name` and write `<out_url>/train.parquet` and `<out_url>/test.parquet`.

    Deterministic in (name, sizes, seed), so re-running (a retried task) rewrites identical
    files. Each file is moved into place whole; a reader never sees a partial file.
    """
    if train_size < 0 or test_size < 0:
        raise ValueError("train_size and test_size must be >= 0")
    if name in _SPLIT_GENERATORS:
        train, test = _SPLIT_GENERATORS[name](train_size, test_size, seed)
    else:
        gen = get_generator(name)
        train, test = gen("train", train_size, seed), gen("test", test_size, seed)
    train_url, test_url = join(out_url, "train.parquet"), join(out_url, "test.parquet")
    write_prompts(test, test_url, storage=storage)
    write_prompts(train, train_url, storage=storage)
    return train_url, test_url


# --------------------------------------------------------------------------------------------
# Sampling: a pure function of (seed, epoch, iteration)
# --------------------------------------------------------------------------------------------

"""Ground truths through the sample table's string column, without losing their type.

verl hands `reward_model.ground_truth` to `compute_score` exactly as the dataset holds it: a
string, but also a list (several accepted answers), a dict (a test case), a number. The sample
table stores it in one string column, so a non-string value is stored as JSON behind a marker
and decoded back before the reward function is called:

    >>> encode_ground_truth("72"), encode_ground_truth(["72", "72.0"])[len(JSON_MARKER):]
    ('72', '["72", "72.0"]')
    >>> decode_ground_truth(encode_ground_truth({"input": 3, "output": [9]}))
    {'input': 3, 'output': [9]}

Strings stay as they are; a string that itself starts with the marker is stored marked too, so
decoding is exact for every value. None is stored as "" (what the built-in scorers have always
received for a row without a ground truth). numpy arrays and scalars (what pandas gives for
Parquet lists) become plain lists and numbers, and tuples lists, as a verl dataset loaded with
HF `datasets` would give them.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["JSON_MARKER", "encode_ground_truth", "decode_ground_truth"]

# A NUL byte never starts a ground truth written as text, and the name says what follows.
JSON_MARKER = "\x00rlmill-json:"


def _plain(x: Any) -> Any:
    if hasattr(x, "tolist"):  # numpy arrays and scalars
        return x.tolist()
    if isinstance(x, (set, frozenset)):
        return sorted(x, key=repr)
    return str(x)


def encode_ground_truth(value: Any) -> str:
    """A ground truth as the sample table's string cell (see the module docstring)."""
    if value is None:
        return ""
    if isinstance(value, str) and not value.startswith(JSON_MARKER):
        return value
    return JSON_MARKER + json.dumps(value, default=_plain, ensure_ascii=False)


def decode_ground_truth(cell: Any) -> Any:
    """The value `encode_ground_truth` stored; anything else is returned unchanged."""
    if isinstance(cell, str) and cell.startswith(JSON_MARKER):
        return json.loads(cell[len(JSON_MARKER):])
    return cell

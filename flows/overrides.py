"""verl-style dotted overrides on a nested config dict.

    >>> apply_overrides({"rollout": {"n": 4}}, ["rollout.n=8", "algorithm.adv_estimator=rloo"])
    {'rollout': {'n': 8}, 'algorithm': {'adv_estimator': 'rloo'}}

Values are parsed as YAML scalars/flow collections (`8` -> int, `true` -> bool, `[1,2]` -> list),
so the command line and a YAML file mean the same thing.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import yaml


# YAML 1.1 reads "3e-5" (no dot) as a string; on a command line it is always meant as a number.
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


class OverrideError(ValueError):
    """An override that is not `dotted.key=value`."""


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise OverrideError(
            f"override {text!r} is not of the form dotted.key=value (e.g. rollout.n=8)"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise OverrideError(f"override {text!r}: value is not valid YAML ({exc})") from None
    if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
        value = float(value)
    return key.split("."), value


def apply_overrides(config: dict, overrides: list[str]) -> dict:
    """Return a copy of `config` with each `a.b.c=value` applied in order."""
    out = copy.deepcopy(config)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(path[: i + 1])
                raise OverrideError(f"override {text!r}: {prefix!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return out

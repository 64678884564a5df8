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
    return apply_items(config, [parse_override(text) for text in overrides])


def apply_items(config: dict, items: list[tuple[list[str], Any]]) -> dict:
    """Return a copy of `config` with each parsed override (key path, value) applied in order."""
    out = copy.deepcopy(config)
    for path, value in items:
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(path[: i + 1])
                raise OverrideError(f"override {'.'.join(path)}={value!r}: {prefix!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return out


# ------------------------------------------------------------------------------------ run ids
def names_key(overrides: list[str], dotted: str) -> bool:
    """Whether any override sets `dotted` (e.g. "run_id")."""
    return any(text.partition("=")[0].strip() == dotted for text in overrides if "=" in text)


def config_names_run_id(config: str | None, overrides: list[str]) -> bool:
    """Whether the YAML file or the overrides name the run (`run_id`, or verl's
    `trainer.experiment_name`, which flows/verl_keys.py turns into run_id). A config file that
    cannot be read counts as naming none: loading it reports that problem."""
    if names_key(overrides, "run_id") or names_key(overrides, "trainer.experiment_name"):
        return True
    if config is None:
        return False
    try:
        with open(config) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and data.get("run_id") is not None


def fresh_run_id(config: str | None, when: float | None = None) -> str:
    """`<config file name>-<YYYYmmdd-HHMMSS>` in local time, e.g. grpo-arith-20261201-093000
    for examples/grpo_arith.yaml ("run-..." without a config file)."""
    import os
    import time

    stem = os.path.splitext(os.path.basename(config))[0] if config else "run"
    stem = re.sub(r"[^A-Za-z0-9.-]+", "-", stem).strip("-.") or "run"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(when))}"


def with_run_id(config: str | None, overrides: list[str], taken=None) -> tuple[list[str], str | None]:
    """The rule for run ids: a run the config and overrides do not name gets a fresh timestamped
    id (`fresh_run_id`); naming an id (`run_id=...`) resumes that run. Returns the overrides with
    `run_id=<fresh>` added when one was chosen, and the chosen id (None when the user named one).
    `taken(run_id) -> bool`, when given, skips ids already used (-2, -3, ... are appended)."""
    overrides = list(overrides)
    if config_names_run_id(config, overrides):
        return overrides, None
    base = fresh_run_id(config)
    run_id, n = base, 1
    while taken is not None and taken(run_id) and n < 100:
        n += 1
        run_id = f"{base}-{n}"
    return [*overrides, f"run_id={run_id}"], run_id

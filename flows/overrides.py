"""verl-style dotted overrides on a nested config dict, in hydra's grammar (``Override``).

    >>> apply_overrides({"rollout": {"n": 4}}, ["rollout.n=8", "algorithm.adv_estimator=rloo"])
    {'rollout': {'n': 8}, 'algorithm': {'adv_estimator': 'rloo'}}
    >>> apply_overrides({"rollout": {"n": 4, "top_k": 5}}, ["~rollout.n", "++rollout.top_k=7", "+actor.lr=1e-6"])
    {'rollout': {'top_k': 7}, 'actor': {'lr': 1e-06}}

Values are parsed as YAML scalars/flow collections (`8` -> int, `true` -> bool, `[1,2]` -> list),
so the command line and a YAML file mean the same thing.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any, Callable

import yaml


# YAML 1.1 reads "3e-5" (no dot) as a string; on a command line it is always meant as a number.
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


class OverrideError(ValueError):
    """An override that is not `dotted.key=value` (or one of hydra's `+`, `++`, `~` forms)."""


_MISSING = object()  # no value: `~key` without `=value`; a key absent from a config


def _parse_value(text: str, raw: str) -> Any:
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise OverrideError(f"override {text!r}: value is not valid YAML ({exc})") from None
    if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
        value = float(value)
    return value


@dataclasses.dataclass(frozen=True)
class Override:
    """One override in hydra's grammar (verl's command lines use all four):

    - ``key=value`` sets the key;
    - ``+key=value`` adds a key that hydra's config lacks. Every key of rlmill's typed config
      exists (at its default), so for a known key this sets it; an unknown key is refused as for
      ``key=value``;
    - ``++key=value`` sets or adds: the same as ``key=value`` here;
    - ``~key`` deletes the key, which in a typed config means: back to its default (a section:
      all of it). ``~key=value`` deletes only when the current value equals ``value``, and is
      refused otherwise (hydra's rule).

    >>> parse_override("~actor.lr=1e-6")
    Override(op='delete', path=('actor', 'lr'), value=1e-06)
    """

    op: str  # one of OVERRIDE_OPS' values
    path: tuple[str, ...]
    value: Any = _MISSING  # _MISSING only for a `~key` without a value

    @property
    def key(self) -> str:
        return ".".join(self.path)

    @property
    def deletes(self) -> bool:
        return self.op == "delete"

    @property
    def has_value(self) -> bool:
        return self.value is not _MISSING

    def __repr__(self) -> str:
        value = "" if self.value is _MISSING else f", value={self.value!r}"
        return f"Override(op={self.op!r}, path={self.path!r}{value})"


# hydra's override prefixes, longest first: the prefix -> what the override does.
OVERRIDE_OPS: dict[str, str] = {"++": "force", "+": "add", "~": "delete", "": "set"}


@dataclasses.dataclass(frozen=True)
class Delete:
    """The value of a parsed `~key` item (see ``apply_items``): remove the key so that it takes its
    default again; with ``expected``, only when the current value equals it."""

    expected: Any = _MISSING


def parse_override(text: str) -> Override:
    """`[+|++|~]dotted.key[=value]` -> Override; the value parsed as YAML (see the module doc)."""
    prefix = next(p for p in OVERRIDE_OPS if text.startswith(p))
    op = OVERRIDE_OPS[prefix]
    key, sep, raw = text[len(prefix):].partition("=")
    key = key.strip()
    if (not sep and op != "delete") or not key or any(not part for part in key.split(".")):
        raise OverrideError(
            f"override {text!r} is not of the form dotted.key=value (e.g. rollout.n=8), +key=value, "
            "++key=value or ~key[=value] (hydra's forms)"
        )
    return Override(op, tuple(key.split(".")), _parse_value(text, raw) if sep else _MISSING)


def item_of(override: Override) -> tuple[list[str], Any]:
    """The (key path, value) item ``apply_items`` applies for one parsed override."""
    value = Delete(override.value) if override.deletes else override.value
    return list(override.path), value


def apply_overrides(config: dict, overrides: list[str], default: Callable[[list[str]], Any] | None = None) -> dict:
    """Return a copy of `config` with each override (`a.b.c=value`, `~a.b`, ...) applied in order."""
    return apply_items(config, [item_of(parse_override(text)) for text in overrides], default)


def apply_items(config: dict, items: list[tuple[list[str], Any]],
                default: Callable[[list[str]], Any] | None = None) -> dict:
    """Return a copy of `config` with each parsed override (key path, value) applied in order. A
    ``Delete`` value removes the key; `default(path)` gives the value of a key `config` lacks, which
    a ``Delete`` with an expected value compares against (none given: such a key has no value)."""
    out = copy.deepcopy(config)
    for path, value in items:
        if isinstance(value, Delete):
            _delete(out, path, value, default)
            continue
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(path[: i + 1])
                raise OverrideError(f"override {'.'.join(path)}={value!r}: {prefix!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return out


def _delete(config: dict, path: list[str], op: Delete, default: Callable[[list[str]], Any] | None) -> None:
    key = ".".join(path)
    node: Any = config
    for part in path[:-1]:
        node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
    present = isinstance(node, dict) and path[-1] in node
    if op.expected is not _MISSING:
        current = node[path[-1]] if present else (default(path) if default else _MISSING)
        if current is _MISSING or current != op.expected:
            shown = "not set" if current is _MISSING else f"{current!r}"
            raise OverrideError(f"~{key}={op.expected!r}: {key} is {shown}, so it is not deleted (hydra deletes "
                                f"a key given with a value only when the value matches; drop the value to reset it)")
    if present:
        del node[path[-1]]


# ------------------------------------------------------------------------------------ run ids
def names_key(overrides: list[str], dotted: str) -> bool:
    """Whether the overrides leave `dotted` (e.g. "run_id") set: the last override of that key
    sets it (`key=`, `+key=`, `++key=`) rather than deletes it (`~key`)."""
    named = False
    for text in overrides:
        try:
            override = parse_override(text)
        except OverrideError:
            continue  # reported when the config is loaded
        if override.key == dotted:
            named = not override.deletes
    return named


def config_names_run_id(config: str | None, overrides: list[str]) -> bool:
    """Whether the YAML file or the overrides name the run (`run_id`, or verl's
    `trainer.experiment_name`, which flows/verl_keys.py turns into run_id, in either). A config
    file that cannot be read counts as naming none: loading it reports that problem."""
    if names_key(overrides, "run_id") or names_key(overrides, "trainer.experiment_name"):
        return True
    if config is None:
        return False
    try:
        with open(config) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return False
    if not isinstance(data, dict):
        return False
    trainer = data.get("trainer")
    return data.get("run_id") is not None or (isinstance(trainer, dict) and trainer.get("experiment_name") is not None)


def fresh_run_id(config: str | None, when: float | None = None) -> str:
    """`<config file name>-<YYYYmmdd-HHMMSS>` in local time, e.g. grpo-arith-20261201-093000
    for examples/grpo_arith.yaml ("run-..." without a config file)."""
    import os
    import time

    stem = os.path.splitext(os.path.basename(config))[0] if config else "run"
    stem = re.sub(r"[^A-Za-z0-9.-]+", "-", stem).strip("-.") or "run"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(when))}"


def unused_run_id(config: str | None, taken: Callable[[str], bool] | None = None) -> str:
    """A fresh id (`fresh_run_id`) that ``taken(run_id)`` does not claim: -2, -3, ... are appended
    to one already used (two runs started in one second). flows.config.decide_run_id applies it."""
    base = fresh_run_id(config)
    run_id, n = base, 1
    while taken is not None and taken(run_id) and n < 100:
        n += 1
        run_id = f"{base}-{n}"
    return run_id

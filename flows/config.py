"""Loading a run config: a YAML file plus dotted overrides (rlmill's keys, or verl's, translated by
flows/verl_keys.py), validated into the typed RunConfig that lives with the stages
(gpu_jobs/stages/config.py).

    cfg = load_run_config("examples/grpo_arith.yaml", ["algorithm.adv_estimator=rloo", "rollout.n=8"])
    cfg = load_run_config(None, ["actor_rollout_ref.rollout.n=5", "trainer.total_training_steps=20"])
    cfg = load_run_config(None, ["+trainer.val_before_train=False", "~rollout.n"])   # hydra's forms

A YAML file may use verl's section names too (``actor_rollout_ref: {rollout: {n: 5}}``): its keys
mean what the same dotted keys mean on a command line. The overrides apply on top of the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from flows.overrides import Delete, OverrideError, apply_items
from flows.verl_keys import has_total_epochs, resolve_total_epochs, translate, translate_tree
from gpu_jobs.stages.config import (ARITH_PROBLEMS, ConfigError, RunConfig, build_run_config,  # noqa: F401
                                    config_from_run_json, config_keys, frozen_config, unknown_key_message)


def load_run_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (optional) + overrides -> validated RunConfig. verl's keys in the file and among
    the overrides are translated first; an unsupported one raises ConfigError before any work."""
    data = _read_yaml(path) if path is not None else {}
    try:
        data = apply_items({}, translate_tree(data))
        items = translate(list(overrides))
        _deletes_known_keys(items)
        data = apply_items(data, items, default=_DefaultValues().at)
    except OverrideError as exc:
        raise ConfigError(str(exc)) from None
    if has_total_epochs(data):
        # verl's trainer.total_epochs: the step count needs the data, which the config names.
        placeholder = {**data, "trainer": {**data["trainer"], "total_iterations": 1}}
        data = resolve_total_epochs(data, build_run_config(placeholder))
    return build_run_config(data)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _deletes_known_keys(items: list[tuple[list[str], Any]]) -> None:
    """`~key` of a key the config does not have is refused as `key=value` would be (pydantic
    never sees a deleted key)."""
    keys = set(config_keys())
    unknown = [".".join(path) for path, value in items if isinstance(value, Delete) and ".".join(path) not in keys]
    if unknown:
        raise ConfigError("invalid run config:\n" + "\n".join(f"  {k}: {unknown_key_message(k)}" for k in unknown))


class _DefaultValues:
    """The value a key has when nothing sets it: what `~key=value` compares against when neither
    the file nor an earlier override set the key. Read from rlmill's default config (built on the
    first question only), so derived defaults (adv_estimator=grpo) are the ones a run would get."""

    def __init__(self) -> None:
        self._dump: dict[str, Any] | None = None

    def at(self, path: list[str]) -> Any:
        from flows.overrides import _MISSING

        if self._dump is None:
            self._dump = build_run_config({}, check_files=False).model_dump()
        node: Any = self._dump
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return _MISSING  # under a section that is off (critic: null), or no such key
            node = node[part]
        return node

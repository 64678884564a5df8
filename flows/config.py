"""Loading a run config: a YAML file plus dotted overrides (rlmill's keys, or verl's, translated by
flows/verl_keys.py), validated into the typed RunConfig that lives with the stages
(gpu_jobs/stages/config.py).

    cfg = load_run_config("examples/grpo_arith.yaml", ["algorithm.adv_estimator=rloo", "rollout.n=8"])
    cfg = load_run_config(None, ["actor_rollout_ref.rollout.n=5", "trainer.total_training_steps=20"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from flows.overrides import apply_items
from flows.verl_keys import has_total_epochs, resolve_total_epochs, translate
from gpu_jobs.stages.config import (ARITH_PROBLEMS, ConfigError, RunConfig, build_run_config,  # noqa: F401
                                    config_from_run_json, frozen_config)


def load_run_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (optional) + dotted overrides -> validated RunConfig. verl's keys among the
    overrides are translated first; an unsupported one raises ConfigError before any work."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
    data = apply_items(data, translate(list(overrides)))
    if has_total_epochs(data):
        # verl's trainer.total_epochs: the step count needs the data, which the config names.
        placeholder = {**data, "trainer": {**data["trainer"], "total_iterations": 1}}
        data = resolve_total_epochs(data, build_run_config(placeholder))
    return build_run_config(data)



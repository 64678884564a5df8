"""Loading a run config: a YAML file plus verl-style dotted overrides, validated into the typed
RunConfig that lives with the stages (gpu_jobs/stages/config.py).

    cfg = load_run_config("examples/grpo_arith.yaml", ["algorithm.adv_estimator=rloo", "rollout.n=8"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from flows.overrides import apply_overrides
from gpu_jobs.stages.config import (ARITH_PROBLEMS, ConfigError, RunConfig, build_run_config,  # noqa: F401
                                    config_from_run_json, frozen_config)


def load_run_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (optional) + dotted overrides -> validated RunConfig."""
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
    return build_run_config(apply_overrides(data, list(overrides)))



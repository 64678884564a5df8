"""A run frozen by an older rlmill (its run.json lacks keys added since) still resumes while the
new features stay at their defaults, and is refused once one of them is turned on."""

from __future__ import annotations

import pytest

from gpu_jobs.stages.config import build_run_config, frozen_config
from gpu_jobs.stages.run import RunConfigMismatchError, check_config_matches
from storage import RunLayout


def _older(config: dict) -> dict:
    """`config` as an rlmill without LoRA, reward models, multi-turn or val_kwargs froze it."""
    old = {k: v for k, v in config.items() if k != "reward_model"}
    old["model"] = {k: v for k, v in config["model"].items()
                    if k not in ("lora_rank", "lora_alpha", "target_modules")}
    old["rollout"] = {k: v for k, v in config["rollout"].items() if k not in ("multi_turn", "val_kwargs")}
    return old


def test_run_frozen_before_new_keys_resumes_with_their_defaults(tmp_path):
    layout = RunLayout(str(tmp_path), "r")
    now = frozen_config(build_run_config({"run_id": "r", "root": str(tmp_path)}))
    check_config_matches(layout, {"config": _older(now)}, now)  # defaults: same run


@pytest.mark.parametrize("override", [{"model": {"lora_rank": 4}}, {"rollout": {"val_kwargs": {"n": 1, "top_k": 5}}},
                                      {"reward_model": {"enable": True}}])
def test_turning_a_new_feature_on_is_a_different_run(tmp_path, override):
    layout = RunLayout(str(tmp_path), "r")
    base = {"run_id": "r", "root": str(tmp_path)}
    old = _older(frozen_config(build_run_config(base)))
    changed = frozen_config(build_run_config({**base, **override}))
    with pytest.raises(RunConfigMismatchError, match=next(iter(override))):
        check_config_matches(layout, {"config": old}, changed)

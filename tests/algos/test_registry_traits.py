"""Registries carry what their variants need (issue 44, item 2): an advantage estimator declares
at its registration whether it needs groups, a critic or reward baselines, and its keyword
arguments are read from its signature; rollout engine names in the config are checked against
the engine registry. A new estimator is one module, a new engine one module (plus its import).

    .venv/bin/python -m pytest -q tests/algos/test_registry_traits.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpu_jobs.algos import (ADVANTAGE_ESTIMATORS, AlgorithmConfig, DuplicateNameError, EstimatorRegistry,
                            EstimatorTraits, UnknownNameError)

REPO = Path(__file__).resolve().parents[2]


def test_traits_are_declared_at_registration_and_params_read_from_the_signature():
    reg = EstimatorRegistry()  # a fresh registry: the global one is never changed by a test

    @reg.register("toy", needs_groups=True)
    def toy(token_level_rewards, response_mask, index=None, gamma: float = 1.0, scale: float = 2.0, **extra):
        return token_level_rewards, token_level_rewards

    assert reg["toy"] is toy
    assert reg.traits("toy") == EstimatorTraits(needs_groups=True, params=("gamma", "scale"))
    with pytest.raises(DuplicateNameError):
        reg.register("toy", needs_critic=True)(lambda token_level_rewards, response_mask, values=None: None)
    assert reg.traits("toy").needs_critic is False  # the refused registration recorded nothing
    with pytest.raises(UnknownNameError, match="valid names are: toy"):
        reg.traits("nope")


@pytest.mark.parametrize("need, arg", [("needs_groups", "index"), ("needs_critic", "values"),
                                       ("needs_reward_baselines", "reward_baselines")])
def test_a_declared_need_must_be_an_argument(need, arg):
    reg = EstimatorRegistry()
    with pytest.raises(TypeError, match=f"declares that it needs {arg}"):
        reg.register("toy", **{need: True})(lambda token_level_rewards, response_mask: None)
    assert "toy" not in reg


def test_the_built_in_estimators_declare_what_the_config_checked_by_name():
    """The string sets that gpu_jobs/stages/config.py held before the registry carried traits."""
    def having(trait: str) -> set[str]:
        return {name for name in ADVANTAGE_ESTIMATORS if getattr(ADVANTAGE_ESTIMATORS.traits(name), trait)}

    assert having("needs_groups") == {"grpo", "rloo", "grpo_passk", "reinforce_plus_plus_baseline"}
    assert having("needs_critic") == {"gae"}
    assert having("needs_reward_baselines") == {"remax"}
    # advantage_kwargs: the config fields an estimator takes, as the hard-coded tuple gave them.
    for name in ADVANTAGE_ESTIMATORS:
        params = ADVANTAGE_ESTIMATORS.traits(name).params
        old = {k for k in ("gamma", "lam", "norm_adv_by_std_in_grpo", "epsilon") if k in params}  # epsilon: TRL parity
        assert set(AlgorithmConfig(adv_estimator=name).advantage_kwargs()) == old, name


# A user's estimator and engine, each one module, imported by a fresh interpreter: the global
# registries of this test process are left as they were, and nothing else in rlmill is edited.
ESTIMATOR_MODULE = '''
"""Median baseline: A_i = scale * gamma * (s_i - median of the group's scores)."""
import torch

from gpu_jobs.algos import register_adv_est


@register_adv_est("median_baseline", needs_groups=True)
@torch.no_grad()
def median_baseline(token_level_rewards, response_mask, index=None, gamma: float = 1.0, scale: float = 2.0):
    """token_level_rewards, response_mask: (bs, T); index: (bs,) group ids."""
    scores = (token_level_rewards * response_mask).sum(-1)
    groups = {g: [s for s, h in zip(scores.tolist(), index) if h == g] for g in index}
    median = torch.tensor([torch.tensor(groups[g]).median().item() for g in index], dtype=scores.dtype)
    adv = (scale * gamma * (scores - median))[:, None] * response_mask
    return adv, adv


@register_adv_est("value_baseline", needs_critic=True)
@torch.no_grad()
def value_baseline(token_level_rewards, response_mask, values=None):
    adv = (token_level_rewards - values) * response_mask
    return adv, adv
'''

ENGINE_MODULE = '''
"""A rollout engine that exists by name only (the config is all this test builds)."""
from gpu_jobs.rollout import register_rollout_engine


@register_rollout_engine("echo")
def echo_engine(model_path, config=None, **kwargs):
    raise NotImplementedError("config validation only")
'''

DRIVER = '''
import json, sys
import pyarrow as pa

import my_estimator, my_engine  # the only thing the user adds: their modules, imported
from flows.config import ConfigError, load_run_config
from gpu_jobs.stages.advantage_math import batch_advantages

out = {}
def refusal(overrides):
    try:
        load_run_config(None, overrides)
    except ConfigError as exc:
        return str(exc)

cfg = load_run_config(None, ["algorithm.adv_estimator=median_baseline", "algorithm.gamma=0.5", "rollout.n=3",
                             "rollout.engine=echo"])
out["engine"], out["kwargs"] = cfg.rollout.engine, cfg.algorithm.advantage_kwargs()
# Two prompts, three responses each, one token per response: scores (0, 1, 3) and (2, 2, 5).
table = pa.table({"group_id": ["a", "a", "a", "b", "b", "b"], "response_len": [1] * 6,
                  "response_ids": [[7]] * 6, "score": pa.array([0, 1, 3, 2, 2, 5], pa.float32())})
advantaged, metrics = batch_advantages(table, cfg, cfg.algorithm.kl_ctrl.build())
out["advantages"] = [a[0] for a in advantaged.column("advantages").to_pylist()]
out["metrics"] = sorted(k for k in metrics if k.startswith("critic/advantages"))
out["one_sample"] = refusal(["algorithm.adv_estimator=median_baseline", "rollout.n=1"])
out["no_critic"] = refusal(["algorithm.adv_estimator=value_baseline"])
out["with_critic"] = load_run_config(None, ["algorithm.adv_estimator=value_baseline", "critic.lr=1e-5"]).critic.lr
out["bad_engine"] = refusal(["rollout.engine=sglang"])
out["bad_verl_engine"] = refusal(["actor_rollout_ref.rollout.name=sglang"])
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def user_modules_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "my_estimator.py").write_text(textwrap.dedent(ESTIMATOR_MODULE))
    (folder / "my_engine.py").write_text(textwrap.dedent(ENGINE_MODULE))
    (folder / "driver.py").write_text(textwrap.dedent(DRIVER))
    env_path = f"{folder}:{REPO}"
    done = subprocess.run([sys.executable, str(folder / "driver.py")], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin", "HOME": str(folder)}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_new_estimator_runs_through_config_validation_and_the_advantages(user_modules_run):
    out = user_modules_run
    # algorithm.gamma is a config field the estimator takes; scale keeps its default of 2.
    assert out["kwargs"] == {"gamma": 0.5}
    # Group a: median 1 -> 2 * 0.5 * (0-1, 1-1, 3-1); group b: median 2 -> (0, 0, 3).
    assert out["advantages"] == [-1.0, 0.0, 2.0, 0.0, 0.0, 3.0]
    assert "critic/advantages/mean" in out["metrics"]
    # Its declared needs are the config's checks: groups need rollout.n >= 2, a critic a critic section.
    assert "median_baseline compares responses within a group: set rollout.n >= 2" in out["one_sample"]
    assert "algorithm.adv_estimator=value_baseline needs a critic" in out["no_critic"]
    assert out["with_critic"] == pytest.approx(1e-5)


def test_a_new_engine_name_is_valid_in_the_config(user_modules_run):
    out = user_modules_run
    assert out["engine"] == "echo"
    lines = out["bad_engine"].splitlines()
    assert lines[1:] == ["  rollout.engine: unknown rollout engine 'sglang'; valid names are: echo, hf, vllm"]
    assert "sglang" in out["bad_verl_engine"] and "'echo', 'hf', 'vllm'" in out["bad_verl_engine"]


def test_without_the_modules_the_names_are_unknown():
    from flows.config import ConfigError, load_run_config

    with pytest.raises(ConfigError, match="unknown advantage estimator 'median_baseline'"):
        load_run_config(None, ["algorithm.adv_estimator=median_baseline"])
    with pytest.raises(ConfigError, match="unknown rollout engine 'echo'; valid names are: hf, vllm"):
        load_run_config(None, ["rollout.engine=echo"])

"""Config keys that used to be accepted and do nothing, now doing what their help says in real
stages: critic.critic_warmup, the adaptive KL controller stepping once per committed
iteration (also across a retried commit), and pipeline parallelism refused in runs.

    .venv/bin/python -m pytest -q tests/flows/test_config_keys.py
"""

from __future__ import annotations

import pytest
import torch

from gpu_jobs import stages
from gpu_jobs.stages import Roles, Run, restore
from storage import read_manifest

pytestmark = pytest.mark.deepspeed

PPO = ("algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=4", "actor.recompute_old_logprobs=true")


def _open(cfg):
    run = Run.open(cfg)
    roles = Roles.load(run)
    restore(run, roles)
    return run, roles


def _batch(run, eng, k):
    rollout = stages.rollout(run, eng, k)
    batch = stages.gate(run, eng, k, rollout)
    reward = stages.reward(run, eng, k, batch)
    return batch, reward, stages.logprobs(run, eng, k, batch), stages.values(run, eng, k, batch)


def test_critic_warmup_updates_only_the_critic_first(example_path, tiny, tmp_path):
    from flows.config import load_run_config

    cfg = load_run_config(example_path.parent / "ppo_critic_arith.yaml",
                          tiny(str(tmp_path / "r"), *PPO[1:], "critic.critic_warmup=1", "run_id=warm"))
    run, eng = _open(cfg)
    actor0 = {k: v.clone() for k, v in eng.trainer.gathered_state_dict().items()}
    batch, reward, lp, vals = _batch(run, eng, 1)
    adv = stages.advantages(run, eng, 1, batch, reward, lp, vals)
    m1 = read_manifest(stages.update(run, eng, 1, adv), run.storage).metrics
    assert m1["critic/warmup"] == 1.0 and "actor/pg_loss" not in m1 and "critic/vf_loss" in m1
    assert all(torch.equal(actor0[k], v) for k, v in eng.trainer.gathered_state_dict().items())  # actor still
    stages.weights_to_rollout(run, eng, 1)
    batch, reward, lp, vals = _batch(run, eng, 2)
    adv = stages.advantages(run, eng, 2, batch, reward, lp, vals)
    m2 = read_manifest(stages.update(run, eng, 2, adv), run.storage).metrics
    assert m2["critic/warmup"] == 0.0 and "actor/pg_loss" in m2


def test_adaptive_kl_controller_steps_once_per_iteration_even_when_a_commit_is_retried(tiny_config, monkeypatch):
    import gpu_jobs.stages.shell as shell

    cfg = tiny_config("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                      "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_ctrl.target_kl=0.01")
    run, eng = _open(cfg)
    batch, reward, lp, _ = _batch(run, eng, 1)
    real, failed = shell.write_table, []

    def flaky_commit(*args, **kwargs):  # the first advantages commit fails, as a storage blip would
        if not failed:
            failed.append(1)
            raise ConnectionError("injected: commit failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(shell, "write_table", flaky_commit)
    with pytest.raises(ConnectionError):
        stages.advantages(run, eng, 1, batch, reward, lp)
    uri = stages.advantages(run, eng, 1, batch, reward, lp)  # the retry
    once = read_manifest(uri, run.storage).metrics["kl_ctrl_state"]
    ctrl = cfg.algorithm.kl_ctrl.build()  # one step from the initial value, by hand
    manifest = read_manifest(uri, run.storage)
    ctrl.update(manifest.metrics["actor/reward_kl_penalty"], manifest.num_rows)
    assert once["value"] == pytest.approx(ctrl.value) and once["value"] != 0.05
    # iteration 2 starts from the committed state, not from a twice-stepped one
    from gpu_jobs.stages.iteration import kl_controller_for

    assert kl_controller_for(run, 2).value == pytest.approx(once["value"])


def test_pipeline_parallelism_needs_ranks_it_can_split_over(tiny_config):
    from flows.config import ConfigError

    with pytest.raises(ConfigError, match=r"trainer.n_gpus_per_node x trainer.nnodes \(1\) must be a multiple"):
        tiny_config("actor.pipeline_parallel_size=2", "actor.zero_stage=1")
    with pytest.raises(ConfigError, match="set zero_stage to 0 or 1"):
        tiny_config("actor.pipeline_parallel_size=2", "actor.zero_stage=3", "trainer.n_gpus_per_node=2")
    cfg = tiny_config("actor.pipeline_parallel_size=2", "trainer.n_gpus_per_node=2", "actor.use_remove_padding=true")
    assert cfg.actor.resolved_zero_stage(1) == 0  # auto: one data-parallel rank per stage

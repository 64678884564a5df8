"""The critic: a scalar head on the LM, trained with the clipped value loss."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from gpu_jobs.train import Critic, CriticConfig, RefModel, ActorConfig, TrainInputError

pytestmark = pytest.mark.deepspeed


def test_critic_loss_decreases_on_a_fixed_batch(tiny_model, helpers):
    batch = helpers.make_batch(seed=21, prompts=4, n=2)
    returns = [(0.5 * np.sign(a)).tolist() for a in batch.column("advantages").to_pylist()]
    batch = batch.append_column("returns", pa.array(returns, pa.list_(pa.float32())))
    critic = Critic(tiny_model, CriticConfig(ppo_mini_batch_size=4, lr=3e-3, cliprange_value=0.5))
    with pytest.raises(TrainInputError, match="values"):
        critic.update(batch)  # values missing: run compute_values first
    losses, explained = [], []
    for _ in range(8):
        values = critic.compute_values(batch)
        assert [len(v) for v in values] == [len(r) for r in batch.column("response_ids").to_pylist()]
        table = batch.append_column("values", pa.array([v.tolist() for v in values], pa.list_(pa.float32())))
        m = critic.update(table)
        losses.append(m["critic/vf_loss"])
        explained.append(m["critic/vf_explained_var"])
        assert 0 <= m["critic/vf_clipfrac"] <= 1 and m["critic/grad_norm"] > 0
    assert losses[-1] < 0.5 * losses[0], losses
    assert explained[-1] > explained[0]


def test_critic_value_head_has_no_dropout(tiny_model):
    # classifier_dropout=0.0 must reach the model (transformers 5 ignores it as a from_pretrained
    # kwarg, which left a 0.1 dropout on the values the update trains on).
    import torch

    critic = Critic(tiny_model, CriticConfig())
    assert [m.p for m in critic.engine.module.modules() if isinstance(m, torch.nn.Dropout)] == [0.0]


def test_ref_model_log_probs_equal_the_policy_before_training(tiny_model, helpers):
    from gpu_jobs.train import PolicyTrainer

    batch = helpers.make_batch(seed=22, prompts=2, n=2)
    ref = RefModel(tiny_model, ActorConfig())
    assert ref.optimizer is None
    policy = PolicyTrainer(tiny_model, ActorConfig())
    for a, b in zip(ref.compute_log_probs(batch), policy.compute_log_probs(batch)):
        np.testing.assert_array_equal(a, b)


def test_critic_save_load_restores_values_and_step(tiny_model, helpers, tmp_path):
    batch = helpers.make_batch(seed=23, prompts=2, n=2)
    returns = [[1.0] * len(r) for r in batch.column("response_ids").to_pylist()]
    cfg = CriticConfig(ppo_mini_batch_size=2, lr=3e-3)
    critic = Critic(tiny_model, cfg)
    values = critic.compute_values(batch)
    table = batch.append_column("values", pa.array([v.tolist() for v in values], pa.list_(pa.float32())))
    table = table.append_column("returns", pa.array(returns, pa.list_(pa.float32())))
    critic.update(table)
    critic.save(str(tmp_path / "critic"))
    fresh = Critic(tiny_model, cfg)
    fresh.load(str(tmp_path / "critic"))
    assert fresh.step == 1
    for a, b in zip(fresh.compute_values(batch), critic.compute_values(batch)):
        np.testing.assert_array_equal(a, b)
    assert fresh.update(table)["critic/vf_loss"] == critic.update(table)["critic/vf_loss"]

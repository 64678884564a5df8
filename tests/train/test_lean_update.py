"""The leaner update: zero_stage "auto", old log-probs from the update's own forward, gradient
checkpointing and chunked entropy each give the results of the plain path (allclose)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from gpu_jobs.train import Critic, CriticConfig, PolicyTrainer, ActorConfig
from tests.train.update_gap import REORDER_REL, initial_weights, metric_approx, update_gap

pytestmark = pytest.mark.deepspeed

# The options under test are on by default (issue 24: memory first); CFG turns them off so that
# "plain" is the path without them and each test turns one on.
CFG = dict(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=3, ppo_epochs=2, lr=1e-3, eps=1e-6,
           entropy_coeff=0.01, seed=7, gradient_checkpointing=False, entropy_from_logits_with_chunking=False,
           kl_loss={"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl"})
METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/kl_loss",
           "actor/grad_norm")


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _assert_same(m, ref, table):
    """The same update in another float order: metrics and weights bounded as update_gap.py says."""
    for key in METRICS:
        assert m[key] == metric_approx(key, ref[key], table), key


def _assert_same_weights(got, ref, model_dir):
    gap = update_gap(got, ref, initial_weights(model_dir))
    print(f"\n||dw|| {gap:.2e} of the update")
    assert gap < REORDER_REL


@pytest.fixture(scope="module")
def batch(helpers):
    return helpers.make_batch(seed=1, prompts=4, n=2, ref=True)


@pytest.fixture(scope="module")
def plain(tiny_model, batch):
    """Per ZeRO stage: (metrics, weights) of the update with the options under test off."""
    out = {}
    for stage in (0, 3):
        trainer = PolicyTrainer(tiny_model, ActorConfig(**CFG, zero_stage=stage))
        out[stage] = (trainer.update(batch), trainer.gathered_state_dict())
    return out


def test_auto_zero_stage_runs_stage_0_on_one_rank(tiny_model, batch, plain):
    trainer = PolicyTrainer(tiny_model, ActorConfig(**CFG))
    assert trainer.config.zero_stage == "auto" and trainer.zero_stage == 0
    assert trainer.engine.zero_optimization_stage() == 0
    m = trainer.update(batch)
    _assert_same(m, plain[3][0], batch)  # grad_norm included: DeepSpeed records none at stage 0
    _assert_same_weights(trainer.gathered_state_dict(), plain[3][1], tiny_model)
    assert Critic(tiny_model, CriticConfig()).zero_stage == 0


@pytest.mark.parametrize("stage", [0, 3])
def test_old_logprobs_from_the_update_forward_equal_a_separate_pass(tiny_model, helpers, stage):
    # One optimizer step (ppo_epochs 1, one mini-batch of all 4 prompts): the weights have not
    # moved when a micro-batch is scored, so its forward's log-probs are the old ones.
    table = helpers.make_batch(seed=4, prompts=4, n=2, ref=True)
    cfg = {**CFG, "ppo_epochs": 1, "ppo_mini_batch_size": 4, "zero_stage": stage}
    fused = PolicyTrainer(tiny_model, ActorConfig(**cfg))
    m_fused = fused.update(table)
    assert m_fused["timing_s/old_log_prob"] == 0.0  # no separate pass ran

    two_pass = PolicyTrainer(tiny_model, ActorConfig(**cfg, recompute_old_logprobs=False))
    old = two_pass.compute_log_probs(table)  # the separate no-grad pass, as recompute does it
    with_old = table.append_column("old_logprobs", pa.array([o.tolist() for o in old], pa.list_(pa.float32())))
    m_two = two_pass.update(with_old)
    _assert_same(m_fused, m_two, table)
    assert m_fused["actor/ppo_kl"] == 0.0 and m_fused["actor/pg_clipfrac"] == 0.0
    _assert_same_weights(fused.gathered_state_dict(), two_pass.gathered_state_dict(), tiny_model)

    # Two mini-batches: the second is scored after a step, so the separate pass must run.
    several = PolicyTrainer(tiny_model, ActorConfig(**{**cfg, "ppo_mini_batch_size": 2}))
    assert several.update(table)["timing_s/old_log_prob"] > 0


@pytest.mark.parametrize("stage", [0, 3])
def test_gradient_checkpointing_gives_the_same_update(tiny_model, batch, plain, stage):
    trainer = PolicyTrainer(tiny_model, ActorConfig(**{**CFG, "zero_stage": stage, "gradient_checkpointing": True}))
    assert trainer.engine.module.is_gradient_checkpointing
    _assert_same(trainer.update(batch), plain[stage][0], batch)
    _assert_same_weights(trainer.gathered_state_dict(), plain[stage][1], tiny_model)


def test_critic_gradient_checkpointing_gives_the_same_update(tiny_model, helpers):
    table = helpers.make_batch(seed=21, prompts=4, n=2)
    returns = [(0.5 * np.sign(a)).tolist() for a in table.column("advantages").to_pylist()]
    table = table.append_column("returns", pa.array(returns, pa.list_(pa.float32())))
    out = []
    for ckpt in (False, True):
        critic = Critic(tiny_model, CriticConfig(ppo_mini_batch_size=2, lr=3e-3, gradient_checkpointing=ckpt))
        values = critic.compute_values(table)
        t = table.append_column("values", pa.array([v.tolist() for v in values], pa.list_(pa.float32())))
        out.append((critic.update(t), critic.gathered_state_dict()))
    assert out[1][0]["critic/vf_loss"] == pytest.approx(out[0][0]["critic/vf_loss"], rel=1e-6)
    assert _max_diff(out[1][1], out[0][1]) < 1e-6


@pytest.mark.parametrize("stage, packed", [(0, True), (0, False), (3, True)])
def test_entropy_chunking_gives_the_same_update(tiny_model, batch, plain, stage, packed):
    # Chunks of 5 tokens: every micro-batch spans several, and a chunk crosses rows.
    cfg = ActorConfig(**{**CFG, "zero_stage": stage, "use_remove_padding": packed,
                         "entropy_from_logits_with_chunking": True, "entropy_chunk_size": 5})
    trainer = PolicyTrainer(tiny_model, cfg)
    before = PolicyTrainer(tiny_model, ActorConfig(**CFG, zero_stage=stage)).compute_log_probs(batch)
    for a, b in zip(trainer.compute_log_probs(batch), before):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)
    _assert_same(trainer.update(batch), plain[stage][0], batch)
    _assert_same_weights(trainer.gathered_state_dict(), plain[stage][1], tiny_model)

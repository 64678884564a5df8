"""use_remove_padding: a micro-batch packed into one row (position_ids restarting per row) gives
the padded layout's logits, log-probs, values and gradients on the built-in model, and the same
whole update (ZeRO-3, policy and critic) on the random tiny one.

The batch mixes prompt lengths (left padding in the padded layout) and response lengths (right
padding), down to one-token responses, so a row that attended across its neighbour, or a position
id off by one, would move the numbers by whole units, far past the tolerances (float32 sums in
another order differ by ~1e-5 of a tensor's largest entry here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_jobs.train import Critic, CriticConfig, PolicyTrainer, ActorConfig
from tests.train.update_gap import REORDER_REL, initial_weights, metric_approx, update_gap

pytestmark = pytest.mark.deepspeed

CFG = dict(ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=4, ppo_epochs=2, lr=1e-3, eps=1e-6,
           entropy_coeff=0.01, seed=11, recompute_old_logprobs=False,
           kl_loss={"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl"})


@pytest.fixture(scope="module")
def builtin():
    from gpu_jobs.models import ensure_builtin_model

    return ensure_builtin_model()


@pytest.fixture(scope="module")
def batch(helpers):
    # Prompts of 2-12 tokens, responses of 1-14: every row is padded on one side or both.
    table = helpers.make_batch(seed=5, prompts=6, n=2, ref=True, old=True, max_prompt=12, max_response=14)
    lens = [len(r) for r in table.column("response_ids").to_pylist()]
    assert min(lens) == 1 and len(set(lens)) > 5
    return table


def _backward(module, loss):
    """Gradients of ``loss`` on a ZeRO-0 module's own parameters; no optimizer step."""
    module.engine.set_gradient_accumulation_boundary(True)
    module.engine.backward(loss, scale_wrt_gas=False)  # DeepSpeed refuses a bare autograd call
    return [p.grad.detach().clone() for p in module.engine.module.parameters()]


def _grads(trainer, table):
    """Policy gradients and metrics of one micro-batch holding every row."""
    from gpu_jobs.algos import get_policy_loss_fn
    from gpu_jobs.train.policy import required_columns

    rows = trainer._read(table, required_columns(trainer.config, table))
    mb = trainer._collate(rows, list(range(len(rows))), fallback=0)
    trainer.engine.train()
    loss, metrics = trainer._loss(mb, get_policy_loss_fn(trainer.config.policy_loss.loss_mode))
    return _backward(trainer, loss), {k: float(v) for k, v in metrics.items()}


def _critic_table(table, values):
    import pyarrow as pa

    returns = [(0.5 * np.sign(a)).tolist() for a in table.column("advantages").to_pylist()]
    # values + 0.1: some predictions land outside the clip range, so both branches carry gradient
    table = table.append_column("values", pa.array([(v + 0.1).tolist() for v in values], pa.list_(pa.float32())))
    return table.append_column("returns", pa.array(returns, pa.list_(pa.float32())))


def _padded_and_packed_logits(model, rows, impl):
    """Response logits of ``rows`` [(prompt, response)] through a plain HF model, padded (2D mask;
    ``impl``, or sdpa for ours) and packed (``impl``; one row, restarting position_ids, no mask),
    each ``(tokens, V)``."""
    model.set_attn_implementation(impl if impl in ("sdpa", "eager") else "sdpa")
    P, R = max(len(p) for p, _ in rows), max(len(r) for _, r in rows)
    ids = torch.zeros(len(rows), P + R, dtype=torch.long)
    att = torch.zeros_like(ids)
    for j, (p, r) in enumerate(rows):
        ids[j, P - len(p) : P], ids[j, P : P + len(r)] = torch.tensor(p), torch.tensor(r)
        att[j, P - len(p) : P + len(r)] = 1
    pos = (att.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False).logits
    padded = torch.cat([out[j, P - 1 : P - 1 + len(r)] for j, (_, r) in enumerate(rows)])
    flat = torch.tensor([t for p, r in rows for t in p + r])[None]
    pos = torch.tensor([i for p, r in rows for i in range(len(p) + len(r))])[None]
    cu = torch.tensor(np.cumsum([0] + [len(p) + len(r) for p, r in rows]), dtype=torch.int32)
    # use_cache=False matters: with a cache transformers does not look for packed rows at all.
    model.set_attn_implementation(impl)
    out = model(input_ids=flat, position_ids=pos, cu_seq_lens_q=cu, use_cache=False).logits[0]
    starts = cu[:-1].tolist()
    packed = torch.cat([out[s + len(p) - 1 : s + len(p) - 1 + len(r)] for s, (p, r) in zip(starts, rows)])
    return padded, packed


@pytest.mark.parametrize("attn", ["sdpa", "eager", "packed"])
def test_transformers_keeps_packed_rows_apart(builtin, batch, attn):
    # "sdpa"/"eager": transformers reads restarting position_ids (attention_mask=None) as packed rows
    # and builds the block-diagonal causal mask itself (the path for sliding-window models).
    # "packed": our per-row SDPA, which builds no mask at all.
    from transformers import AutoModelForCausalLM

    from gpu_jobs.train.attention import attention_for_packing

    model = AutoModelForCausalLM.from_pretrained(builtin, dtype=torch.float32)
    impl = attention_for_packing(model.config) if attn == "packed" else attn
    d = batch.to_pydict()
    with torch.no_grad():
        padded, packed = _padded_and_packed_logits(model, list(zip(d["prompt_ids"], d["response_ids"])), impl)
    # Logits reach ~25 in the trained model; a row attending across its neighbour moves them by 1-25.
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-4)


def test_packed_log_probs_and_gradients_equal_padded(builtin, batch):
    padded = PolicyTrainer(builtin, ActorConfig(**CFG, use_remove_padding=False))
    packed = PolicyTrainer(builtin, ActorConfig(**CFG, use_remove_padding=True))
    assert packed.engine.module.config._attn_implementation == "rlmill_packed_sdpa"
    for a, b in zip(packed.compute_log_probs(batch), padded.compute_log_probs(batch)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)
    g_packed, m_packed = _grads(packed, batch)
    g_padded, m_padded = _grads(padded, batch)
    for a, b in zip(g_packed, g_padded):  # float noise is ~1e-5 of a tensor's largest entry
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    assert max(g.abs().max().item() for g in g_padded) > 1e-3  # not trivially zero
    for key, v in m_padded.items():
        assert m_packed[key] == pytest.approx(v, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("dynamic", [False, True], ids=["rows", "token-budget"])
def test_packed_update_equals_padded_under_zero3(tiny_model, batch, dynamic):
    # ZeRO-3 (what several ranks run), 2 epochs x shuffled mini-batches x uneven micro-batches.
    # On the random tiny model: in the trained built-in one some weights get gradients near Adam's
    # eps, where float noise of any kind (ZeRO-0 vs 3, micro-batch 1 vs 4: ~1e-4 after 4 steps)
    # is amplified into the weights; the gradients themselves are compared above. The weights are
    # bounded by update_gap, as a fraction of the update's norm (tests/train/update_gap.py says why).
    extra = {"zero_stage": 3, "use_dynamic_bsz": dynamic, "ppo_max_token_len_per_gpu": 60}
    padded = PolicyTrainer(tiny_model, ActorConfig(**CFG, **extra, use_remove_padding=False))
    packed = PolicyTrainer(tiny_model, ActorConfig(**CFG, **extra, use_remove_padding=True))
    m_padded, m_packed = padded.update(batch), packed.update(batch)
    gap = update_gap(packed.gathered_state_dict(), padded.gathered_state_dict(), initial_weights(tiny_model))
    print(f"\npacked vs padded: ||dw|| {gap:.2e} of the update")
    assert gap < REORDER_REL
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm", "actor/ppo_kl"):
        assert m_packed[key] == metric_approx(key, m_padded[key], batch), key


def test_critic_packed_equals_padded(builtin, tiny_model, batch):
    from gpu_jobs.train.batch import read_rows

    cfg = dict(ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=4, lr=3e-3, seed=2)
    padded = Critic(builtin, CriticConfig(**cfg, use_remove_padding=False))
    packed = Critic(builtin, CriticConfig(**cfg, use_remove_padding=True))
    values = padded.compute_values(batch)
    for a, b in zip(packed.compute_values(batch), values):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)
    table = _critic_table(batch, values)
    grads = []
    for critic in (packed, padded):
        mb = critic._collate(read_rows(table, vocab_size=99), list(range(table.num_rows)), fallback=0)
        critic.engine.train()
        grads.append(_backward(critic, critic._loss(mb)[0]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())

    # A whole update (2 mini-batches, uneven micro-batches); on the random tiny model, as above.
    out = []
    for packing in (True, False):
        critic = Critic(tiny_model, CriticConfig(**cfg, use_remove_padding=packing))
        init = critic.gathered_state_dict()  # the value head is not in the checkpoint
        out.append((critic.update(_critic_table(batch, critic.compute_values(batch))), critic.gathered_state_dict()))
    gap = update_gap(out[0][1], out[1][1], init)
    print(f"\ncritic packed vs padded: ||dw|| {gap:.2e} of the update")
    assert gap < REORDER_REL
    assert out[0][0]["critic/vf_loss"] == metric_approx("critic/vf_loss", out[1][0]["critic/vf_loss"], batch)

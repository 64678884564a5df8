"""The preference update (PolicyTrainer.preference_update) against a plain-PyTorch DPO step, on the
optimizer-step loop every update shares (loop.update_steps / loop.optimizer_step), and the
trainers that cannot run one saying so.

The reference runs each row unpadded through a plain HF model, sums its response log-probs, takes
dpo_loss over all pairs and steps torch AdamW with clip_grad_norm_: equal weights check the
micro-batch shares, clipping, the lr schedule and the optimizer wiring of the preference update.

    .venv/bin/python -m pytest -q tests/train/test_preference_update.py
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from gpu_jobs.algos.preference import PreferenceConfig
from gpu_jobs.train import ActorConfig, PolicyTrainer
from gpu_jobs.train.preference import PreferenceBatch
from tests.train.update_gap import REORDER_REL, initial_weights, update_gap

pytestmark = pytest.mark.deepspeed

DPO = PreferenceConfig(algorithm="dpo", beta=0.1)
CFG = dict(ppo_mini_batch_size=4, ppo_epochs=2, lr=1e-3, grad_clip=0.5, shuffle=False, seed=3, zero_stage=0)


def pairs_table(units: int = 4, seed: int = 0, roles=("chosen", "rejected")) -> pa.Table:
    """``units`` units of one row per role sharing a prompt, random responses and ref log-probs."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(units):
        prompt = rng.integers(1, 64, rng.integers(2, 6)).tolist()
        for role in roles:
            n = int(rng.integers(1, 6))
            rows.append({"prompt_ids": prompt, "response_ids": rng.integers(1, 64, n).tolist(),
                         "ref_logprobs": (-4.2 + 0.1 * rng.normal(size=n)).tolist(), "role": role, "unit": u})
    schema = pa.schema([("prompt_ids", pa.list_(pa.int32())), ("response_ids", pa.list_(pa.int32())),
                        ("ref_logprobs", pa.list_(pa.float32())), ("role", pa.string()), ("unit", pa.int64())])
    return pa.Table.from_pylist(rows, schema=schema)


def reference_dpo(model_dir: str, table: pa.Table, cfg: ActorConfig) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain torch: ppo_epochs AdamW steps, each on dpo_loss over every pair of ``table``.
    Returns the weights and each step's pre-clip gradient norm."""
    from transformers import AutoModelForCausalLM

    from gpu_jobs.algos.preference import dpo_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    d, norms = table.to_pydict(), []
    for _ in range(cfg.ppo_epochs):
        seq, ref = {"chosen": [], "rejected": []}, {"chosen": [], "rejected": []}
        for p, r, lp, role in zip(d["prompt_ids"], d["response_ids"], d["ref_logprobs"], d["role"]):
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1].float()
            seq[role].append(torch.log_softmax(logits, -1)[torch.arange(len(r)), torch.tensor(r)].sum())
            ref[role].append(torch.tensor(lp).sum())
        loss, _ = dpo_loss(torch.stack(seq["chosen"]), torch.stack(seq["rejected"]), torch.stack(ref["chosen"]),
                           torch.stack(ref["rejected"]), **DPO.loss_kwargs())
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


@pytest.mark.parametrize("micro", [1, 4])
def test_dpo_update_matches_plain_torch_whatever_the_micro_batching(tiny_model, micro):
    cfg = ActorConfig(**CFG, ppo_micro_batch_size_per_gpu=micro)
    table = pairs_table()
    trainer = PolicyTrainer(tiny_model, cfg)
    init = initial_weights(tiny_model)
    metrics = trainer.preference_update(table, DPO)
    ref, norms = reference_dpo(tiny_model, table, cfg)
    assert update_gap(trainer.gathered_state_dict(), ref, init) < REORDER_REL
    # Adam and clipping hide a loss scaled by a constant from the weights: the norm shows it.
    assert metrics["actor/grad_norm"] == pytest.approx(np.mean(norms), rel=1e-4) and min(norms) > cfg.grad_clip
    assert (trainer.step, trainer.samples_seen) == (1, len(table))
    assert metrics["actor/lr"] == cfg.lr_at(0)
    assert {"rewards/accuracies", "rewards/margins", "actor/preference_loss"} <= set(metrics)


def test_preference_and_policy_updates_share_the_step_count_and_lr_schedule(tiny_model, helpers):
    """One loop (loop.update_steps) sets the lr of both update kinds from the same update count."""
    cfg = ActorConfig(**{**CFG, "ppo_epochs": 1}, ppo_micro_batch_size_per_gpu=2, lr_warmup_steps=4,
                      recompute_old_logprobs=True)
    trainer = PolicyTrainer(tiny_model, cfg)
    assert trainer.update(helpers.make_batch(0))["actor/lr"] == cfg.lr_at(0)
    assert trainer.preference_update(pairs_table(), DPO)["actor/lr"] == cfg.lr_at(1) != cfg.lr_at(0)
    assert trainer.update(helpers.make_batch(1))["actor/lr"] == cfg.lr_at(2)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [cfg.lr_at(2)] * len(trainer.optimizer.param_groups)


def test_micro_batches_hold_whole_units_and_their_shares_add_up():
    kto = PreferenceBatch.of(pairs_table(3, roles=("desirable", "undesirable", "kl")), PreferenceConfig(algorithm="kto"))
    assert kto.units == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and kto.counts == [2, 2, 2]
    (mini,) = kto.minibatches(per_step=6, generator=None)
    micros = kto.micro_batches(mini, micro_size=4)  # KTO: one group per micro-batch, whatever the size
    assert [rows for rows, _ in micros] == kto.units and sum(s for _, s in micros) == pytest.approx(1.0)
    dpo = PreferenceBatch.of(pairs_table(5), DPO)
    minis = dpo.minibatches(per_step=2, generator=torch.Generator().manual_seed(0))
    assert sorted(u for mini in minis for u in map(tuple, mini)) == sorted(map(tuple, dpo.units))
    assert [len(m) for m in minis] == [2, 2, 1]
    micros = dpo.micro_batches(minis[0], micro_size=1)
    assert [s for _, s in micros] == [0.5, 0.5] and all(len(rows) == 2 for rows, _ in micros)


def test_trainers_without_a_preference_update_say_so():
    """Rank groups and pipelines train preference runs nowhere (the run config refuses them
    first): the protocol's method raises a clear NotImplementedError, never AttributeError."""
    from gpu_jobs.train.pipeline import PipelinePolicyTrainer
    from gpu_jobs.train.ranks.trainer import GroupTrainer

    group = GroupTrainer.__new__(GroupTrainer)  # no model, no ranks: the refusal needs neither
    group.world_size = 2
    with pytest.raises(NotImplementedError, match="2-rank group cannot run preference .*trainer.n_gpus_per_node=1"):
        group.preference_update(pairs_table(), DPO)
    with pytest.raises(NotImplementedError, match="PipelinePolicyTrainer cannot run preference"):
        PipelinePolicyTrainer.__new__(PipelinePolicyTrainer).preference_update(pairs_table(), DPO)

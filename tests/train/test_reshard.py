"""Resuming with another world size or ZeRO stage keeps the Adam state (gpu_jobs.train.reshard).

    .venv/bin/python -m pytest -q tests/train/test_reshard.py

The layout math on hand-made shards; 1-rank loads across ZeRO stages in-process; and a warm
2-rank group (zero_stage auto: ZeRO-3 on 2 ranks, ZeRO-0 on 1) resumed on 1 rank and back, the
moments checked exactly against DeepSpeed's own shard merge (zero_to_fp32) and torch's state.
"""

from __future__ import annotations

import glob
import logging
import os

import pytest
import torch

from gpu_jobs.train import PolicyTrainer, ActorConfig
from gpu_jobs.train.reshard import merge_zero3, merge_zero12, zero3_local_slice, zero3_partition_numel
from tests.train.update_gap import REORDER_REL, update_gap

KEYS = ("exp_avg", "exp_avg_sq")
# The step after a resume, in another layout (1 vs 2 ranks, ZeRO-0 vs 2/3), sums in another order:
# it is compared as update_gap, the gap as a fraction of how far that step moved the weights, below
# REORDER_REL (tests/train/update_gap.py says why). Resetting the moments makes Adam's step another
# step altogether (sign(g) * lr instead of m / sqrt(v) * lr), a gap of order 1: the test checks it
# lands above REORDER_REL, or it proves nothing.
CFG = dict(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1, lr=1e-3, eps=1e-6, seed=5,
           kl_loss={"use_kl_loss": True, "kl_loss_coef": 0.1})


def _cfg(**kw) -> ActorConfig:
    return ActorConfig(**{**CFG, **kw})


# ---- layout math --------------------------------------------------------------------------
def test_merge_zero3_hand_case_and_round_trip():
    # Two parameters of 5 and 2 elements over 2 ranks: pieces of ceil(5/2)=3 and 1. Rank 0 holds
    # [a0 a1 a2 | b0], rank 1 [a3 a4 pad | b1]: the last piece of a is padded with one zero.
    rank0 = torch.tensor([0., 1., 2., 10.])
    rank1 = torch.tensor([3., 4., 0., 11.])
    a, b = merge_zero3([rank0, rank1], [5, 2])
    assert a.tolist() == [0., 1., 2., 3., 4.] and b.tolist() == [10., 11.]
    assert zero3_partition_numel(5, 2) == 3 and zero3_partition_numel(4, 2) == 2
    assert zero3_local_slice(a, 1, 2).tolist() == [3., 4., 0.]
    # Any parameter cut for 3 ranks and merged again is itself.
    w = torch.randn(7, 3)
    pieces = [zero3_local_slice(w, r, 3) for r in range(3)]
    assert torch.equal(merge_zero3(pieces, [21])[0].reshape(7, 3), w)


def test_merge_zero3_refuses_shards_that_do_not_fit():
    with pytest.raises(ValueError, match="do not belong together"):
        merge_zero3([torch.zeros(4), torch.zeros(4)], [5])  # needs 3 per rank


def test_merge_zero12_skips_alignment_padding():
    # One group over 2 ranks: a (3 elements) + 1 alignment element, b (2), then padding to a
    # multiple of 2 * world_size = 4: [a0 a1 a2 _ | b0 b1 _ _] split in two partitions of 4.
    rank0, rank1 = torch.tensor([0., 1., 2., -1.]), torch.tensor([5., 6., -1., -1.])
    a, b = merge_zero12([rank0, rank1], [3, 2], [1, 0])
    assert a.tolist() == [0., 1., 2.] and b.tolist() == [5., 6.]
    with pytest.raises(ValueError, match="do not belong together"):
        merge_zero12([rank0, rank1], [3, 2, 8], [1, 0, 0])


# ---- live engines -------------------------------------------------------------------------
def _live_state(trainer) -> dict[str, list[torch.Tensor]]:
    """Per trained parameter [fp32 weight, exp_avg, exp_avg_sq], whole, read through DeepSpeed's
    own API (ZeRO-1/2/3) or torch's optimizer state (ZeRO-0). One rank, in-process."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in trainer.engine.module.named_parameters():
        if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
            out[name] = [safe_get_full_fp32_param(p)] + [safe_get_full_optimizer_state(p, k) for k in KEYS]
        else:
            out[name] = [p.detach()] + [trainer.optimizer.state[p][k] for k in KEYS]
    return {n: [t.reshape(-1).clone() for t in ts] for n, ts in out.items()}


def _reset_moments(trainer) -> None:
    """What loading did before resharding: weights kept, Adam state as a fresh optimizer's."""
    for state in trainer.optimizer.state.values():
        for k in KEYS:
            state[k].zero_()
        state["step"].zero_()


@pytest.mark.deepspeed
@pytest.mark.parametrize("saved_stage, loaded_stage", [(2, 0), (0, 3)])
def test_one_rank_load_across_zero_stages_keeps_adam_state(tied_model, helpers, tmp_path,
                                                           saved_stage, loaded_stage, caplog):
    batches = [helpers.make_batch(seed=60 + i, ref=True) for i in range(3)]
    src = PolicyTrainer(tied_model, _cfg(zero_stage=saved_stage))
    for batch in batches[:2]:
        src.update(batch)
    src.save(str(tmp_path / "ckpt"))
    expected = _live_state(src)

    dst = PolicyTrainer(tied_model, _cfg(zero_stage=loaded_stage))
    with caplog.at_level(logging.INFO, logger="gpu_jobs.train"):
        dst.load(str(tmp_path / "ckpt"))
    assert "Adam state (exp_avg, exp_avg_sq, step) resharded" in caplog.text
    assert "starts fresh" not in caplog.text
    got = _live_state(dst)
    assert got.keys() == expected.keys()
    for name in expected:  # weights and both moments, exactly
        for what, a, b in zip(("weight", *KEYS), expected[name], got[name]):
            assert torch.equal(a, b), (name, what)

    before = src.gathered_state_dict()
    src.update(batches[2])
    dst.update(batches[2])
    diff = update_gap(dst.gathered_state_dict(), src.gathered_state_dict(), before)
    assert diff < REORDER_REL
    print(f"\nZeRO-{saved_stage} -> ZeRO-{loaded_stage}: next step ||dw|| {diff:.2e} of the step")


# ---- 2 ranks ------------------------------------------------------------------------------
def _ckpt_dir(url: str) -> str:
    (found,) = glob.glob(os.path.join(url, "*", "zero"))
    return found


def _deepspeed_gathered(url: str) -> dict[str, dict[str, torch.Tensor]]:
    """Adam moments and step per parameter from a ZeRO-3 checkpoint, merged by DeepSpeed's own
    zero_to_fp32 code (the reference: reshard's merge is separate code)."""
    from deepspeed.utils import zero_to_fp32 as z

    folder = _ckpt_dir(url)
    models = z.parse_model_states(z.get_model_state_files(folder))
    optim = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
             for f in z.get_optim_files(folder)]
    assert int(optim[0]["zero_stage"]) == 3 and len(optim) == 2
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key in KEYS:
        flats = [[o["optimizer_state_dict"]["state"][i][key] for i in range(len(o["fp32_flat_groups"]))]
                 for o in optim]
        merged: dict = {}
        z._zero3_merge_trainable_params(merged, len(optim), flats, models)
        for name, t in merged.items():
            out.setdefault(name, {})[key] = t.contiguous().reshape(-1)
    (step,) = {float(s["step"]) for o in optim for s in o["optimizer_state_dict"]["state"].values()}
    for moments in out.values():
        moments["step"] = step
    return out


def _torch_moments(trainer) -> dict[str, dict[str, torch.Tensor]]:
    return {n: {**{k: trainer.optimizer.state[p][k].reshape(-1) for k in KEYS},
                "step": float(trainer.optimizer.state[p]["step"])}
            for n, p in trainer.engine.module.named_parameters()}


def _assert_moments_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        for k in KEYS:
            assert torch.equal(a[name][k], b[name][k]), (name, k)
        assert a[name]["step"] == b[name]["step"] > 0, name


@pytest.mark.deepspeed
@pytest.mark.slow
def test_two_ranks_zero3_resume_on_one_rank_zero0_and_back(tied_model, helpers, tmp_path):
    from gpu_jobs.train.ranks.trainer import GroupTrainer

    batches = [helpers.make_batch(seed=70 + i, ref=True) for i in range(4)]
    a, c, b = (str(tmp_path / n) for n in ("two_ranks", "two_ranks_again", "one_rank"))
    group = GroupTrainer(tied_model, _cfg(), n_ranks=2)  # zero_stage auto: 3 on 2 ranks
    try:
        for batch in batches[:2]:
            group.update(batch)
        group.save(a)
        group.update(batches[2])  # the 2-rank run going on from checkpoint a
        two = group.gathered_state_dict()

        # 2 -> 1 (ZeRO-3 -> ZeRO-0): every moment as DeepSpeed's merge of the shards, exactly.
        one = PolicyTrainer(tied_model, _cfg())
        assert one.zero_stage == 0 and group.rank_info()[0]["zero_stage"] == 3
        one.load(a)
        assert one.step == 2  # update() calls; Adam's step (one per mini-batch) is checked below
        _assert_moments_equal(_torch_moments(one), _deepspeed_gathered(a))
        at_a = one.gathered_state_dict()
        one.update(batches[2])
        diff = update_gap(one.gathered_state_dict(), two, at_a)
        assert diff < REORDER_REL

        # The same comparison fails when the moments start fresh (the old behaviour).
        reset = PolicyTrainer(tied_model, _cfg())
        reset.load(a)
        _reset_moments(reset)
        reset.update(batches[2])
        reset_diff = update_gap(reset.gathered_state_dict(), two, at_a)
        assert reset_diff > REORDER_REL

        # 1 -> 2 (ZeRO-0 -> ZeRO-3): the group loads the 1-rank state and saves it again as
        # 2-rank shards; merged back they are torch's moments, exactly; the next steps agree.
        one.save(b)
        group.load(b)
        assert group.step == 3
        group.save(c)
        _assert_moments_equal(_deepspeed_gathered(c), _torch_moments(one))
        at_b = one.gathered_state_dict()
        group.update(batches[3])
        one.update(batches[3])
        back_diff = update_gap(group.gathered_state_dict(), one.gathered_state_dict(), at_b)
        assert back_diff < REORDER_REL
    finally:
        group.close()
    print(f"\n2->1 next step ||dw|| {diff:.2e} of the step (moments reset: {reset_diff:.2e}); "
          f"1->2 next step {back_diff:.2e}")

"""How far two computations of the same update land apart, measured against the update's own size.

    from tests.train.update_gap import REORDER_REL, update_gap
    assert update_gap(got, ref, init) < REORDER_REL

Tests that run one update two ways (2 ranks vs 1, ZeRO 0 vs 3, a pipeline vs one rank, packed vs
padded, micro-batches of 1 vs 3) sum the same terms in another order, so float32 rounding separates
them, and how much depends on the CPU's kernels (AVX2 vs AVX-512 reduce in other orders). An
absolute bound on max |dw| is a number tuned on one processor: Adam divides each gradient by its
own running scale, so an entry whose gradient is within rounding of zero can take a full step of
either sign, and max |dw| can reach the size of the update itself (2.7e-4 against steps of 1e-4 on
an AMD EPYC box). Those entries are few, so the gap over all weights stays a tiny fraction of the
update's norm. That fraction is what these tests bound.
"""

from __future__ import annotations

from typing import Mapping

import pytest
import torch

# Why 1e-2. If a fraction f of the weights took the opposite Adam step in one run (the worst rounding
# can do to an entry whose gradient is within rounding of zero), the gap would be ~2 sqrt(f): 1e-2
# allows f ~ 2.5e-5 of all entries flipped outright, far more than rounding flips. Measured on an
# Intel Xeon: ZeRO-0 vs 3, micro-batches of 1 vs 3, packed vs padded, pipeline vs 1 rank, 2 ranks vs
# 1 land 0.4e-6-1.9e-6 of the update apart on the random tiny model (lr 1e-3 and 1e-4), 6.7e-5 on the
# trained built-in model (tests/train/test_group.py, whose gradients sit nearer Adam's eps). Real
# bugs move the weights by a large fraction of the update (tests/train/test_lean_update.py's CFG,
# 4 steps): one micro-batch's loss scaled x2 in each mini-batch 0.25-0.29, one micro-batch's
# gradient dropped 0.51-0.52, Adam's moments reset on resume 1.5 (tests/train/test_reshard.py).
# (Every loss doubled is nearly invisible to Adam, 1.7e-6 at lr 1e-4: actor/grad_norm catches it.)
# So 1e-2 is 150x above the largest rounding gap measured and 25x below the smallest bug.
REORDER_REL = 1e-2


def update_gap(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor],
               init: Mapping[str, torch.Tensor]) -> float:
    """||got - ref|| / ||ref - init|| over every weight of `got` (float64 sums): how far `got`
    lands from the reference update, as a fraction of how far that update moved the weights. A
    name missing from `init` must be a tied alias (lm_head.weight of a tied model), counted once."""
    assert set(got) <= set(ref), set(got) - set(ref)
    keys = [k for k in got if k in init]
    for k in set(got) - set(keys):
        assert torch.equal(ref[k], ref["model.embed_tokens.weight"]), f"{k} is not in init"
    gap = sum(((got[k].double() - ref[k].double()) ** 2).sum() for k in keys)
    moved = sum(((ref[k].double() - init[k].double()) ** 2).sum() for k in keys)
    assert moved > 0, "the reference update did not move the weights: nothing to compare"
    return float((gap / moved) ** 0.5)


def initial_weights(model_dir: str) -> dict[str, torch.Tensor]:
    """The float32 weights a trainer starts from (the checkpoint's safetensors)."""
    import glob
    import os

    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        out.update({k: v.float() for k, v in load_file(f).items()})
    return out


def metric_approx(key: str, ref: float, table) -> object:
    """pytest.approx for an update metric of the same update computed in another order. After the
    first step the metrics are taken at weights REORDER_REL of the update apart, so they may differ
    by that fraction of their own size. actor/pg_loss is a mean of -A * ratio that cancels near 0,
    so its size is the batch's mean |advantage| per token rather than its value."""
    scale = 0.0
    if key == "actor/pg_loss":
        adv = [abs(a) for row in table.column("advantages").to_pylist() for a in row]
        scale = sum(adv) / len(adv)
    return pytest.approx(ref, rel=REORDER_REL, abs=REORDER_REL * scale)

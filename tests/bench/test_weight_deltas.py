"""The delta-size arithmetic of benchmarks/weight_deltas.py on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from benchmarks.weight_deltas import delta_sizes


def test_unchanged_weights_cost_no_sparse_bytes_and_compress_to_almost_nothing():
    w = {"a": torch.randn(64, 64), "b": torch.randn(100)}
    sizes = delta_sizes(w, {k: v.clone() for k, v in w.items()})
    assert sizes["sparse bf16"] == 0 and sizes["elements"] == 64 * 64 + 100
    assert sizes["full fp32"] == 4 * sizes["elements"]
    assert sizes["xor fp32 + zlib"] < 0.02 * sizes["full fp32"]  # all-zero words


def test_one_changed_bf16_value_is_one_six_byte_pair():
    old = {"a": torch.zeros(10)}
    new = {"a": torch.zeros(10)}
    new["a"][3] = 1.0  # representable in bf16: a real change
    assert delta_sizes(old, new)["sparse bf16"] == 6
    # A change below bf16's resolution moves the fp32 word but not the bf16 one.
    tiny = {"a": torch.full((10,), 1.0)}
    nudged = {"a": tiny["a"] + 1e-6}
    sizes = delta_sizes(tiny, nudged)
    assert sizes["sparse bf16"] == 0 and sizes["xor fp32 + zlib"] > 0


def test_mismatched_state_dicts_are_refused():
    with pytest.raises(ValueError, match="different tensors"):
        delta_sizes({"a": torch.zeros(2)}, {"b": torch.zeros(2)})
    with pytest.raises(ValueError, match="shape"):
        delta_sizes({"a": torch.zeros(2)}, {"a": torch.zeros(3)})

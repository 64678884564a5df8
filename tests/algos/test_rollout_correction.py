"""Rollout correction (truncated importance sampling and rejection), hand-computed.

    .venv/bin/python -m pytest -q tests/algos/test_rollout_correction.py
"""

from __future__ import annotations

import math

import pytest
import torch

from gpu_jobs.algos import (RolloutCorrectionConfig, UnknownNameError, rollout_correction_metrics,
                            rollout_is_weights, rollout_rs_mask)

# Two responses: row 0 has 2 tokens, row 1 has 1 token (its second slot is padding).
# ratios p_old / p_rollout: row 0 -> (1.5, 4.0), row 1 -> (0.25, garbage)
OLD = torch.log(torch.tensor([[0.3, 0.4], [0.1, 0.9]]))
ROLLOUT = torch.log(torch.tensor([[0.2, 0.1], [0.4, 0.1]]))
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def test_token_level_weights_are_truncated_ratios():
    w = rollout_is_weights(OLD, ROLLOUT, MASK, "token", threshold=2.0)
    # 1.5 kept, 4.0 truncated to C = 2, 0.25 kept (TIS truncates above only), padding 0
    assert torch.allclose(w, torch.tensor([[1.5, 2.0], [0.25, 0.0]]))


def test_sequence_level_weight_is_the_product_over_the_response():
    w = rollout_is_weights(OLD, ROLLOUT, MASK, "sequence", threshold=10.0)
    # row 0: 1.5 * 4.0 = 6.0 on both tokens; row 1: 0.25 on its one token
    assert torch.allclose(w, torch.tensor([[6.0, 6.0], [0.25, 0.0]]))
    assert torch.allclose(rollout_is_weights(OLD, ROLLOUT, MASK, "sequence", threshold=2.0),
                          torch.tensor([[2.0, 2.0], [0.25, 0.0]]))


def test_rejection_masks_tokens_or_whole_responses_outside_the_bounds():
    keep = rollout_rs_mask(OLD, ROLLOUT, MASK, "token", lower=0.5, upper=2.0)
    assert torch.equal(keep, torch.tensor([[1.0, 0.0], [0.0, 0.0]]))  # 4.0 and 0.25 are out
    keep = rollout_rs_mask(OLD, ROLLOUT, MASK, "sequence", lower=0.5, upper=8.0)
    assert torch.equal(keep, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))  # 6.0 in, 0.25 out


def test_weights_carry_no_gradient_and_huge_ratios_do_not_overflow():
    old = OLD.clone().requires_grad_(True)
    w = rollout_is_weights(old, ROLLOUT, MASK, "token", 2.0)
    assert not w.requires_grad
    far = torch.full((1, 200), 5.0)  # summed log-ratio 1000: exp would overflow float32
    w = rollout_is_weights(far, torch.zeros(1, 200), torch.ones(1, 200), "sequence", 2.0)
    assert torch.isfinite(w).all() and torch.all(w == 2.0)


def test_metrics_and_names():
    w = rollout_is_weights(OLD, ROLLOUT, MASK, "token", 2.0)
    keep = rollout_rs_mask(OLD, ROLLOUT, MASK, "token", 0.5, 2.0)
    m = rollout_correction_metrics(OLD, ROLLOUT, MASK, w, keep, 2.0)
    logs = [math.log(1.5), math.log(4.0), math.log(0.25)]
    assert float(m["rollout_corr/log_ratio_mean"]) == pytest.approx(sum(logs) / 3, rel=1e-5)
    assert float(m["rollout_corr/is_weight_mean"]) == pytest.approx((1.5 + 2.0 + 0.25) / 3)
    assert float(m["rollout_corr/is_truncated_frac"]) == pytest.approx(1 / 3)
    assert float(m["rollout_corr/rs_masked_frac"]) == pytest.approx(2 / 3)
    with pytest.raises(UnknownNameError, match="token"):
        rollout_is_weights(OLD, ROLLOUT, MASK, "tokn", 2.0)


def test_config_bounds():
    assert RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=4.0).rs_lower == 0.25
    assert not RolloutCorrectionConfig().enabled
    with pytest.raises(ValueError, match="below"):
        RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=3.0)

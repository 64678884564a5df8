"""verl's validation metrics (gpu_jobs.reward.val_metrics): hand-computed cases, a slow loop
reference against the vectorized bootstrap, and the val-core / val-aux naming."""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest

from gpu_jobs.reward.val_metrics import (bootstrap_indices, best_worst_at, majority_at, subset_sizes,
                                         validation_metrics)


def test_subset_sizes_double_up_to_n():
    assert subset_sizes(1) == [] and subset_sizes(2) == [2] and subset_sizes(4) == [2, 4]
    assert subset_sizes(5) == [2, 4, 5] and subset_sizes(8) == [2, 4, 8]


def test_hand_computed_metrics_of_two_prompts():
    # Prompt p0: scores 1, 0 (answers "5", "6"); prompt p1: 1, 1 ("7", "7"). mean@2 is the mean
    # over prompts of each prompt's mean: (0.5 + 1) / 2; std@2: (0.5 + 0) / 2.
    m = validation_metrics(["a/x"] * 4, ["p0", "p0", "p1", "p1"],
                           {"reward": [1.0, 0.0, 1.0, 1.0], "pred": ["5", "6", "7", "7"]})
    assert m["val-core/a/x/reward/mean@2"] == pytest.approx(0.75)
    assert m["val-aux/a/x/reward/std@2"] == pytest.approx(0.25)
    # p1 is 1 in every draw; p0's best of 2 draws with replacement is 1 unless both draw the 0
    # (chance 1/4), so best@2 ~ (0.75 + 1) / 2 and worst@2 ~ (0.25 + 1) / 2 over 1000 draws.
    assert m["val-core/a/x/reward/best@2/mean"] == pytest.approx(0.875, abs=0.03)
    assert m["val-aux/a/x/reward/worst@2/mean"] == pytest.approx(0.625, abs=0.03)
    # Majority of p0's draws: "5" twice -> 1, "6" twice -> 0, one of each -> whichever came first
    # (each half of the time): ~ 0.5; p1 always 1.
    assert m["val-core/a/x/reward/maj@2/mean"] == pytest.approx(0.75, abs=0.03)
    assert 0 < m["val-core/a/x/reward/maj@2/std"] < 0.5


def test_one_response_per_prompt_reports_mean_at_1_only():
    m = validation_metrics(["s", "s", "t"], ["a", "b", "c"], {"reward": [1.0, 0.0, 0.5], "pred": ["1", "2", "3"]})
    assert m == {"val-core/s/reward/mean@1": 0.5, "val-core/t/reward/mean@1": 0.5}


def test_acc_is_the_core_variable_when_the_reward_reports_it():
    m = validation_metrics(["s"] * 4, ["a"] * 4, {"reward": [1.0, -1.0, 1.0, 1.0], "acc": [1.0, 0.0, 1.0, 1.0],
                                                  "pred": ["1", "2", "1", "1"]})
    assert "val-core/s/acc/mean@4" in m and "val-aux/s/reward/mean@4" in m
    assert m["val-core/s/acc/mean@4"] == pytest.approx(0.75)
    assert "val-aux/s/acc/best@2/mean" in m  # only the largest n is core


def test_bootstrap_is_seeded():
    args = (["s"] * 8, ["a"] * 8, {"reward": [float(i % 3 == 0) for i in range(8)], "pred": list("12312312")})
    assert validation_metrics(*args) == validation_metrics(*args)
    assert validation_metrics(*args, seed=1) != validation_metrics(*args)


def _loop_majority(values, preds, idx):
    """verl's calc_maj_val per draw, written as a plain loop: votes counted in a dict."""
    out = []
    for draw in idx:
        votes = defaultdict(list)
        for i in draw:
            votes[preds[i]].append(values[i])
        winner = max(votes, key=lambda p: len(votes[p]))
        out.append(votes[winner][0])
    return float(np.mean(out)), float(np.std(out))


def test_vectorized_bootstrap_equals_a_loop_reference():
    rng = random.Random(0)
    for trial in range(20):
        n = rng.choice([2, 3, 5, 8])
        values = [rng.random() for _ in range(n)]
        preds = [rng.choice("abc") for _ in range(n)]
        for size in subset_sizes(n):
            idx = bootstrap_indices(n, size, n_bootstrap=200, seed=trial)
            assert majority_at(values, preds, idx) == pytest.approx(_loop_majority(values, preds, idx), abs=1e-12)
            drawn = [[values[i] for i in row] for row in idx]
            (bm, bs), (wm, ws) = best_worst_at(values, idx)
            best, worst = [max(d) for d in drawn], [min(d) for d in drawn]
            assert (bm, bs) == pytest.approx((np.mean(best), np.std(best)))
            assert (wm, ws) == pytest.approx((np.mean(worst), np.std(worst)))


def test_data_sources_are_reported_separately():
    m = validation_metrics(["s", "s", "t", "t"], ["a", "a", "b", "b"],
                           {"reward": [1.0, 1.0, 0.0, 0.0], "pred": ["1", "1", "2", "3"]})
    assert m["val-core/s/reward/mean@2"] == 1.0 and m["val-core/t/reward/mean@2"] == 0.0
    assert m["val-core/t/reward/maj@2/mean"] == 0.0 and m["val-core/s/reward/best@2/mean"] == 1.0

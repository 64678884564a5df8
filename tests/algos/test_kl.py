import math

import pytest
import torch

from gpu_jobs.algos import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty

LP, REF = torch.tensor([[-1.0]], dtype=torch.float64), torch.tensor([[-2.0]], dtype=torch.float64)


@pytest.mark.parametrize(
    "name, value",
    [
        # log_ratio = lp - ref = 1
        ("k1", 1.0), ("kl", 1.0), ("abs", 1.0),
        ("k2", 0.5), ("mse", 0.5),  # 0.5 * 1^2
        ("k3", math.exp(-1)), ("low_var_kl", math.exp(-1)),  # e^{-1} + 1 - 1
    ],
)
def test_estimators_hand(name, value):
    assert kl_penalty(LP, REF, name).item() == pytest.approx(value)
    assert kl_penalty(LP, REF, name + "+").item() == pytest.approx(value)  # '+' keeps the value


def test_k3_clamped_like_verl():
    # ref - lp = 30 -> clamped to 20 -> e^20 - 21, then clamped to 10
    assert kl_penalty(torch.tensor([-31.0]), torch.tensor([-1.0]), "k3").item() == 10.0
    assert kl_penalty(torch.tensor([-1.0]), torch.tensor([-1.0]), "k3").item() == 0.0  # equal policies


@pytest.mark.parametrize("name", ["k1+", "abs+", "k3+", "low_var_kl+", "k2+", "mse"])
def test_straight_through_gradient_is_k2(name):
    lp = LP.clone().requires_grad_()
    kl_penalty(lp, REF, name).sum().backward()
    assert lp.grad.item() == pytest.approx(1.0)  # d/dlp 0.5 (lp - ref)^2 = lp - ref = 1


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs"])
def test_estimators_gradcheck(name):
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 4, generator=g, dtype=torch.float64)).requires_grad_()
    ref = lp.detach() - 0.1 - torch.rand(3, 4, generator=g, dtype=torch.float64)  # keeps |.| away from 0
    assert torch.autograd.gradcheck(lambda x: kl_penalty(x, ref, name), (lp,))


def test_apply_kl_penalty_hand():
    scores = torch.tensor([[0.0, 1.0], [0.0, 2.0]])
    old = torch.tensor([[-1.0, -1.0], [-1.0, 5.0]])
    ref = torch.tensor([[-2.0, -1.0], [-1.5, -9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    rewards, m = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kl_penalty="kl")
    # k1 = (1, 0) and (0.5, masked): rewards (-0.1, 1) and (-0.05, 2 untouched)
    assert rewards.flatten().tolist() == pytest.approx([-0.1, 1.0, -0.05, 2.0])
    # row token-means 0.5 and 0.5 -> 0.5
    assert m["actor/reward_kl_penalty"].item() == pytest.approx(0.5)
    assert m["actor/reward_kl_penalty_coeff"].item() == pytest.approx(0.1)


def test_fixed_controller():
    ctrl = FixedKLController(0.01)
    ctrl.update(100.0, 64)
    assert ctrl.value == 0.01
    other = FixedKLController(0.5)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.01


def test_adaptive_controller_hand_and_state():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    ctrl.update(current_kl=1.1, n_steps=10)  # error 0.1 -> x(1 + 0.1 * 10/100) = x1.01
    assert ctrl.value == pytest.approx(0.101)
    ctrl.update(current_kl=0.0, n_steps=100)  # error clipped to -0.2 -> x0.8
    assert ctrl.value == pytest.approx(0.101 * 0.8)
    fresh = AdaptiveKLController(0.5, 2.0, 7)
    fresh.load_state_dict(ctrl.state_dict())
    assert (fresh.value, fresh.target, fresh.horizon) == (ctrl.value, 1.0, 100)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 100)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 1.0, 0)

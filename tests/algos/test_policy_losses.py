import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_jobs.algos import POLICY_LOSSES, compute_policy_loss, compute_value_loss, get_policy_loss_fn

KEYS = {"actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"}
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def call(name, old, new, adv, mask=None, **kw):
    old, new, adv = t(old), t(new), t(adv)
    mask = torch.ones_like(adv) if mask is None else t(mask)
    return get_policy_loss_fn(name)(old, new, adv, mask, **kw)


# ------------------------------------------------------------------------------ hand cases


def test_vanilla_hand():
    # token 1: A=+1, r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped high)
    # token 2: A=-1, r=0.5 -> max(0.5, 0.8) = 0.8 (clipped low)
    # token 3: A=-1, r=4   -> max(4, 1.2) = 4, dual-clip caps at -A*c = 3 (clipfrac_lower)
    old = [[0.0, 0.0, 0.0]]
    new = [[math.log(1.5), math.log(0.5), math.log(4.0)]]
    loss, m = call("vanilla", old, new, [[1.0, -1.0, -1.0]], clip_ratio=0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0) / 3)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(2 / 3)  # tokens 1, 2 take the clipped branch
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 3)
    assert m["actor/ppo_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(0.5) + math.log(4)) / 3)
    assert set(m) == KEYS and all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_vanilla_clip_higher_hand():
    # r = 1.25 with A > 0: clipped at 1.2 by the symmetric default, free under clip_ratio_high=0.28
    args = ([[0.0]], [[math.log(1.25)]], [[1.0]])
    assert call("vanilla", *args)[0].item() == pytest.approx(-1.2)
    assert call("vanilla", *args, clip_ratio_high=0.28)[0].item() == pytest.approx(-1.25)
    # clip_ratio_low=0.1: r = 0.85 with A < 0 is clipped at 0.9 -> loss 0.9
    assert call("vanilla", [[0.0]], [[math.log(0.85)]], [[-1.0]], clip_ratio_low=0.1)[0].item() == pytest.approx(0.9)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        call("vanilla", *args, clip_ratio_c=1.0)


def test_gspo_hand_and_gradient():
    # row 0: log ratios (0.1, 0.3) -> s = e^0.2 = 1.2214 > 1.2, A=1 -> clipped: -1.2 per token
    # row 1: log ratios (0, 0.1) -> s = e^0.05, unclipped: -e^0.05 per token
    old = t([[0.0, 0.0], [0.0, 0.0]])
    new = t([[0.1, 0.3], [0.0, 0.1]]).requires_grad_()
    loss, m = get_policy_loss_fn("gspo")(old, new, torch.ones(2, 2, dtype=torch.float64), torch.ones(2, 2),
                                         loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx((-1.2 - math.exp(0.05)) / 2)
    assert m["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # GSPO gradient: -A * s_i / |y_i| / n_rows on unclipped rows, 0 on clipped ones
    assert new.grad.tolist()[1] == pytest.approx([-math.exp(0.05) / 2 / 2] * 2)
    assert new.grad.tolist()[0] == [0.0, 0.0]


def test_cispo_hand_and_gradient():
    # r = 2 with A=1: weight clip(2, 0.8, 1.28) = 1.28, detached; loss = -1.28 * A * log_prob
    new = t([[math.log(2.0) - 1.0]]).requires_grad_()
    loss, m = get_policy_loss_fn("cispo")(t([[-1.0]]), new, t([[1.0]]), torch.ones(1, 1), clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(-1.28 * (math.log(2.0) - 1.0))
    loss.backward()
    assert new.grad.item() == pytest.approx(-1.28)  # PPO would give 0 here: the token is clipped
    assert m["actor/pg_clipfrac"].item() == 1.0 and m["actor/pg_clipfrac_lower"].item() == 0.0


def test_gpg_hand():
    # -A * log_prob averaged over tokens: -(2 * -0.5 + -1 * -1) / 2 = 0
    loss, m = call("gpg", [[0.0, 0.0]], [[-0.5, -1.0]], [[2.0, -1.0]])
    assert loss.item() == pytest.approx(0.0) and m["actor/pg_clipfrac"].item() == 0.0


def _cov_case():
    # flattened A = (3, -3, 0, 0), log_prob = (-1, -3, -2, -2): means 0 and -2, so the
    # covariance terms are (3*1, -3*-1, 0, 0) = (3, 3, 0, 0): two tokens inside (1, 5)
    lp = t([[-1.0, -3.0], [-2.0, -2.0]])
    return lp.clone(), lp, t([[3.0, -3.0], [0.0, 0.0]]), torch.ones(2, 2)


def test_clip_cov_hand():
    old, new, adv, mask = _cov_case()
    # budget floor(0.5 * 4) = 2: both covariance tokens are zeroed; the rest have A = 0
    loss, m = get_policy_loss_fn("clip_cov")(old, new, adv, mask, clip_cov_ratio=0.5)
    assert loss.item() == 0.0 and m["actor/pg_clipfrac"].item() == 0.5
    # budget 1: one of the two (chosen at random) is zeroed, leaving -3 or +3 over 4 tokens
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    loss1, m1 = get_policy_loss_fn("clip_cov")(old, new, adv, mask, clip_cov_ratio=0.25, generator=g())
    loss2, _ = get_policy_loss_fn("clip_cov")(old, new, adv, mask, clip_cov_ratio=0.25, generator=g())
    assert abs(loss1.item()) == pytest.approx(0.75) and loss1.item() == loss2.item()
    assert m1["actor/pg_clipfrac"].item() == 0.25


def test_kl_cov_hand():
    # A = (4, 0, 0, 0), log_prob = (-1, -2, -2, -3): covariance (3, 0, 0, 1) -> top-1 is token 0.
    # log ratio 0.1 everywhere: losses (-4e^0.1, 0, 0, 0) + 0.1 * |0.1| on token 0
    new = t([[-1.0, -2.0], [-2.0, -3.0]])
    loss, m = get_policy_loss_fn("kl_cov")(new - 0.1, new, t([[4.0, 0.0], [0.0, 0.0]]), torch.ones(2, 2),
                                           kl_cov_ratio=0.25, ppo_kl_coef=0.1)
    assert loss.item() == pytest.approx((-4 * math.exp(0.1) + 0.01) / 4)
    assert m["actor/ppo_kl"].item() == pytest.approx(0.1)


def test_value_loss_hand():
    # v=2, V_old=0, R=3, c=0.5: unclipped (2-3)^2 = 1, clipped (0.5-3)^2 = 6.25 -> 0.5 * 6.25
    # v=1, V_old=1, R=0: both 1 -> 0.5; token mean -> (3.125 + 0.5) / 2
    loss, frac = compute_value_loss(t([[2.0, 1.0]]), t([[3.0, 0.0]]), t([[0.0, 1.0]]), torch.ones(1, 2), 0.5)
    assert loss.item() == pytest.approx((3.125 + 0.5) / 2) and frac.item() == pytest.approx(0.5)


# ------------------------------------------------------------------------------ loop references


def ref_vanilla(b, low, high, c):
    out = []
    for i in range(b["advantages"].shape[0]):
        for k in range(b["advantages"].shape[1]):
            if not b["response_mask"][i, k]:
                continue
            A = float(b["advantages"][i, k])
            r = math.exp(max(-20, min(20, float(b["log_prob"][i, k] - b["old_log_prob"][i, k]))))
            loss = max(-A * r, -A * min(max(r, 1 - low), 1 + high))
            if A < 0:
                loss = min(loss, -A * c)
            out.append(loss)
    return sum(out) / len(out)


def ref_gspo_row_token_losses(b, i, eps):
    valid = [k for k in range(b["advantages"].shape[1]) if b["response_mask"][i, k]]
    s = math.exp(sum(float(b["log_prob"][i, k] - b["old_log_prob"][i, k]) for k in valid) / len(valid))
    return [max(-float(b["advantages"][i, k]) * s, -float(b["advantages"][i, k]) * min(max(s, 1 - eps), 1 + eps))
            for k in valid]


@pytest.mark.parametrize("seed", range(4))
def test_vanilla_matches_loop(seed, make_batch):
    b = make_batch(seed, bs=6, T=5, interior=True)
    b["log_prob"] = b["old_log_prob"] + torch.randn_like(b["old_log_prob"]) * 0.5
    loss, _ = compute_policy_loss("vanilla", b["old_log_prob"], b["log_prob"], b["advantages"], b["response_mask"],
                                  clip_ratio_low=0.15, clip_ratio_high=0.3, clip_ratio_c=2.0)
    assert loss.item() == pytest.approx(ref_vanilla(b, 0.15, 0.3, 2.0))


@pytest.mark.parametrize("seed", range(4))
def test_gspo_cispo_gpg_match_loop(seed, make_batch):
    b = make_batch(seed, bs=6, T=5, interior=True)
    b["log_prob"] = b["old_log_prob"] + torch.randn_like(b["old_log_prob"]) * 0.3
    args = (b["old_log_prob"], b["log_prob"], b["advantages"], b["response_mask"])
    rows = [ref_gspo_row_token_losses(b, i, 0.2) for i in range(6)]
    gspo, _ = compute_policy_loss("gspo", *args, loss_agg_mode="seq-mean-token-mean")
    assert gspo.item() == pytest.approx(sum(sum(r) / len(r) for r in rows) / 6)
    toks = [(i, k) for i in range(6) for k in range(5) if b["response_mask"][i, k]]
    cispo_ref, gpg_ref = 0.0, 0.0
    for i, k in toks:
        A, lp = float(b["advantages"][i, k]), float(b["log_prob"][i, k])
        r = math.exp(lp - float(b["old_log_prob"][i, k]))
        cispo_ref += -min(max(r, 0.8), 1.2) * A * lp / len(toks)
        gpg_ref += -A * lp / len(toks)
    assert compute_policy_loss("cispo", *args)[0].item() == pytest.approx(cispo_ref)
    assert compute_policy_loss("gpg", *args)[0].item() == pytest.approx(gpg_ref)


# ------------------------------------------------------------------------------ gradients


def _grad_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 4, generator=g, dtype=torch.float64) * 2
    new = (old + torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    return old, new, adv, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "name, kw",
    [
        ("vanilla", {"clip_ratio_high": 0.28}),
        ("gpg", {}),
        ("clip_cov", {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0}),
        ("kl_cov", {"kl_cov_ratio": 0.3}),
    ],
)
def test_losses_gradcheck(name, kw, mode):
    old, new, adv, mask = _grad_inputs(5)

    def f(x):
        extra = {"generator": torch.Generator().manual_seed(0)} if name == "clip_cov" else {}
        return get_policy_loss_fn(name)(old, x, adv, mask, loss_agg_mode=mode, **kw, **extra)[0]

    assert torch.autograd.gradcheck(f, (new,))


def test_value_loss_gradcheck():
    old, new, adv, mask = _grad_inputs(6)
    assert torch.autograd.gradcheck(lambda v: compute_value_loss(v, adv, old, mask, 0.2)[0], (new,))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_masked_positions_change_nothing(name):
    old, new, adv, mask = _grad_inputs(7)
    loss0, m0 = compute_policy_loss(name, old, new, adv, mask, generator=torch.Generator().manual_seed(1))
    loss0.backward()
    hole = ~mask.bool()
    new2 = torch.where(hole, new.detach() + 3.0, new.detach()).requires_grad_()
    old2, adv2 = torch.where(hole, -7.0, old), torch.where(hole, 50.0, adv)
    loss1, m1 = compute_policy_loss(name, old2, new2, adv2, mask, generator=torch.Generator().manual_seed(1))
    loss1.backward()
    assert torch.allclose(loss0, loss1) and all(torch.allclose(m0[k], m1[k]) for k in KEYS)
    assert (new2.grad[hole] == 0).all() and torch.allclose(new.grad, new2.grad)


@settings(max_examples=30, deadline=None, database=None)
@given(seed=st.integers(0, 2**16), mode=st.sampled_from(MODES), bs=st.integers(1, 5), T=st.integers(1, 5))
def test_losses_row_permutation_property(seed, mode, bs, T):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(bs, T, generator=g, dtype=torch.float64)
    new = old + torch.randn(bs, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(bs, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(bs, T, generator=g) > 0.3).double()
    perm = torch.randperm(bs, generator=g)
    for name in ("vanilla", "gspo", "cispo", "gpg"):
        a = compute_policy_loss(name, old, new, adv, mask, loss_agg_mode=mode)[0]
        b = compute_policy_loss(name, old[perm], new[perm], adv[perm], mask[perm], loss_agg_mode=mode)[0]
        assert torch.allclose(a, b) and torch.isfinite(a)


def test_compute_policy_loss_params():
    old, new, adv, mask = _grad_inputs(8)
    compute_policy_loss("gpg", old, new, adv, mask, clip_ratio=0.2, kl_cov_ratio=0.1)  # others' params ignored
    with pytest.raises(TypeError, match="unknown policy-loss parameter.*clip_eps"):
        compute_policy_loss("vanilla", old, new, adv, mask, clip_eps=0.2)
    with pytest.raises(TypeError):  # the raw function is strict
        get_policy_loss_fn("gpg")(old, new, adv, mask, clip_ratio=0.2)

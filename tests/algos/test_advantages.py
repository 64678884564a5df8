import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_jobs.algos import ADVANTAGE_ESTIMATORS, compute_advantage

EPS = 1e-6


def adv(name, rewards, mask=None, index=None, **kw):
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    mask = torch.ones_like(rewards) if mask is None else torch.as_tensor(mask, dtype=torch.float64)
    return compute_advantage(name, token_level_rewards=rewards, response_mask=mask, index=index, **kw)


# ------------------------------------------------------------------------------ hand cases


def test_grpo_hand():
    # group a scores (1, 0): mean 0.5, unbiased std sqrt(0.5) -> +-0.5/0.7071 = +-0.7071;
    # group b is a singleton: baseline 0, std 1 (verl) -> 2 / (1 + eps)
    a, r = adv("grpo", [[0, 1], [0, 0], [2, 0]], index=["a", "a", "b"])
    assert a[:, 0].tolist() == pytest.approx([0.5 / (math.sqrt(0.5) + EPS), -0.5 / (math.sqrt(0.5) + EPS), 2 / (1 + EPS)])
    assert torch.equal(a, r) and torch.equal(a[:, 0], a[:, 1])  # broadcast over tokens


def test_dr_grpo_hand():
    # no std division: (1 - 0.5, 0 - 0.5)
    a, _ = adv("grpo", [[1.0], [0.0]], index=[7, 7], norm_adv_by_std_in_grpo=False)
    assert a[:, 0].tolist() == pytest.approx([0.5, -0.5])


def test_rloo_hand():
    # leave-one-out baselines: 1-(2+6)/2=-3, 2-(1+6)/2=-1.5, 6-(1+2)/2=4.5; singleton keeps 5
    a, _ = adv("rloo", [[1.0], [2.0], [6.0], [5.0]], index=["g", "g", "g", "s"])
    assert a[:, 0].tolist() == pytest.approx([-3.0, -1.5, 4.5, 5.0])


def test_opo_hand():
    # lengths 1 and 3, scores 1 and 0: baseline (1*1 + 3*0) / 4 = 0.25
    a, _ = adv("opo", [[1, 0, 0], [0, 0, 0]], mask=[[1, 0, 0], [1, 1, 1]], index=[0, 0])
    assert a.flatten().tolist() == pytest.approx([0.75, 0, 0, -0.25, -0.25, -0.25])


def test_gpg_hand():
    # 3 of 4 scores non-zero: alpha = 4/3; group means 0.5 and 1 -> 4/3 * (0.5, -0.5, 0, 0)
    a, _ = adv("gpg", [[1.0], [0.0], [1.0], [1.0]], index=["x", "x", "y", "y"])
    assert a[:, 0].tolist() == pytest.approx([2 / 3, -2 / 3, 0.0, 0.0])
    # one of two scores non-zero: alpha = 2; 2 * (+-0.5) / f_norm 2 = +-0.5
    a, _ = adv("gpg", [[1.0], [0.0]], index=["x", "x"], f_norm=2.0)
    assert a[:, 0].tolist() == pytest.approx([0.5, -0.5])


def test_grpo_passk_hand():
    # best 0.9, runner-up 0.5: only the best row gets 0.4 (divided by the group std if asked)
    scores = [[0.2], [0.9], [0.5]]
    a, _ = adv("grpo_passk", scores, index=[1, 1, 1], norm_adv_by_std_in_grpo=False)
    assert a[:, 0].tolist() == pytest.approx([0.0, 0.4, 0.0])
    a, _ = adv("grpo_passk", scores, index=[1, 1, 1])
    assert a[1, 0].item() == pytest.approx(0.4 / (statistics.stdev([0.2, 0.9, 0.5]) + EPS))
    # tie: the first best row in batch order wins, the gap is 0
    a, _ = adv("grpo_passk", [[1.0], [1.0]], index=[1, 1], norm_adv_by_std_in_grpo=False)
    assert a[:, 0].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="at least 2"):
        adv("grpo_passk", scores, index=[1, 1, 2])


def test_reinforce_plus_plus_hand():
    # return-to-go with gamma 0.5 on rewards (0, 0, 1): (0.25, 0.5, 1); advantages are whitened
    a, r = adv("reinforce_plus_plus", [[0, 0, 1.0]], gamma=0.5)
    assert r[0].tolist() == pytest.approx([0.25, 0.5, 1.0])
    mean, sd = statistics.mean([0.25, 0.5, 1.0]), statistics.stdev([0.25, 0.5, 1.0])
    assert a[0].tolist() == pytest.approx([(x - mean) / math.sqrt(sd**2 + 1e-8) for x in (0.25, 0.5, 1.0)])


def test_reinforce_plus_plus_baseline_hand():
    # group (1, 3) -> centred (-1, 1), one token each; whitened: var = 2 -> -+1/sqrt(2)
    a, _ = adv("reinforce_plus_plus_baseline", [[1.0], [3.0]], index=["q", "q"])
    assert a[:, 0].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-6)


def test_remax_hand():
    # returns = reverse cumsum (3, 3, 2); advantage = returns - greedy baseline 1.5
    a, r = adv("remax", [[0, 1.0, 2.0]], reward_baselines=torch.tensor([1.5], dtype=torch.float64))
    assert r[0].tolist() == pytest.approx([3, 3, 2]) and a[0].tolist() == pytest.approx([1.5, 1.5, 0.5])


def test_gae_hand():
    # gamma = lam = 0.5, V = 0.5, rewards (0, 1): t=1 delta = 1 - 0.5 = 0.5, A1 = 0.5;
    # t=0 delta = 0 + 0.5*0.5 - 0.5 = -0.25, A0 = -0.25 + 0.25*0.5 = -0.125; returns = A + V
    values = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    _, r = adv("gae", [[0.0, 1.0]], values=values, gamma=0.5, lam=0.5)
    assert r[0].tolist() == pytest.approx([0.375, 1.0])
    # an interior masked position is skipped: same numbers, garbage in the hole ignored
    values = torch.tensor([[0.5, 99.0, 0.5]], dtype=torch.float64)
    a, r = adv("gae", [[0.0, 42.0, 1.0]], mask=[[1, 0, 1]], values=values, gamma=0.5, lam=0.5)
    assert r[0].tolist() == pytest.approx([0.375, 0.0, 1.0]) and a[0, 1].item() == 0.0


# ------------------------------------------------------------------------------ loop references


def _scores(b):
    r, m = b["token_level_rewards"], b["response_mask"]
    return [sum(float(r[i, t]) for t in range(r.shape[1]) if m[i, t]) for i in range(r.shape[0])]


def _groups(index):
    groups = {}
    for i, k in enumerate(index):
        groups.setdefault(k, []).append(i)
    return groups


def _whiten(per_token, mask):
    vals = [per_token[i][t] for i in range(len(per_token)) for t in range(len(per_token[0])) if mask[i, t]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1) if len(vals) > 1 else 0.0
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in per_token]


def _bcast(per_row, mask):
    return [[per_row[i] if mask[i, t] else 0.0 for t in range(mask.shape[1])] for i in range(len(per_row))]


def ref_outcome(name, b, norm=True):
    s, idx, out = _scores(b), b["index"], [0.0] * len(b["index"])
    groups = _groups(idx)
    nonzero = sum(1 for x in s if x != 0)
    for rows in groups.values():
        g = [s[i] for i in rows]
        n = len(g)
        mean = statistics.mean(g) if n > 1 else 0.0
        std = statistics.stdev(g) if n > 1 else 1.0
        lengths = [float(b["response_mask"][i].sum()) for i in rows]
        for i in rows:
            if name == "grpo":
                out[i] = (s[i] - mean) / (std + EPS) if norm else s[i] - mean
            elif name == "rloo":
                out[i] = s[i] - (sum(g) - s[i]) / (n - 1) if n > 1 else s[i]
            elif name == "opo":
                out[i] = s[i] - (sum(l * x for l, x in zip(lengths, g)) / sum(lengths) if n > 1 else 0.0)
            elif name == "gpg":
                out[i] = len(s) / max(nonzero, 1) * (s[i] - mean)
            elif name == "reinforce_plus_plus_baseline":
                out[i] = s[i] - mean
            elif name == "grpo_passk":
                best = max(rows, key=lambda j: (s[j], -j))
                second = max(s[j] for j in rows if j != best)
                gap = (s[best] - second) / ((std + EPS) if norm else 1.0)
                out[i] = gap if i == best else 0.0
    per_token = _bcast(out, b["response_mask"])
    if name == "reinforce_plus_plus_baseline":
        per_token = [[x * float(b["response_mask"][i, t]) for t, x in enumerate(row)]
                     for i, row in enumerate(_whiten(per_token, b["response_mask"]))]
    return per_token


def ref_sequential(name, b, gamma=0.9, lam=0.8):
    r, v, m = b["token_level_rewards"], b["values"], b["response_mask"]
    bs, T = r.shape
    raw, ret = [[0.0] * T for _ in range(bs)], [[0.0] * T for _ in range(bs)]
    for i in range(bs):
        valid = [t for t in range(T) if m[i, t]]
        nxt_v, nxt = 0.0, 0.0
        for t in reversed(valid):
            if name == "gae":
                delta = float(r[i, t]) + gamma * nxt_v - float(v[i, t])
                nxt = delta + gamma * lam * nxt
                nxt_v = float(v[i, t])
                raw[i][t], ret[i][t] = nxt, nxt + float(v[i, t])
            elif name == "reinforce_plus_plus":
                nxt = float(r[i, t]) + gamma * nxt
                raw[i][t], ret[i][t] = nxt, nxt
            elif name == "remax":
                nxt = float(r[i, t]) + nxt
                ret[i][t] = nxt
                raw[i][t] = nxt - float(b["reward_baselines"][i])
    if name == "remax":
        return raw, ret
    w = _whiten(raw, m)
    return [[w[i][t] * float(m[i, t]) for t in range(T)] for i in range(bs)], ret


def _call(name, b, **kw):
    return compute_advantage(
        name,
        token_level_rewards=b["token_level_rewards"],
        response_mask=b["response_mask"],
        index=b["index"],
        values=b["values"],
        reward_baselines=b["reward_baselines"],
        **kw,
    )


OUTCOME = ["grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", OUTCOME)
def test_outcome_estimators_match_loop(name, seed, make_batch):
    b = make_batch(seed, bs=9, n_groups=4, interior=seed % 2 == 1)
    b["index"][seed] = "solo"  # at least one group of size 1
    a, r = _call(name, b)
    assert torch.allclose(a, torch.tensor(ref_outcome(name, b), dtype=a.dtype), atol=1e-6)
    assert torch.equal(a, r)


@pytest.mark.parametrize("seed", range(4))
def test_dr_grpo_and_passk_match_loop(seed, make_batch):
    b = make_batch(seed, bs=8)
    b["index"] = [f"g{i % 3}" for i in range(7)] + ["g0"]  # every group >= 2 for pass@k
    for norm in (True, False):
        a, _ = _call("grpo", b, norm_adv_by_std_in_grpo=norm)
        assert torch.allclose(a, torch.tensor(ref_outcome("grpo", b, norm), dtype=a.dtype), atol=1e-6)
        a, _ = _call("grpo_passk", b, norm_adv_by_std_in_grpo=norm)
        assert torch.allclose(a, torch.tensor(ref_outcome("grpo_passk", b, norm), dtype=a.dtype), atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "remax"])
def test_sequential_estimators_match_loop(name, seed, make_batch):
    b = make_batch(seed, interior=True)
    a, r = _call(name, b, gamma=0.9, lam=0.8)
    ra, rr = ref_sequential(name, b)
    assert torch.allclose(a, torch.tensor(ra, dtype=a.dtype), atol=1e-6)
    assert torch.allclose(r, torch.tensor(rr, dtype=r.dtype), atol=1e-6)


# ------------------------------------------------------------------------------ invariances

ALL = sorted(ADVANTAGE_ESTIMATORS)


def _paired_batch(make_batch, seed):
    b = make_batch(seed, bs=8, interior=True)
    b["index"] = ["a", "b", "c", "a", "b", "c", "a", "b"]
    return b


@pytest.mark.parametrize("name", ALL)
def test_masked_positions_change_nothing(name, make_batch):
    b = _paired_batch(make_batch, 11)
    a0, r0 = _call(name, b, gamma=0.9, lam=0.8)
    hole = ~b["response_mask"].bool()
    for key in ("token_level_rewards", "values"):
        b[key] = torch.where(hole, torch.full_like(b[key], 1e6), b[key])
    a1, r1 = _call(name, b, gamma=0.9, lam=0.8)
    assert torch.allclose(a0, a1) and torch.allclose(r0, r1)
    assert (a1[hole] == 0).all() and (r1[hole] == 0).all()


@pytest.mark.parametrize("name", ALL)
def test_permuting_rows_permutes_outputs(name, make_batch):
    b = _paired_batch(make_batch, 12)
    a, r = _call(name, b, gamma=0.9, lam=0.8)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(3))
    pb = {k: (v[perm] if isinstance(v, torch.Tensor) else [v[i] for i in perm]) for k, v in b.items()}
    pa, pr = _call(name, pb, gamma=0.9, lam=0.8)
    assert torch.allclose(pa, a[perm], atol=1e-9) and torch.allclose(pr, r[perm], atol=1e-9)


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "reinforce_plus_plus_baseline"])
def test_group_constant_shift_changes_nothing(name, make_batch):
    b = _paired_batch(make_batch, 13)
    a0, _ = _call(name, b)
    shift = {"a": 5.0, "b": -3.0, "c": 100.0}
    b["token_level_rewards"] = b["token_level_rewards"].clone()
    for i, k in enumerate(b["index"]):
        b["token_level_rewards"][i, 0] += shift[k]  # position 0 is always a response token
    a1, _ = _call(name, b)
    assert torch.allclose(a0, a1, atol=1e-9)


def test_group_ids_by_value_not_position(make_batch):
    b = _paired_batch(make_batch, 14)
    a_str, _ = _call("grpo", b)
    for other in ([{"a": 3, "b": 1, "c": 2}[k] for k in b["index"]],
                  np.array([{"a": 3, "b": 1, "c": 2}[k] for k in b["index"]]),
                  torch.tensor([{"a": 30, "b": 10, "c": 20}[k] for k in b["index"]])):
        b2 = dict(b, index=other)
        assert torch.allclose(_call("grpo", b2)[0], a_str)


@settings(max_examples=30, deadline=None, database=None)
@given(
    groups=st.lists(st.integers(0, 3), min_size=1, max_size=8),
    T=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_group_advantages_sum_to_zero_property(groups, T, seed):
    g = torch.Generator().manual_seed(seed)
    bs = len(groups)
    lengths = torch.randint(1, T + 1, (bs,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    rewards = torch.randn(bs, T, generator=g, dtype=torch.float64)
    for name, kw in (("grpo", {"norm_adv_by_std_in_grpo": False}), ("rloo", {})):
        a, _ = compute_advantage(name, token_level_rewards=rewards, response_mask=mask, index=groups, **kw)
        assert (a[~mask.bool()] == 0).all()
        per_row = a[:, 0]
        for k in set(groups):
            rows = [i for i, x in enumerate(groups) if x == k]
            if len(rows) > 1:  # a baseline from the group itself: the group's advantages cancel
                assert abs(float(per_row[rows].sum())) < 1e-9


@settings(max_examples=30, deadline=None, database=None)
@given(T=st.integers(2, 5), seed=st.integers(0, 2**16), trailing=st.integers(1, 3))
def test_padding_columns_change_nothing_property(T, seed, trailing):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(4, T, generator=g, dtype=torch.float64)
    values = torch.randn(4, T, generator=g, dtype=torch.float64)
    mask = torch.ones(4, T, dtype=torch.float64)
    pad = lambda x: torch.cat([x, torch.randn(4, trailing, generator=g, dtype=x.dtype)], 1)  # noqa: E731
    for name in ("gae", "reinforce_plus_plus", "grpo"):
        kw = dict(index=[0, 0, 1, 1], gamma=0.7, lam=0.9)
        a, r = compute_advantage(name, token_level_rewards=rewards, response_mask=mask, values=values, **kw)
        mask_p = torch.cat([mask, torch.zeros(4, trailing, dtype=mask.dtype)], 1)
        ap, rp = compute_advantage(name, token_level_rewards=pad(rewards), response_mask=mask_p, values=pad(values), **kw)
        assert torch.allclose(ap[:, :T], a) and torch.allclose(rp[:, :T], r)


# ------------------------------------------------------------------------------ entry point


def test_compute_advantage_params():
    r, m = torch.ones(2, 2), torch.ones(2, 2)
    # lam belongs to gae: grpo ignores it
    compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=[0, 0], lam=0.5, gamma=0.9)
    with pytest.raises(TypeError, match="unknown advantage parameter.*lamda"):
        compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=[0, 0], lamda=0.5)
    with pytest.raises(ValueError, match="needs values"):
        compute_advantage("gae", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="needs reward_baselines"):
        compute_advantage("remax", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="needs index"):
        compute_advantage("rloo", token_level_rewards=r, response_mask=m)

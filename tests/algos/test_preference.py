"""DPO, its variants and KTO (gpu_jobs/algos/preference.py): hand-computed cases, limits and
invariances, the gradient reaching only the policy, and a few DPO steps on the built-in model."""

import copy
import math

import pytest
import torch
from pydantic import ValidationError

from gpu_jobs.algos import (
    PREFERENCE_LOSSES,
    DuplicateNameError,
    PreferenceConfig,
    UnknownNameError,
    dpo_loss,
    kto_kl_indices,
    kto_loss,
    logprobs_from_logits,
    sequence_logprobs,
)

DPO_KEYS = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"}


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def log_sigmoid(x):
    return -math.log1p(math.exp(-x))


# One pair: policy chosen -1.0, rejected -2.0; reference chosen -1.5, rejected -1.0.
# chosen log-ratio 0.5, rejected log-ratio -1.0, so h = beta * (0.5 - (-1.0)) = 0.1 * 1.5 = 0.15.
PAIR = ([-1.0], [-2.0], [-1.5], [-1.0])


def dpo(pair=PAIR, **kw):
    return dpo_loss(*(t(x) for x in pair), **kw)


# ----------------------------------------------------------------------------------- DPO hand


def test_sigmoid_hand():
    loss, m = dpo(beta=0.1)
    # -log sigmoid(0.15) = log(1 + e^-0.15) = log(1.860708) = 0.620957
    assert loss.item() == pytest.approx(0.620957047789532)
    assert m["rewards/chosen"].item() == pytest.approx(0.05)  # 0.1 * 0.5
    assert m["rewards/rejected"].item() == pytest.approx(-0.1)  # 0.1 * -1.0
    assert m["rewards/margins"].item() == pytest.approx(0.15)
    assert m["rewards/accuracies"].item() == 1.0
    assert m["logps/chosen"].item() == -1.0 and m["logps/rejected"].item() == -2.0
    assert set(m) == DPO_KEYS and all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_sigmoid_batch_is_the_mean_over_pairs():
    # pair 2 is pair 1 with chosen and rejected swapped: h = -0.15, loss -log sigmoid(-0.15) = 0.620957 + 0.15
    pair = ([-1.0, -2.0], [-2.0, -1.0], [-1.5, -1.0], [-1.0, -1.5])
    loss, m = dpo(pair, beta=0.1)
    assert loss.item() == pytest.approx((0.620957047789532 + 0.770957047789532) / 2)
    assert m["rewards/accuracies"].item() == 0.5
    assert m["rewards/margins"].item() == pytest.approx(0.0)


def test_cdpo_label_smoothing_hand():
    # -(1 - eps) log s(h) - eps log s(-h) = -log s(h) + eps * h   (since log s(h) - log s(-h) = h)
    # = 0.620957 + 0.1 * 0.15 = 0.635957
    loss, _ = dpo(beta=0.1, label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.635957047789532)


def test_robust_hand_and_unbiased():
    # ((1 - eps) * 0.620957 + eps * log s(-0.15)) / (1 - 2 eps) = (0.9 * 0.620957 - 0.1 * 0.770957) / 0.8 = 0.602207
    loss, _ = dpo(beta=0.1, loss_type="robust", label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.6022070477895319)
    # Unbiased: if the label is flipped with probability eps, the expected robust loss is the clean DPO loss.
    for h_pair in (PAIR, ([-3.0], [-0.5], [-1.0], [-2.0])):
        swapped = (h_pair[1], h_pair[0], h_pair[3], h_pair[2])
        eps = 0.2
        expected = 0.8 * dpo(h_pair, loss_type="robust", label_smoothing=eps)[0] + \
            0.2 * dpo(swapped, loss_type="robust", label_smoothing=eps)[0]
        assert expected.item() == pytest.approx(dpo(h_pair)[0].item())


def test_ipo_hand_uses_per_token_logratios():
    # lengths 2 and 4: h = 0.5 / 2 - (-1.0 / 4) = 0.5; target 1 / (2 beta) = 5 -> (0.5 - 5)^2 = 20.25
    loss, _ = dpo(beta=0.1, loss_type="ipo", chosen_lengths=t([2.0]), rejected_lengths=t([4.0]))
    assert loss.item() == pytest.approx(20.25)
    with pytest.raises(ValueError, match="chosen_lengths and rejected_lengths"):
        dpo(loss_type="ipo")


def test_ipo_is_minimal_at_its_target():
    # IPO drives the per-token log-ratio gap to exactly 1 / (2 beta): there the loss and its gradient are 0.
    beta = 0.5  # target gap 1.0
    chosen = t([0.0]).requires_grad_()
    loss, _ = dpo_loss(chosen, t([-1.0]), t([0.0]), t([0.0]), beta=beta, loss_type="ipo",
                       chosen_lengths=t([1.0]), rejected_lengths=t([1.0]))
    loss.backward()
    assert loss.item() == 0.0 and chosen.grad.item() == 0.0


def test_hinge_hand():
    assert dpo(beta=0.1, loss_type="hinge")[0].item() == pytest.approx(0.85)  # relu(1 - 0.15)
    # beta * h = 2.0 * 1.5 = 3 > 1: the margin is met, nothing to learn
    assert dpo(beta=2.0, loss_type="hinge")[0].item() == 0.0


def test_policy_equal_to_reference():
    # log-ratios are 0: sigmoid loss log 2, zero rewards and margins, no pair "accurate"; IPO (0 - 1/(2 beta))^2.
    same = ([-1.0, -3.0], [-2.0, -0.5], [-1.0, -3.0], [-2.0, -0.5])
    loss, m = dpo(same, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2))
    assert m["rewards/margins"].item() == 0.0 and m["rewards/accuracies"].item() == 0.0
    ipo, _ = dpo(same, beta=0.1, loss_type="ipo", chosen_lengths=t([3.0, 1.0]), rejected_lengths=t([2.0, 5.0]))
    assert ipo.item() == pytest.approx(25.0)


def test_gradient_reaches_only_the_policy():
    pol_c, pol_r = t([-1.0, -2.0]).requires_grad_(), t([-2.0, -1.0]).requires_grad_()
    ref_c, ref_r = t([-1.5, -1.0]).requires_grad_(), t([-1.0, -1.5]).requires_grad_()
    loss, _ = dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=0.1)
    loss.backward()
    assert ref_c.grad is None and ref_r.grad is None
    # d/d chosen of mean_i -log s(h_i) = -beta * s(-h_i) / B: raising the chosen log-prob lowers the loss
    h = [0.15, -0.15]
    expected = [-0.1 * (1 - 1 / (1 + math.exp(-x))) / 2 for x in h]
    assert pol_c.grad.tolist() == pytest.approx(expected)
    assert pol_r.grad.tolist() == pytest.approx([-g for g in expected])


def test_unknown_loss_type_and_bad_values():
    with pytest.raises(UnknownNameError, match="hinge, ipo, robust, sigmoid"):
        dpo(loss_type="orpo")
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo(beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo(label_smoothing=0.5)
    with pytest.raises(DuplicateNameError):
        PREFERENCE_LOSSES.register("sigmoid")(lambda *a, **k: None)


# ----------------------------------------------------------------------------------------- KTO


def kto(**kw):
    # logps -1, -2, -3 against ref -1.5, -1.0, -3.0: log-ratios r = 0.5, -1.0, 0.0; labels D, U, D.
    # mismatched pairs: (-2.0 - -2.5, -1.0 - -1.5, -2.5 - -2.0) = (0.5, 0.5, -0.5), mean 1/6 = z0
    return kto_loss(t([-1.0, -2.0, -3.0]), t([-1.5, -1.0, -3.0]), torch.tensor([True, False, True]),
                    t([-2.0, -1.0, -2.5]), t([-2.5, -1.5, -2.0]), **kw)


def test_kto_hand():
    z0 = 1 / 6
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    d0 = 1 - sig(0.1 * (0.5 - z0))  # desirable: 1 - s(beta (r - z0)) = 0.491667
    u1 = 1 - sig(0.1 * (z0 + 1.0))  # undesirable: 1 - s(beta (z0 - r)) = 0.470866
    d2 = 1 - sig(0.1 * (0.0 - z0))  # 0.504167
    loss, m = kto(beta=0.1)
    assert loss.item() == pytest.approx((d0 + u1 + d2) / 3)
    assert loss.item() == pytest.approx((0.49166743818588066 + 0.47086637092795314 + 0.5041665702187285) / 3)
    # weights multiply each side's losses; the mean stays over all 3 examples (TRL does not renormalise)
    assert kto(beta=0.1, desirable_weight=2.0, undesirable_weight=0.5)[0].item() == \
        pytest.approx((2 * d0 + 0.5 * u1 + 2 * d2) / 3)
    assert m["kl"].item() == pytest.approx(z0)
    assert m["rewards/chosen"].item() == pytest.approx(0.1 * (0.5 + 0.0) / 2)
    assert m["rewards/rejected"].item() == pytest.approx(-0.1)
    assert m["rewards/margins"].item() == pytest.approx(0.025 + 0.1)
    assert m["logps/chosen"].item() == pytest.approx(-2.0) and m["logps/rejected"].item() == -2.0


def test_kto_reference_point_is_clamped_and_detached():
    pol = t([-1.0, -2.0]).requires_grad_()
    pol_kl = t([-3.0, -3.0]).requires_grad_()  # mismatched log-ratios -1, -1: mean -1, clamped to 0
    loss, m = kto_loss(pol, t([-1.0, -2.0]), torch.tensor([True, False]), pol_kl, t([-2.0, -2.0]), beta=0.1)
    assert m["kl"].item() == 0.0
    assert loss.item() == pytest.approx(0.5)  # r = 0 and z0 = 0: 1 - s(0) on both sides
    loss.backward()
    assert pol_kl.grad is None  # z0 is a constant of the step, as in TRL
    # desirable: d/dr (1 - s(beta r)) / B = -beta/4/2; undesirable: +beta/4/2
    assert pol.grad.tolist() == pytest.approx([-0.0125, 0.0125])


def test_kto_side_absent_from_the_batch_is_nan_not_zero():
    loss, m = kto_loss(t([-1.0, -2.0]), t([-1.0, -1.0]), torch.tensor([True, True]), t([-1.0, -1.0]),
                       t([-1.0, -1.0]))
    assert math.isfinite(loss.item())
    assert math.isnan(m["rewards/rejected"].item()) and math.isnan(m["logps/rejected"].item())
    assert m["rewards/chosen"].item() == pytest.approx(-0.05)


def test_kto_kl_indices_rotate_by_one():
    assert kto_kl_indices(4).tolist() == [3, 0, 1, 2]  # (x_1, y_4), (x_2, y_1), ...: TRL's rotation
    with pytest.raises(ValueError, match="at least 2 examples"):
        kto_kl_indices(1)
    with pytest.raises(ValueError, match="undesirable_weight must be >= 0"):
        kto(undesirable_weight=-1.0)


# --------------------------------------------------------------------------- sequence log-probs


def test_sequence_logprobs_hand():
    # uniform logits over V = 4: every token has log-prob -log 4; response = positions 2, 3 of 4
    logits = torch.zeros(1, 4, 4, dtype=torch.float64)
    seq = sequence_logprobs(logits, torch.tensor([[1, 2, 3, 0]]), torch.tensor([[0, 0, 1, 1]]))
    assert seq.sum.item() == pytest.approx(-2 * math.log(4))
    assert seq.mean.item() == pytest.approx(-math.log(4)) and seq.length.item() == 2.0


def test_sequence_logprobs_matches_a_loop_and_ignores_unscored_positions():
    g = torch.Generator().manual_seed(0)
    B, L, V = 3, 7, 11
    logits = torch.randn(B, L, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, L), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 1, 1, 0]])
    seq = sequence_logprobs(logits, ids, mask)
    for b in range(B):
        # position 0 has no prefix: row 2's mask there is ignored
        picked = [torch.log_softmax(logits[b, i - 1], -1)[ids[b, i]].item() for i in range(1, L) if mask[b, i]]
        assert seq.sum[b].item() == pytest.approx(sum(picked))
        assert seq.length[b].item() == len(picked)
        assert seq.mean[b].item() == pytest.approx(sum(picked) / len(picked))
    # logits that score no response token (the last position, and those before an unmasked token) change nothing
    poisoned = logits.clone()
    poisoned[:, -1] = float("inf")
    poisoned[0, 0] = float("nan")
    assert torch.equal(sequence_logprobs(poisoned, ids, mask).sum, seq.sum)
    with pytest.raises(ValueError, match=r"logits \(B, L, V\)"):
        sequence_logprobs(logits[0], ids, mask)


# ------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs, message", [
    (dict(beta=0.0), "beta must be > 0"),
    (dict(beta=-1.0), "beta must be > 0"),
    (dict(loss_type="orpo"), "valid names are: hinge, ipo, robust, sigmoid"),
    (dict(label_smoothing=0.5), r"label_smoothing must be in \[0, 0.5\)"),
    (dict(loss_type="ipo", label_smoothing=0.1), "label_smoothing does nothing with loss_type='ipo'"),
    (dict(algorithm="kto", desirable_weight=-0.5), "desirable_weight must be >= 0"),
    (dict(algorithm="kto", desirable_weight=0.0, undesirable_weight=0.0), "both 0"),
    (dict(algorithm="kto", loss_type="ipo"), "loss_type applies only to algorithm='dpo'"),
    (dict(undesirable_weight=2.0), "undesirable_weight applies only to algorithm='kto'"),
    (dict(algorithm="ppo"), "algorithm"),
    (dict(betta=0.1), "betta"),
])
def test_config_refuses_bad_values(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        PreferenceConfig(**kwargs)


def test_config_kwargs_call_the_losses():
    dpo_cfg = PreferenceConfig(beta=0.1, loss_type="robust", label_smoothing=0.1)
    assert dpo(**dpo_cfg.loss_kwargs())[0].item() == pytest.approx(0.6022070477895319)
    kto_cfg = PreferenceConfig(algorithm="kto", beta=0.1)
    assert kto(**kto_cfg.loss_kwargs())[0].item() == pytest.approx(kto(beta=0.1)[0].item())
    assert all(f.description for f in PreferenceConfig.model_fields.values())


# ------------------------------------------------------------ a few DPO steps on a real model


def _pair_batch(tok, problems):
    """(input_ids, attention_mask, response_mask) of prompt + response + eos rows, right-padded; each (2P, L)."""
    rows = []
    for prompt, response in problems:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append((p + r, [0] * len(p) + [1] * len(r)))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i, _ in rows])
    attention = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows])
    return ids, attention, mask


def _logps(model, batch):
    ids, attention, mask = batch
    return sequence_logprobs(model(ids, attention_mask=attention).logits, ids, mask).sum


def test_dpo_steps_raise_the_margin_and_leave_the_reference_alone():
    from gpu_jobs.models import arith_problems, ensure_builtin_model, load_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy, tok = load_model(ensure_builtin_model())  # cached on disk after the first build
    reference = copy.deepcopy(policy).requires_grad_(False)
    ref_before = {k: v.clone() for k, v in reference.state_dict().items()}
    # chosen: the right sum; rejected: the sum off by one in the last digit
    problems = arith_problems(4, seed=7)
    chosen = [(p, a) for p, a in problems]
    rejected = [(p, str(int(a) + 1)) for p, a in problems]
    batch = _pair_batch(tok, chosen + rejected)
    with torch.no_grad():
        ref_logps = _logps(reference, batch)
        before = _logps(policy, batch)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    for _ in range(4):
        logps = _logps(policy, batch)
        loss, metrics = dpo_loss(logps[:4], logps[4:], ref_logps[:4], ref_logps[4:], beta=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = _logps(policy, batch)
        assert torch.equal(_logps(reference, batch), ref_logps)
    margin_before = (before[:4] - before[4:]).mean().item()
    margin_after = (after[:4] - after[4:]).mean().item()
    assert margin_after > margin_before + 1.0, (margin_before, margin_after)  # measured 0.28 -> 3.0
    assert metrics["rewards/margins"].item() > 0
    assert all(torch.equal(v, ref_before[k]) for k, v in reference.state_dict().items())


def test_docstring_examples_run():
    import doctest

    from gpu_jobs.algos import preference

    result = doctest.testmod(preference)
    assert result.failed == 0 and result.attempted > 0

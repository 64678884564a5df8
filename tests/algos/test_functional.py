import math

import pytest
import torch

from gpu_jobs.algos import (
    agg_loss,
    entropy_from_logits,
    logprobs_and_entropy,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
)

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def test_masked_stats_hand():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, float("nan"), float("inf")]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # valid values 1, 2, 3: mean 2, unbiased var ((1)+(0)+(1))/2 = 1; nan/inf are masked out
    assert masked_mean(x, m).item() == pytest.approx(2.0)
    assert masked_var(x, m).item() == pytest.approx(1.0)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(2 / 3)
    assert masked_mean(x, m, dim=-1).tolist() == pytest.approx([1.5, 3.0])
    w = masked_whiten(x, m)
    assert [w[0, 0].item(), w[0, 1].item(), w[1, 0].item()] == pytest.approx([-1, 0, 1], abs=1e-6)
    # shift_mean=False adds the mean back: (1-2)/1 + 2 = 1
    assert masked_whiten(x, m, shift_mean=False)[0, 0].item() == pytest.approx(1.0, abs=1e-6)


def test_masked_stats_empty_and_single():
    x = torch.tensor([5.0, 7.0])
    assert masked_mean(x, torch.zeros(2)).item() == 0.0  # nothing selected -> 0, not nan
    assert masked_var(x, torch.tensor([1.0, 0.0])).item() == 0.0  # one value: no spread
    assert masked_whiten(x, torch.tensor([1.0, 0.0]))[0].item() == 0.0


def test_agg_loss_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # token-mean: (1+2+3+4)/4 valid tokens = 2.5
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-sum: rows 6 and 4 (empty row 3 skipped) -> 5
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    # seq-mean-token-mean: rows 2 and 4 -> 3
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # seq-mean-token-sum-norm (Dr. GRPO): (6 + 4 + 0) / 3 rows / T=3 = 10/9
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / 9)


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_masked_values_change_nothing(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(4, 5, generator=g)
    mask = (torch.rand(4, 5, generator=g) > 0.4).float()
    noisy = torch.where(mask.bool(), loss, torch.randn(4, 5, generator=g) * 1e6)
    assert torch.equal(agg_loss(loss, mask, mode), agg_loss(noisy, mask, mode))


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_gradcheck(mode):
    g = torch.Generator().manual_seed(1)
    loss = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: agg_loss(x, mask, mode), (loss,))


def test_logprobs_hand():
    # uniform logits over 4 entries: every log-prob is log(1/4)
    lp = logprobs_from_logits(torch.zeros(2, 3, 4), torch.tensor([[0, 1, 2], [3, 3, 0]]))
    assert torch.allclose(lp, torch.full((2, 3), math.log(0.25)))


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_logprobs_and_entropy_match_reference(chunk):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    ref_lp = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    p = torch.softmax(logits, -1)
    ref_ent = -(p * torch.log(p)).sum(-1)
    assert torch.allclose(logprobs_from_logits(logits, labels, chunk_size=chunk), ref_lp)
    assert torch.allclose(entropy_from_logits(logits, chunk_size=chunk), ref_ent)
    lp, ent = logprobs_and_entropy(logits, labels, chunk_size=chunk)  # both from one pass
    assert torch.equal(lp, logprobs_from_logits(logits, labels, chunk_size=chunk))
    assert torch.allclose(ent, ref_ent)


def test_entropy_hand():
    # uniform over 8 -> log 8; one-hot-ish (very peaked) -> ~0
    assert entropy_from_logits(torch.zeros(1, 8)).item() == pytest.approx(math.log(8))
    assert entropy_from_logits(torch.tensor([[100.0, 0.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 1024])
def test_masked_logits_give_the_entropy_of_the_rest(chunk):
    # -inf logits (a top-k or vocabulary mask) are tokens of probability 0: the entropy and both
    # gradients are those of the unmasked logits alone, not NaN (0 * -inf).
    g = torch.Generator().manual_seed(4)
    kept = torch.randn(3, 4, generator=g, dtype=torch.float64)
    logits = torch.cat([kept, torch.full((3, 2), float("-inf"), dtype=torch.float64)], -1).requires_grad_(True)
    ref = kept.clone().requires_grad_(True)
    labels = torch.tensor([0, 3, 1])
    ent, expected = logprobs_and_entropy(logits, labels, chunk)[1], logprobs_and_entropy(ref, labels, chunk)[1]
    assert torch.allclose(ent, expected)
    for fn in (lambda x: entropy_from_logits(x, chunk), lambda x: logprobs_from_logits(x, labels, chunk),
               lambda x: logprobs_and_entropy(x, labels, chunk)[0]):
        out, expected = fn(logits), fn(ref)
        assert torch.allclose(out, expected)
        out.sum().backward(), expected.sum().backward()
        assert torch.allclose(logits.grad[:, :4], ref.grad) and torch.all(logits.grad[:, 4:] == 0)
        logits.grad, ref.grad = None, None


@pytest.mark.parametrize("chunk", [1, 2, 1024])
def test_logprobs_and_entropy_gradcheck(chunk):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 2, 5, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (3, 2), generator=g)
    assert torch.autograd.gradcheck(lambda x: logprobs_from_logits(x, labels, chunk), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, chunk), (logits,))
    assert torch.autograd.gradcheck(lambda x: logprobs_and_entropy(x, labels, chunk)[0], (logits,))
    # The one-pass entropy is for reporting: it takes no part in the graph.
    assert not logprobs_and_entropy(logits, labels, chunk)[1].requires_grad


def test_noncontiguous_logits_and_bad_chunk():
    logits = torch.randn(6, 4, 3).transpose(0, 1)  # (4, 6, 3), not contiguous
    labels = torch.zeros(4, 6, dtype=torch.long)
    ref = torch.log_softmax(logits, -1)[..., 0]
    assert torch.allclose(logprobs_from_logits(logits, labels, chunk_size=5), ref, atol=1e-6)
    with pytest.raises(ValueError):
        entropy_from_logits(logits, chunk_size=0)

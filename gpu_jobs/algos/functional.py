"""Masked statistics, loss aggregation and memory-lean log-prob / entropy from logits.

Shapes: ``bs`` rows (responses), ``T`` response positions, ``V`` vocabulary entries.
Masks are 0/1 (bool, int or float). Every reduction uses ``torch.where`` rather than a
product, so garbage (even ``inf``/``nan``) under a masked position cannot leak into a result.
"""

from __future__ import annotations

from enum import Enum

import torch

from gpu_jobs.registry import Registry

__all__ = [
    "LossAggMode",
    "LOSS_AGG_MODES",
    "agg_loss",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "logprobs_from_logits",
    "logprobs_and_entropy",
    "entropy_from_logits",
]


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is set. ``x``, ``mask``: same shape; ``dim=None`` sums all."""
    picked = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is set; 0 where nothing is set.

    ``x``, ``mask``: same shape, e.g. ``(bs, T)``. Returns a scalar (``dim=None``) or ``x``
    reduced over ``dim``.
    """
    # Counts in at least float32: bf16 cannot count past 256 exactly.
    count = mask.to(torch.promote_types(x.dtype, torch.float32))
    count = count.sum() if dim is None else count.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over the masked positions (scalar). Bessel-corrected when ``unbiased``.

    Unlike verl this does not raise for fewer than two positions (that check forces a device
    sync); it returns 0 there, which makes ``masked_whiten`` map the lone value to 0.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.to(torch.promote_types(x.dtype, torch.float32)).sum()
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean/var over the masked positions; same shape as ``x``.

    With ``shift_mean=False`` the mean is added back (scale only). Positions outside the mask
    are transformed too; callers multiply by the mask if they need zeros there.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    return whitened if shift_mean else whitened + mean


# ---------------------------------------------------------------------------------------------
# Loss aggregation: an algorithm choice, named explicitly (DAPO arXiv:2503.14476, Dr. GRPO
# arXiv:2503.20783).


class LossAggMode(str, Enum):
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


LOSS_AGG_MODES: Registry = Registry("loss_agg_mode")


def _nonempty_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    return loss_mask.bool().any(dim=-1)


@LOSS_AGG_MODES.register(LossAggMode.TOKEN_MEAN)
def _token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    # Every token weighs the same, so long responses weigh more (DAPO's choice).
    return masked_mean(loss_mat, loss_mask)


@LOSS_AGG_MODES.register(LossAggMode.SEQ_MEAN_TOKEN_SUM)
def _seq_mean_token_sum(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    seq = masked_sum(loss_mat, loss_mask, dim=-1)
    return masked_mean(seq, _nonempty_rows(loss_mask))


@LOSS_AGG_MODES.register(LossAggMode.SEQ_MEAN_TOKEN_MEAN)
def _seq_mean_token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    # The original GRPO objective: each response weighs the same whatever its length.
    seq = masked_mean(loss_mat, loss_mask, dim=-1)
    return masked_mean(seq, _nonempty_rows(loss_mask))


@LOSS_AGG_MODES.register(LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM)
def _seq_mean_token_sum_norm(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    # Dr. GRPO: a constant normaliser (the padded length T) instead of each response's length.
    # It is constant only if batches are padded to max_response_length.
    seq = masked_sum(loss_mat, loss_mask, dim=-1)
    return seq.mean() / loss_mask.shape[-1]


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Reduce a per-token loss ``(bs, T)`` to a scalar.

    Modes: ``token-mean`` = sum over all valid tokens / number of valid tokens;
    ``seq-mean-token-sum`` = mean over non-empty rows of each row's token sum;
    ``seq-mean-token-mean`` = mean over non-empty rows of each row's token mean (GRPO,
    arXiv:2402.03300); ``seq-mean-token-sum-norm`` = mean over all rows of token sum / T
    (Dr. GRPO, arXiv:2503.20783; verl divides the batch *sum* by T instead of the mean).
    Unknown modes raise and list the valid ones.
    """
    return LOSS_AGG_MODES[loss_agg_mode](loss_mat, loss_mask)


# ---------------------------------------------------------------------------------------------
# Log-probs and entropy from logits without a second (rows, V) tensor.
#
# Autograd through row-slices would make every chunk's backward allocate a full-size zero
# gradient, so both functions are custom autograd Functions: forward saves only the logits
# (no copy) and a per-row statistic, backward fills one preallocated gradient chunk by chunk.

_DEFAULT_CHUNK = 1024


def _rows(logits: torch.Tensor) -> torch.Tensor:
    # A view when logits is contiguous; otherwise this is the one copy we make.
    return logits.reshape(-1, logits.shape[-1])


def _block_entropy(block: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of ``block`` ``(rows, V)`` given its logsumexp ``lse`` ``(rows,)``:
    ``H = lse - sum p * l``, one exp pass (no softmax and second logsumexp), one ``(rows, V)``
    temporary. nansum: a masked (-inf) logit has p = 0, and 0 * -inf is NaN; it adds nothing."""
    p_l = torch.sub(block, lse[:, None]).exp_().mul_(block)
    return lse - torch.nansum(p_l, dim=-1)


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, chunk_size, with_entropy):
        flat, flat_labels = _rows(logits), labels.reshape(-1)
        out = torch.empty(flat.shape[0], dtype=logits.dtype, device=logits.device)
        lse = torch.empty_like(out)
        entropy = torch.empty_like(out) if with_entropy else None
        for s in range(0, flat.shape[0], chunk_size):
            block, e = flat[s : s + chunk_size], s + chunk_size
            lse[s:e] = torch.logsumexp(block, dim=-1)
            out[s:e] = block.gather(-1, flat_labels[s:e, None]).squeeze(-1) - lse[s:e]
            if entropy is not None:  # from the lse just taken
                entropy[s:e] = _block_entropy(block, lse[s:e])
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_size = chunk_size
        if entropy is None:
            return out.reshape(labels.shape)
        entropy = entropy.reshape(labels.shape)
        ctx.mark_non_differentiable(entropy)  # the tensor returned, not a view's base
        return out.reshape(labels.shape), entropy

    @staticmethod
    def backward(ctx, grad_out, *_):
        logits, labels, lse = ctx.saved_tensors
        flat, flat_labels, g = _rows(logits), labels.reshape(-1), grad_out.reshape(-1)
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], ctx.chunk_size):
            e = s + ctx.chunk_size
            # d/dl_k [l_y - logsumexp(l)] = 1[k=y] - softmax(l)_k, computed in place in the
            # gradient's own rows: no (chunk, V) temporaries to allocate, fill and copy.
            block = torch.sub(flat[s:e], lse[s:e, None], out=grad[s:e]).exp_().mul_(-g[s:e, None])
            block.scatter_add_(-1, flat_labels[s:e, None], g[s:e, None])
        return grad.reshape(logits.shape), None, None, None


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = _DEFAULT_CHUNK
) -> torch.Tensor:
    """``log softmax(logits)[label]`` per position.

    ``logits``: ``(..., V)``; ``labels``: ``(...)`` int64. Returns ``(...)`` in logits' dtype.
    Uses ``logit[label] - logsumexp(logits)`` over ``chunk_size`` rows at a time, so the peak
    extra memory is ``(chunk_size, V)``, never a second ``(..., V)`` tensor (the backward
    allocates the one gradient it must return).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _LogProbs.apply(logits, labels.long(), chunk_size, False)


def logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = _DEFAULT_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprobs_from_logits`` and, from the same pass over the logits, the entropy of each
    position's categorical, without grad: for reporting it when it is not part of the loss
    (``entropy_from_logits`` is the differentiable one). Shapes as ``logprobs_from_logits``;
    both results ``(...)``."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _LogProbs.apply(logits, labels.long(), chunk_size, True)


def _where_p(p: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """``terms`` where ``p > 0``, 0 elsewhere (the limit p log p -> 0 at masked logits)."""
    return torch.where(p > 0, terms, torch.zeros((), dtype=terms.dtype, device=terms.device))


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, chunk_size):
        flat = _rows(logits)
        out = torch.empty(flat.shape[0], dtype=logits.dtype, device=logits.device)
        for s in range(0, flat.shape[0], chunk_size):
            block = flat[s : s + chunk_size]
            out[s : s + chunk_size] = _block_entropy(block, torch.logsumexp(block, dim=-1))
        ctx.save_for_backward(logits, out)
        ctx.chunk_size = chunk_size
        return out.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out):
        logits, ent = ctx.saved_tensors
        flat, g = _rows(logits), grad_out.reshape(-1)
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], ctx.chunk_size):
            e = s + ctx.chunk_size
            logp = torch.log_softmax(flat[s:e], dim=-1)
            # dH/dl_k = -p_k (log p_k + H)
            p = logp.exp()
            grad[s:e] = _where_p(p, -p * (logp + ent[s:e, None]) * g[s:e, None])
        return grad.reshape(logits.shape), None


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = _DEFAULT_CHUNK) -> torch.Tensor:
    """Entropy ``H = logsumexp(l) - sum softmax(l) * l`` of the categorical over the last dim.

    ``logits``: ``(..., V)``. Returns ``(...)``. Processes ``chunk_size`` rows at a time, so the
    softmax never exists for more than ``(chunk_size, V)`` at once; differentiable.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _Entropy.apply(logits, chunk_size)

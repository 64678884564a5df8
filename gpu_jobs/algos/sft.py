"""The supervised fine-tuning loss: the negative log-likelihood of the demonstration's tokens.

    loss, metrics = sft_loss(log_prob, response_mask)      # token-mean NLL of one micro-batch

Shapes: ``b`` sequences, ``R`` response positions. ``log_prob`` ``(b, R)`` holds the policy's
log-probability of each response token (the trainer's forward, at temperature 1);
``response_mask`` ``(b, R)`` is 1 on the tokens that carry a loss: an assistant's own tokens,
0 on padding and on the user or tool turns between a multi-turn conversation's assistant turns.
The loss is aggregated by ``agg_loss``'s ``token-mean`` (verl's SFT trainer and TRL's
SFTTrainer both average over the batch's loss tokens); the trainer weights each micro-batch by
its share of the mini-batch's loss tokens, so a step equals one on the whole mini-batch.
Metrics use verl's SFT names (``train/loss``). Run the tests with
``.venv/bin/python -m pytest -q tests/flows/test_sft_run.py -k loss``.
"""

from __future__ import annotations

import torch

from .functional import agg_loss, masked_sum

__all__ = ["sft_loss", "greedy_exact"]


def sft_loss(log_prob: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean negative log-likelihood ``-sum(mask * log_prob) / sum(mask)`` of ``(b, R)``
    log-probs under ``(b, R)`` ``response_mask``; returns ``(loss, {"train/loss": loss detached})``.
    A micro-batch with no loss token gives 0 (agg_loss clamps the denominator)."""
    if log_prob.shape != response_mask.shape:
        raise ValueError(f"sft_loss needs log_prob and response_mask of one shape (b, R), got "
                         f"{tuple(log_prob.shape)} and {tuple(response_mask.shape)}")
    loss = agg_loss(-log_prob, response_mask, "token-mean")
    return loss, {"train/loss": loss.detach()}


def greedy_exact(argmax_match: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(b,)`` 1.0 where every loss token of a sequence is the model's argmax given the tokens
    before it: greedy decoding from the same context reproduces the demonstration exactly (by
    induction over its tokens; its EOS included, so it also stops there). ``argmax_match``
    ``(b, R)``: 1.0 where the token is the argmax. A sequence without loss tokens counts as exact."""
    missed = masked_sum(1.0 - argmax_match, response_mask, dim=-1)
    return (missed == 0).to(argmax_match.dtype)

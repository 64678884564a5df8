"""The "hf" rollout backend: a batched sampling loop over a transformers model with a KV cache.

    >>> from gpu_jobs.rollout import HFRolloutEngine, SamplingConfig
    >>> engine = HFRolloutEngine(trainer_model, tokenizer)   # shares the trainer's weights
    >>> rows = engine.generate([[7, 11, 14, 8, 9, 18]], n=8, sampling=SamplingConfig(seed=0))

Why not `model.generate`: we need per-token logprobs of the sampled tokens under the sampling
distribution, each prompt prefilled once for its n samples, finished rows dropped from the
batch, and a seeded generator; and the loop has less per-step overhead than `generate`.
Left padding: position_ids come from the attention mask, so a padded prompt sees the same
positions as an unpadded one (as `generate` does).
"""

from __future__ import annotations

import math
import os
from typing import Callable

from gpu_jobs.rollout.base import RolloutEngineConfig, SamplingConfig, make_row, register_rollout_engine


def filter_top_k_top_p(logits, top_k: int, top_p: float):
    """Set logits outside the top-k / top-p (nucleus) set to -inf; (batch, vocab) -> same.

    Mirrors vLLM's `apply_top_k_top_p_pytorch` (sort ascending, drop tokens whose cumulative
    probability stays <= 1 - top_p, always keep the most likely), so both backends sample
    from, and report logprobs of, the same distribution.
    """
    import torch

    vocab = logits.shape[-1]
    use_k = 0 < top_k < vocab
    if not use_k and top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if use_k:
        kth = sorted_logits[:, vocab - top_k].unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
    if top_p < 1.0:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_tokens(logits, sampling: SamplingConfig, generator=None):
    """Sample one token per row; (batch, vocab) float logits -> (tokens (batch,), logprobs (batch,)).

    logprobs are under the distribution sampled from (see gpu_jobs.rollout.base); greedy
    (temperature 0) reports the unscaled log_softmax.
    """
    import torch

    if sampling.temperature == 0.0:
        logp = logits.log_softmax(dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        scaled = filter_top_k_top_p(logits / sampling.temperature, sampling.top_k, sampling.top_p)
        logp = scaled.log_softmax(dim=-1)
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def eos_token_ids(model, tokenizer=None) -> list[int]:
    """All EOS ids: the generation config's (may be a list), else the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


def model_device() -> str:
    """Where a model this engine loads itself runs: the current CUDA device when torch sees one,
    else the CPU (a trainer's module is used where the trainer put it)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class HFRolloutEngine:
    """Rollouts from a transformers causal LM, held in memory.

    `model` is an nn.Module (used as-is: a trainer's module shares its weights, so no
    update_weights call is needed after an in-place optimizer step) or a path / URL / alias,
    loaded with `gpu_jobs.models.load_model` in `config.dtype` and placed on `model_device()`.
    """

    def __init__(self, model, tokenizer=None, config: RolloutEngineConfig | None = None, storage=None):
        self.config = config or RolloutEngineConfig()
        self.storage = storage
        if isinstance(model, (str, os.PathLike)):
            from gpu_jobs.models.loading import load_model

            model, tokenizer = load_model(model, dtype=self.config.dtype, storage=storage)
            model = model.to(model_device())  # load_model reads onto the CPU
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = eos_token_ids(model, tokenizer)
        pad = getattr(model.config, "pad_token_id", None)
        if pad is None and tokenizer is not None:
            pad = tokenizer.pad_token_id
        # Pad positions are masked out, so any id works; fall back to EOS, then 0.
        self.pad_id = int(pad if pad is not None else (self.eos_ids or [0])[0])

    # -- generation ------------------------------------------------------------------------

    streams_tokens = True  # generate(on_tokens=...) reports each step's tokens as they are sampled

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                 on_tokens: Callable[[list[int], list[int]], None] | None = None) -> list[dict]:
        """See `RolloutEngine.generate`. Prompts are processed in chunks of at most
        config.max_batch_size sequences (prompts x n); one generator drives all chunks.
        `on_tokens(rows, tokens)`, when given, is called after every decoding step with the rows
        (prompt-major, `prompt * n + sample`) still generating and the token each just sampled
        (rlmill serve streams them); it costs one list per step."""
        import torch

        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        generator = None
        if sampling.seed is not None:
            device = next(self.model.parameters()).device  # multinomial wants it there
            generator = torch.Generator(device=device).manual_seed(sampling.seed)
        per_chunk = max(1, self.config.max_batch_size // n)
        was_training = self.model.training
        self.model.eval()  # a shared trainer module may be in train mode (dropout)
        try:
            rows: list[dict] = []
            with torch.inference_mode():
                for start in range(0, len(prompts), per_chunk):
                    chunk = prompts[start:start + per_chunk]
                    rows.extend(self._generate_chunk(chunk, start, n, sampling, generator, on_tokens))
            return rows
        finally:
            self.model.train(was_training)

    def _prefill(self, prompts: list[list[int]], n: int):
        """Run each prompt once, then repeat its KV cache for its n samples.

        Returns (last-token logits (P*n, vocab) fp32, cache, attention mask (P*n, width),
        next positions (P*n,)).
        """
        import torch
        from transformers import DynamicCache

        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        if n > 1:
            cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)
        next_pos = mask.sum(-1).repeat_interleave(n)
        return logits, cache, mask.repeat_interleave(n, dim=0), next_pos

    def _generate_chunk(self, prompts, first_index: int, n: int, sampling: SamplingConfig,
                        generator, on_tokens=None) -> list[dict]:
        """Decode loop for one chunk; rows are (prompt, sample) pairs, prompt-major."""
        import torch

        logits, cache, mask, next_pos = self._prefill(prompts, n)
        total, max_new = logits.shape[0], sampling.max_response_length
        tokens_out = torch.zeros((total, max_new), dtype=torch.long)
        logprobs_out = torch.zeros((total, max_new), dtype=torch.float32)
        lengths = torch.zeros(total, dtype=torch.long)
        stopped = torch.zeros(total, dtype=torch.bool)
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=logits.device)
        dev = logits.device  # bookkeeping lives on the CPU, model tensors on `dev`
        rows_in_batch = torch.arange(total)  # batch slot -> row index
        alive = torch.ones(total, dtype=torch.bool)  # per batch slot
        for step in range(max_new):
            tokens, logps = sample_tokens(logits, sampling, generator)
            live_rows = rows_in_batch[alive]
            tokens_out[live_rows, step] = tokens.cpu()[alive]
            logprobs_out[live_rows, step] = logps.float().cpu()[alive]
            lengths[live_rows] = step + 1
            if on_tokens is not None:
                on_tokens((live_rows + first_index * n).tolist(), tokens.cpu()[alive].tolist())
            if not sampling.ignore_eos and len(eos):
                hit = torch.isin(tokens, eos).cpu() & alive
                stopped[rows_in_batch[hit]] = True
                alive &= ~hit
            if step + 1 == max_new or not alive.any():
                break
            # Finished rows keep riding along (their outputs are ignored) until enough have
            # finished to pay for copying the cache without them.
            if (~alive).sum() >= max(1, self.config.compact_fraction * len(alive)):
                keep = alive.nonzero().squeeze(-1)
                keep_dev = keep.to(dev)
                cache.batch_select_indices(keep_dev)
                tokens, mask, next_pos = tokens[keep_dev], mask[keep_dev], next_pos[keep_dev]
                rows_in_batch, alive = rows_in_batch[keep], alive[keep]
            mask = torch.cat([mask, mask.new_ones((len(mask), 1))], dim=1)
            out = self.model(input_ids=tokens.unsqueeze(-1), attention_mask=mask,
                             position_ids=next_pos.unsqueeze(-1), past_key_values=cache,
                             use_cache=True)
            cache, logits, next_pos = out.past_key_values, out.logits[:, -1].float(), next_pos + 1
        return self._rows(prompts, first_index, n, tokens_out, logprobs_out, lengths, stopped)

    @staticmethod
    def _rows(prompts, first_index, n, tokens_out, logprobs_out, lengths, stopped) -> list[dict]:
        rows = []
        for r in range(len(prompts) * n):
            k = int(lengths[r])
            rows.append(make_row(first_index + r // n, r % n, prompts[r // n],
                                 tokens_out[r, :k].tolist(), logprobs_out[r, :k].tolist(),
                                 "stop" if stopped[r] else "length"))
        return rows

    def score_tokens(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Log-prob of every token after the first given the tokens before it, by teacher forcing:
        row i gets len(sequences[i]) - 1 values of log_softmax(logits / temperature) (temperature
        0 counts as 1, as for greedy rollout log-probs): what the trainer computes on them."""
        import torch

        scale = temperature if temperature > 0 else 1.0
        device = next(self.model.parameters()).device
        out: list[list[float]] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for start in range(0, len(sequences), self.config.max_batch_size):
                    chunk = sequences[start:start + self.config.max_batch_size]
                    width = max(len(s) for s in chunk)
                    ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long, device=device)
                    mask = torch.zeros((len(chunk), width), dtype=torch.long, device=device)
                    for i, s in enumerate(chunk):  # left padding, positions from the mask
                        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
                        mask[i, width - len(s):] = 1
                    positions = (mask.cumsum(-1) - 1).clamp(min=0)
                    logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
                    logp = (logits[:, :-1] / scale).log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
                    out.extend(logp[i, width - len(s):].tolist() for i, s in enumerate(chunk))
        finally:
            self.model.train(was_training)
        return out

    # -- weights ---------------------------------------------------------------------------

    def update_weights(self, weights) -> None:
        """Copy new weights into the model in place: a state dict (HF names) or a checkpoint
        folder / storage URL. Tied weights (lm_head = embeddings) may be omitted."""
        import torch

        if not isinstance(weights, dict):
            from gpu_jobs.models.loading import read_state_dict

            weights = read_state_dict(weights, storage=self.storage)
        with torch.no_grad():
            result = self.model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        missing = set(result.missing_keys) - tied
        if result.unexpected_keys or missing:
            raise KeyError(f"state dict does not match the model: missing {sorted(missing)[:5]}, "
                           f"unexpected {sorted(result.unexpected_keys)[:5]}")


@register_rollout_engine("hf")
def _make_hf(model_path, config: RolloutEngineConfig, tokenizer=None, storage=None) -> HFRolloutEngine:
    return HFRolloutEngine(model_path, tokenizer, config, storage=storage)

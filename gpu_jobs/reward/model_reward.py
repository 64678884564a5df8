"""A reward model: a sequence classifier with one output, loaded from a local HF folder.

    >>> scorer = ModelRewardScorer("/models/my-rm", max_length=512, batch_size=8)
    >>> scorer.score(["2+2="], ["4"])                 # one float per (prompt, response)
    [0.73]

The prompt is either text or chat messages; messages are rendered with the reward model's chat
template plus the response as the assistant turn, text is concatenated with the response.
The score is the logit at the last non-padding token (HF's `...ForSequenceClassification`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ModelRewardScorer"]


class ModelRewardScorer:
    """Scores (prompt, response) pairs with `AutoModelForSequenceClassification` (num_labels=1)."""

    def __init__(
        self, model_path: str, *, max_length: int = 1024, batch_size: int = 8, device: str = "cpu", dtype=None
    ):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_path, dtype=dtype or torch.float32
        ).to(device)
        self.model.eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{model_path}: a reward model needs num_labels=1, it has {self.model.config.num_labels}")
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.max_length, self.batch_size, self.device = max_length, batch_size, device

    def _text(self, prompt: Any, response: str) -> str:
        if isinstance(prompt, str):
            return prompt + response
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                messages + [{"role": "assistant", "content": response}], tokenize=False
            )
        return "".join(m["content"] for m in messages) + response

    def score(self, prompts: Sequence[Any], responses: Sequence[str]) -> list[float]:
        """One float per pair; batched, truncated to max_length tokens (keeping the end)."""
        import torch

        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        texts = [self._text(p, r) for p, r in zip(prompts, responses)]
        out: list[float] = []
        side = self.tokenizer.truncation_side
        self.tokenizer.truncation_side = "left"  # the response (at the end) matters most
        try:
            with torch.no_grad():
                for k in range(0, len(texts), self.batch_size):
                    enc = self.tokenizer(
                        texts[k : k + self.batch_size],
                        padding=True,
                        truncation=True,
                        max_length=self.max_length,
                        return_tensors="pt",
                        add_special_tokens=False,
                    ).to(self.device)
                    logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
                    out.extend(float(x) for x in logits[:, 0].float().cpu())
        finally:
            self.tokenizer.truncation_side = side
        return out

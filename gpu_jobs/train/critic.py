"""The value model: the LM with a scalar head per token, trained with the clipped value loss.

    from gpu_jobs.train import Critic, CriticConfig
    critic = Critic("/path/to/hf_model", CriticConfig(ppo_mini_batch_size=4))
    values = critic.compute_values(batch)            # one float32 array per row
    metrics = critic.update(batch_with_values_and_returns)   # critic/vf_loss, ...
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .batch import read_rows
from .config import CriticConfig
from .zero_module import ZeroModule

__all__ = ["Critic"]


class Critic(ZeroModule):
    """``AutoModelForTokenClassification(num_labels=1)`` on the policy's weights: the score head
    is new (seeded by config.seed); the head's dropout is off so values are deterministic."""

    config: CriticConfig

    def __init__(self, model_path: str, config: CriticConfig | None = None, *, tokenizer: Any = None,
                 storage: Any = None):
        from transformers import AutoModelForTokenClassification

        super().__init__(
            model_path,
            config or CriticConfig(),
            auto_class=AutoModelForTokenClassification,
            train=True,
            tokenizer=tokenizer,
            config_overrides={"num_labels": 1, "classifier_dropout": 0.0},
            storage=storage,
        )

    def _response_values(self, mb: dict[str, Any]) -> Any:
        """Values ``(b, R)`` (fp32): the value of the state before each response token, i.e.
        the head's output at positions P-1 .. P+R-2 (verl's ``values[:, -R-1:-1]``); packed, at
        ``token_index``."""
        out = self._forward(mb).logits
        if mb["packed"]:
            return self._rows(out[0, mb["token_index"], 0].float(), mb)
        P, R = mb["prompt_width"], mb["response_width"]
        return out[:, P - 1 : P + R - 1, 0].float()

    def compute_values(self, batch: Any) -> list[np.ndarray]:
        """Per-row float32 values of each response token (no grad), on every rank."""
        rows = read_rows(batch, vocab_size=self.model_config.vocab_size)
        return self._map_rows_no_grad(
            rows, self._response_values, self.config.log_prob_micro_batch_size_per_gpu
        )

    def update(self, batch: Any) -> dict[str, float]:
        """One critic update on ``batch`` with ``values`` (old predictions) and ``returns``.
        Metrics: critic/vf_loss, critic/vf_clipfrac, critic/vf_explained_var (of the batch's
        values against its returns, as verl reports it), critic/grad_norm, critic/lr, timings."""
        rows = read_rows(batch, require=("values", "returns"), vocab_size=self.model_config.vocab_size)
        metrics = self._run_update(rows, self._loss, self.config.loss_agg_mode, role="critic")
        metrics["critic/vf_explained_var"] = _explained_var(rows.columns["values"], rows.columns["returns"])
        return metrics

    def _loss(self, mb: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        from gpu_jobs.algos import compute_value_loss, masked_mean

        mask = mb["response_mask"]
        vpreds = self._response_values(mb)
        loss, clipfrac = compute_value_loss(
            vpreds, mb["returns"], mb["values"], mask,
            cliprange_value=self.config.cliprange_value, loss_agg_mode=self.config.loss_agg_mode,
        )
        return loss, {
            "critic/vf_loss": loss.detach(),
            "critic/vf_clipfrac": clipfrac,
            "critic/vpred_mean": masked_mean(vpreds.detach(), mask),
        }


def _explained_var(values: list[np.ndarray], returns: list[np.ndarray]) -> float:
    """1 - Var(returns - values) / Var(returns) over all response tokens (1 = perfect)."""
    v, r = np.concatenate(values).astype(np.float64), np.concatenate(returns).astype(np.float64)
    var_r = r.var()
    return float(1.0 - (r - v).var() / var_r) if var_r > 0 else 0.0

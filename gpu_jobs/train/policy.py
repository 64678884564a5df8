"""Policy update on a DeepSpeed engine (ZeRO-3 by default) and the frozen reference model.

    from gpu_jobs.train import PolicyTrainer, TrainerConfig
    trainer = PolicyTrainer("/path/to/hf_model", TrainerConfig(ppo_mini_batch_size=4, lr=1e-5))
    metrics = trainer.update(batch)          # pyarrow.Table: prompt_ids, response_ids, advantages
    weights = trainer.gathered_state_dict()  # full fp32 weights for the rollout engine (rank 0)
    trainer.save_hf(url + "/policy"); trainer.save(url)  # HF checkpoint; exact-resume state

One rank runs in-process; N ranks under ``torchrun --nproc_per_node N`` (every rank passes the
same whole batch and trains on its slice of each mini-batch).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .batch import Rows, read_rows
from .config import TrainerConfig
from .engine import ZeroModule

__all__ = ["PolicyTrainer", "RefModel", "policy_objective", "required_columns"]


def policy_objective(logits: Any, mb: dict[str, Any], loss_fn: Any, config: TrainerConfig):
    """Policy loss - entropy_coeff * entropy + kl_loss_coef * KL(ref) on one micro-batch.

    ``logits`` ``(b, R, V)`` fp32 predict ``mb["responses"]`` ``(b, R)``; ``mb`` also holds
    response_mask, old_logprobs, advantages (and ref_logprobs with the KL loss), all ``(b, R)``.
    Returns (scalar loss, metrics)."""
    import torch
    from gpu_jobs.algos import agg_loss, entropy_from_logits, kl_penalty, logprobs_from_logits

    c, pl = config, config.policy_loss
    mask = mb["response_mask"]
    log_prob = logprobs_from_logits(logits, mb["responses"])
    kwargs = {"loss_agg_mode": pl.loss_agg_mode, **pl.loss_kwargs()}
    loss, metrics = loss_fn(mb["old_logprobs"], log_prob, mb["advantages"], mask, **kwargs)
    metrics = dict(metrics)
    # Entropy is always reported; it joins the graph only when it is part of the loss.
    with torch.set_grad_enabled(c.entropy_coeff != 0 and torch.is_grad_enabled()):
        entropy = agg_loss(entropy_from_logits(logits), mask, pl.loss_agg_mode)
    if c.entropy_coeff != 0:
        loss = loss - c.entropy_coeff * entropy
    metrics["actor/entropy"] = entropy.detach()
    if c.kl_loss.use_kl_loss:
        kld = kl_penalty(log_prob, mb["ref_logprobs"], c.kl_loss.kl_loss_type)
        kl_loss = agg_loss(kld, mask, pl.loss_agg_mode)
        loss = loss + c.kl_loss.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach()
        metrics["actor/kl_coef"] = c.kl_loss.kl_loss_coef
    return loss, metrics


def required_columns(config: TrainerConfig, batch: Any) -> tuple[str, ...]:
    """Columns an update with ``config`` needs beyond prompt_ids/response_ids."""
    have = set(getattr(batch, "column_names", ()))
    need = ["advantages"]
    if config.kl_loss.use_kl_loss:
        need.append("ref_logprobs")
    if not config.recompute_old_logprobs and "rollout_logprobs" not in have:
        need.append("old_logprobs")  # else rollout_logprobs stand in for them
    return tuple(need)


class _CausalLM(ZeroModule):
    """Log-probs of response tokens under an AutoModelForCausalLM in a DeepSpeed engine."""

    config: TrainerConfig

    def __init__(self, model_path: str, config: TrainerConfig, *, train: bool, tokenizer: Any = None,
                 storage: Any = None):
        from transformers import AutoModelForCausalLM

        super().__init__(
            model_path, config, auto_class=AutoModelForCausalLM, train=train, tokenizer=tokenizer,
            storage=storage,
        )

    def _response_logits(self, mb: dict[str, Any]) -> Any:
        """Logits ``(b, R, V)`` (fp32) predicting each response token; HF computes only R+1 rows."""
        R = mb["response_width"]
        out = self.engine(
            input_ids=mb["input_ids"],
            attention_mask=mb["attention_mask"],
            position_ids=mb["position_ids"],
            use_cache=False,
            logits_to_keep=R + 1,
        )
        logits = out.logits[:, :R, :].float()
        return logits / self.config.temperature if self.config.temperature != 1.0 else logits

    def _read(self, batch: Any, require: tuple[str, ...] = ()) -> Rows:
        return read_rows(batch, require=require, vocab_size=self.model_config.vocab_size)

    def _log_probs_of(self, rows: Rows) -> list[np.ndarray]:
        from gpu_jobs.algos import logprobs_from_logits

        return self._map_rows_no_grad(
            rows,
            lambda mb: logprobs_from_logits(self._response_logits(mb), mb["responses"]),
            self.config.log_prob_micro_batch_size_per_gpu,
        )

    def compute_log_probs(self, batch: Any) -> list[np.ndarray]:
        """Per-row float32 log-probs of each response token (no grad), on every rank."""
        return self._log_probs_of(self._read(batch))


class RefModel(_CausalLM):
    """Frozen reference policy: ``RefModel(path, TrainerConfig()).compute_log_probs(batch)``."""

    def __init__(self, model_path: str, config: TrainerConfig | None = None, *, tokenizer: Any = None,
                 storage: Any = None):
        super().__init__(model_path, config or TrainerConfig(), train=False, tokenizer=tokenizer, storage=storage)


class PolicyTrainer(_CausalLM):
    """PPO-family policy updates with gpu_jobs.algos losses on a DeepSpeed engine.

        trainer = PolicyTrainer(model_dir, TrainerConfig(ppo_mini_batch_size=2))
        metrics = trainer.update(table)   # {"actor/pg_loss": ..., "actor/grad_norm": ...}
    """

    def __init__(
        self,
        model_path: str,
        config: TrainerConfig | None = None,
        *,
        tokenizer: Any = None,
        kl_controller: Any = None,
        storage: Any = None,
    ) -> None:
        super().__init__(model_path, config or TrainerConfig(), train=True, tokenizer=tokenizer, storage=storage)
        self.kl_controller = kl_controller  # its state travels with save()/load()

    # ---- the update ----------------------------------------------------------------------
    def update(self, batch: Any) -> dict[str, float]:
        """One policy update on ``batch`` (pyarrow.Table): ppo_epochs passes of shuffled
        mini-batches, one optimizer step each. Returns verl-named metrics. Every input check
        runs before the first weight changes."""
        from gpu_jobs.algos import get_policy_loss_fn

        t0 = time.perf_counter()
        c = self.config
        loss_fn = get_policy_loss_fn(c.policy_loss.loss_mode)
        rows = self._read(batch, required_columns(c, batch))
        old_seconds = 0.0
        if c.recompute_old_logprobs:
            rows.columns["old_logprobs"] = self._log_probs_of(rows)
            old_seconds = time.perf_counter() - t0
        elif "old_logprobs" not in rows.columns:
            rows.columns["old_logprobs"] = rows.columns["rollout_logprobs"]
        metrics = self._run_update(
            rows, lambda mb: self._loss(mb, loss_fn), c.policy_loss.loss_agg_mode, role="actor",
            prep_seconds=old_seconds,
        )
        if c.recompute_old_logprobs:  # else a 0 here would overwrite the logprobs stage's own time
            metrics["timing_s/old_log_prob"] = old_seconds
        return metrics

    def _loss(self, mb: dict[str, Any], loss_fn: Any) -> tuple[Any, dict[str, Any]]:
        return policy_objective(self._response_logits(mb), mb, loss_fn, self.config)

    # ---- exact resume extras -------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        kl = self.kl_controller
        return {"kl_controller": kl.state_dict() if hasattr(kl, "state_dict") else None}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if self.kl_controller is not None and state.get("kl_controller") is not None:
            self.kl_controller.load_state_dict(state["kl_controller"])

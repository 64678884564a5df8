"""Policy update on a DeepSpeed engine (ZeRO-3 over ranks) and the frozen reference model.

    from gpu_jobs.train import PolicyTrainer, ActorConfig
    trainer = PolicyTrainer("/path/to/hf_model", ActorConfig(ppo_mini_batch_size=4, lr=1e-5))
    metrics = trainer.update(batch)          # pyarrow.Table: prompt_ids, response_ids, advantages
    weights = trainer.gathered_state_dict()  # full fp32 weights for the rollout engine (rank 0)
    trainer.save_hf(url + "/policy"); trainer.save(url)  # HF checkpoint; exact-resume state

One rank runs in-process; N ranks under ``torchrun --nproc_per_node N`` (every rank passes the
same whole batch and trains on its slice of each mini-batch).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from .batch import Rows, read_rows
from .config import ActorConfig
from .errors import TrainInputError
from .loop import PhaseTimer, optimizer_step, update_steps
from .memory import set_host_memory, trim_heap
from .zero_module import ZeroModule
from .protocol import InProcessTrainer

__all__ = ["PolicyTrainer", "RefModel", "AdapterOffRef", "policy_objective", "policy_loss", "token_terms",
           "required_columns"]


def policy_objective(logits: Any, mb: dict[str, Any], loss_fn: Any, config: ActorConfig):
    """Policy loss - entropy_coeff * entropy + kl_loss_coef * KL(ref) on one micro-batch.

    ``logits`` ``(b, R, V)`` fp32 predict ``mb["responses"]`` ``(b, R)``; ``mb`` also holds
    response_mask, old_logprobs, advantages (and ref_logprobs with the KL loss), all ``(b, R)``.
    Returns (scalar loss, metrics)."""
    log_prob, entropy = token_terms(logits, mb["responses"], config)
    return policy_loss(log_prob, entropy, mb, loss_fn, config)


def token_terms(logits: Any, labels: Any, config: ActorConfig, with_entropy: bool = True):
    """(log-prob of each label, entropy) from ``logits`` ``(..., V)`` and ``labels`` ``(...)``.
    Entropy is always reported but joins the graph only when it is part of the loss; None
    without ``with_entropy``."""
    import torch
    from gpu_jobs.algos import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits

    if not with_entropy:
        return logprobs_from_logits(logits, labels), None
    if config.entropy_coeff != 0 and torch.is_grad_enabled():
        return logprobs_from_logits(logits, labels), entropy_from_logits(logits)
    return logprobs_and_entropy(logits, labels)  # entropy for the metrics only: one pass for both


def policy_loss(log_prob: Any, entropy: Any, mb: dict[str, Any], loss_fn: Any, config: ActorConfig):
    """policy_objective from per-token ``log_prob`` and ``entropy`` ``(b, R)``."""
    from gpu_jobs.algos import agg_loss, kl_penalty

    c, pl = config, config.policy_loss
    mask = mb["response_mask"]
    kwargs = {"loss_agg_mode": pl.loss_agg_mode, **pl.loss_kwargs()}
    loss, metrics = loss_fn(mb["old_logprobs"], log_prob, mb["advantages"], mask, **kwargs)
    metrics = dict(metrics)
    entropy = agg_loss(entropy, mask, pl.loss_agg_mode)
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


def required_columns(config: ActorConfig, batch: Any) -> tuple[str, ...]:
    """Columns an update with ``config`` needs beyond prompt_ids/response_ids."""
    have = set(getattr(batch, "column_names", ()))
    need = ["advantages"]
    if config.kl_loss.use_kl_loss:
        need.append("ref_logprobs")
    if not config.recompute_old_logprobs and "rollout_logprobs" not in have:
        need.append("old_logprobs")  # else rollout_logprobs stand in for them
    return tuple(need)


def _over_temperature(logits: Any, temperature: float) -> Any:
    """``logits / temperature`` in place, for logits straight out of the LM head (a linear layer:
    autograd keeps its input, not its output), so no second (tokens, vocab) tensor is made."""
    return logits.div_(temperature) if temperature != 1.0 else logits


class _CausalLM(ZeroModule):
    """Log-probs of response tokens under an AutoModelForCausalLM in a DeepSpeed engine."""

    config: ActorConfig

    def __init__(self, model_path: str, config: ActorConfig, *, train: bool, tokenizer: Any = None,
                 storage: Any = None, lora: Any = None):
        from transformers import AutoModelForCausalLM

        super().__init__(
            model_path, config, auto_class=AutoModelForCausalLM, train=train, tokenizer=tokenizer,
            storage=storage, lora=lora,
        )
        # The chunked path calls the LM head itself; a model whose forward transforms the head's
        # output (Gemma 2's final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling)
        # would get other log-probs from it than from its own logits, and than vLLM's.
        self._chunkable_head = self._head_gives_the_logits()
        if not self._chunkable_head and config.entropy_from_logits_with_chunking is True:
            raise TrainInputError(
                f"entropy_from_logits_with_chunking=true: {type(self.engine.module).__name__}'s forward "
                "changes its LM head's output (e.g. logit soft-capping or scaling), which the chunked "
                "log-probs would skip; set it to 'auto' (full logits for this model) or false")

    def _head_gives_the_logits(self) -> bool:
        """Whether the model's logits are its output embedding applied to its last hidden state,
        as the chunked log-probs compute them: one forward of a few tokens, compared."""
        import torch

        n = min(8, self.model_config.vocab_size)
        ids = torch.arange(n, device=self.device).unsqueeze(0)
        mb = {"packed": self.config.use_remove_padding, "input_ids": ids, "position_ids": ids,
              "attention_mask": torch.ones_like(ids), "cu_seq_lens": torch.tensor([0, n], dtype=torch.int32)}
        with torch.no_grad(), self.compute_precision():  # the head in the forward's precision
            out = self._forward(mb, output_hidden_states=True)
            mine = self.engine.module.get_output_embeddings()(out.hidden_states[-1])
        return torch.allclose(mine.float(), out.logits.float(), rtol=1e-4, atol=1e-5)

    def _response_logits(self, mb: dict[str, Any]) -> Any:
        """Logits ``(m, V)`` (fp32, over the temperature) predicting the micro-batch's response
        tokens in ``_flat`` order; HF computes only these rows (padded: the last R+1)."""
        if mb["packed"]:
            logits = self._forward(mb, logits_to_keep=mb["token_index"]).logits[0]
        else:
            R = mb["response_width"]
            logits = self._forward(mb, logits_to_keep=R + 1).logits[:, :R, :]
            logits = logits.reshape(-1, logits.shape[-1])
        logits = logits.float()  # not divided in place: a model's own last op may keep its output (tanh soft-capping)
        return logits / self.config.temperature if self.config.temperature != 1.0 else logits

    def _response_hidden(self, mb: dict[str, Any]) -> Any:
        """Final (normed) hidden states ``(m, H)`` that predict the response tokens, ``_flat``
        order; the forward computes no logits at all."""
        import torch

        none = torch.zeros(0, dtype=torch.long, device=self.device)
        out = self._forward(mb, logits_to_keep=none, output_hidden_states=True)
        h = out.hidden_states[-1]
        if mb["packed"]:
            return h[0, mb["token_index"]]
        P, R = mb["prompt_width"], mb["response_width"]
        return h[:, P - 1 : P + R - 1].reshape(-1, h.shape[-1])

    def _head_terms(self, head: Any, hidden: Any, labels: Any, with_entropy: bool):
        with self.compute_precision():
            logits = head(hidden)
        logits = _over_temperature(logits.float(), self.config.temperature)
        return token_terms(logits, labels, self.config, with_entropy)

    def _response_terms(self, mb: dict[str, Any], with_entropy: bool = True):
        """Per-token (log_prob, entropy) ``(b, R)`` of the responses (entropy None without
        ``with_entropy``). With entropy_from_logits_with_chunking, and always without grad (a
        log-prob pass: nothing to recompute, so chunks cost nothing), the LM head runs on
        entropy_chunk_size tokens at a time, checkpointed under grad: peak logits memory is one
        chunk's, ``entropy_chunk_size x vocab x 4`` bytes, instead of the micro-batch's. "auto"
        checkpoints only a micro-batch of more than one chunk: one chunk's backward holds its
        logits whether they were kept or re-run, so re-running it would cost time and save no
        memory (the LM head's forward again: 0.6 s of SmolLM2's 11 s update, 4 micro-batches).
        A model whose forward changes the head's output (``_head_gives_the_logits``) always takes
        its own full logits."""
        import torch

        labels = self._flat(mb["responses"], mb)
        chunking = self.config.entropy_from_logits_with_chunking
        if self._chunkable_head and (chunking or not torch.is_grad_enabled()):  # True or "auto"
            from torch.utils.checkpoint import checkpoint

            hidden, head = self._response_hidden(mb), self.engine.module.get_output_embeddings()
            step, parts = self.config.entropy_chunk_size, []
            rerun = torch.is_grad_enabled() and (chunking is True or hidden.shape[0] > step)
            for s in range(0, hidden.shape[0], step):
                args = (head, hidden[s : s + step], labels[s : s + step], with_entropy)
                parts.append(checkpoint(self._head_terms, *args, use_reentrant=False)
                             if rerun else self._head_terms(*args))
            log_prob = torch.cat([p[0] for p in parts])
            entropy = torch.cat([p[1] for p in parts]) if with_entropy else None
        else:
            log_prob, entropy = token_terms(self._response_logits(mb), labels, self.config, with_entropy)
        return self._rows(log_prob, mb), None if entropy is None else self._rows(entropy, mb)

    def _read(self, batch: Any, require: tuple[str, ...] = ()) -> Rows:
        return read_rows(batch, require=require, vocab_size=self.model_config.vocab_size)

    def _log_probs_of(self, rows: Rows) -> list[np.ndarray]:
        return self._map_rows_no_grad(
            rows,
            lambda mb: self._response_terms(mb, with_entropy=False)[0],
            self.config.log_prob_micro_batch_size_per_gpu,
        )

    def compute_log_probs(self, batch: Any) -> list[np.ndarray]:
        """Per-row float32 log-probs of each response token (no grad), on every rank."""
        return self._log_probs_of(self._read(batch))

    def compute_argmax_match(self, batch: Any) -> list[np.ndarray]:
        """Per row, float32 1.0 where a response token is the model's argmax given the tokens
        before it (no grad): greedy decoding's choice under teacher forcing, which SFT's held-out
        exact match reads (gpu_jobs.algos.sft.greedy_exact). Full logits per micro-batch."""
        def match(mb: dict[str, Any]) -> Any:
            labels = self._flat(mb["responses"], mb)
            return self._rows((self._response_logits(mb).argmax(-1) == labels).float(), mb)

        return self._map_rows_no_grad(self._read(batch), match, self.config.log_prob_micro_batch_size_per_gpu)


class RefModel(_CausalLM):
    """Frozen reference policy: ``RefModel(path, ActorConfig()).compute_log_probs(batch)``."""

    def __init__(self, model_path: str, config: ActorConfig | None = None, *, tokenizer: Any = None,
                 storage: Any = None):
        super().__init__(model_path, config or ActorConfig(), train=False, tokenizer=tokenizer, storage=storage)


class PolicyTrainer(_CausalLM, InProcessTrainer):
    """PPO-family policy updates with gpu_jobs.algos losses on a DeepSpeed engine.

        trainer = PolicyTrainer(model_dir, ActorConfig(ppo_mini_batch_size=2))
        metrics = trainer.update(table)   # {"actor/pg_loss": ..., "actor/grad_norm": ...}
    """

    def __init__(
        self,
        model_path: str,
        config: ActorConfig | None = None,
        *,
        tokenizer: Any = None,
        kl_controller: Any = None,
        storage: Any = None,
        lora: Any = None,
    ) -> None:
        """``lora``: a gpu_jobs.models.lora.LoraSpec to train adapters on a frozen base."""
        config = config or ActorConfig()
        set_host_memory(config.host_memory)  # the process's, before the model is built (memory.py)
        super().__init__(model_path, config, train=True, tokenizer=tokenizer, storage=storage,
                         lora=lora)
        self.kl_controller = kl_controller  # its state travels with save()/load()
        # A training-mode forward equals the eval-mode one only without active dropout.
        from torch.nn.modules.dropout import _DropoutNd

        self._no_dropout = getattr(self.model_config, "attention_dropout", 0.0) == 0 and all(
            m.p == 0 for m in self.engine.module.modules() if isinstance(m, _DropoutNd))

    # ---- the update ----------------------------------------------------------------------
    @property
    def probes_in_update(self) -> bool:
        """Whether ``update(batch, probe=...)`` can hand the agreement probe the log-probs of its
        own first mini-batch: this process holds the whole model (one rank), a training-mode
        forward equals the eval-mode one (no active dropout), and a probe that fails can drop the
        mini-batch's gradients by clearing ``param.grad`` (ZeRO stage 0; stages 1-3 keep theirs
        in the optimizer's partitions)."""
        return self.world_size == 1 and self._no_dropout and self.zero_stage == 0

    def update(self, batch: Any, probe: Callable[[Any, Any, Any], None] | None = None) -> dict[str, float]:
        """One policy update on ``batch`` (pyarrow.Table): ppo_epochs passes of shuffled
        mini-batches, one optimizer step each. Returns verl-named metrics. Every input check
        runs before the first weight changes.

        ``probe(rollout_logprobs, trainer_logprobs, response_mask)``, each ``(1, N)`` over the N
        response tokens of the first mini-batch, is called before that mini-batch's optimizer
        step: its forwards scored it with the weights that sampled it, so this is a
        trainer/rollout agreement check that costs no forward of its own (needs
        ``probes_in_update``). If it raises, the update stops there with the trainer unchanged
        (weights, optimizer state, gradients, shuffling generator).
        """
        from gpu_jobs.algos import get_policy_loss_fn

        t0 = time.perf_counter()
        c = self.config
        loss_fn = get_policy_loss_fn(c.policy_loss.loss_mode)
        require = required_columns(c, batch)
        if probe is not None:
            if not self.probes_in_update:
                raise ValueError("this trainer cannot score the agreement probe in its update (several ranks, ZeRO "
                                 "stage 1-3, or dropout): check agreement with compute_log_probs before update()")
            require = tuple(dict.fromkeys((*require, "rollout_logprobs")))
        rows = self._read(batch, require)
        old_from_forward = c.recompute_old_logprobs and self._single_step(rows)
        old_seconds = 0.0
        if c.recompute_old_logprobs and not old_from_forward:
            rows.columns["old_logprobs"] = self._log_probs_of(rows)
            old_seconds = time.perf_counter() - t0
        elif not c.recompute_old_logprobs and "old_logprobs" not in rows.columns:
            rows.columns["old_logprobs"] = rows.columns["rollout_logprobs"]
        first = _FirstMiniBatch(probe)
        shuffle_state = self._shuffle.get_state()
        try:
            metrics = self._run_update(
                rows, lambda mb: self._loss(mb, loss_fn, old_from_forward, first), c.policy_loss.loss_agg_mode,
                role="actor", prep_seconds=old_seconds, before_first_step=first.before_step if probe else None,
            )
        except BaseException:
            if first.failed:  # nothing trained yet: the next update shuffles as this one would have
                self._shuffle.set_state(shuffle_state)
            raise
        if c.recompute_old_logprobs:  # else a 0 here would overwrite the logprobs stage's own time
            metrics["timing_s/old_log_prob"] = old_seconds
        return metrics

    def preference_update(self, batch: Any, preference: Any) -> dict[str, float]:
        """One DPO/KTO update on a committed preference batch (rows with ref_logprobs, role and
        unit; gpu_jobs/train/preference.py): ppo_epochs passes of shuffled mini-batches of whole
        units, one optimizer step each, with the engine, optimizer, lr schedule and step loop of
        update() (loop.update_steps, loop.optimizer_step). Returns TRL-named metrics (rewards/*,
        logps/*, kl for KTO) averaged over the update, with actor/preference_loss,
        actor/grad_norm and actor/lr. One rank only (module doc of preference.py)."""
        from .preference import NanWeightedMeans, PreferenceBatch

        if self.world_size > 1:
            raise TrainInputError(f"preference (DPO/KTO) updates train on one rank, not {self.world_size}: KTO's "
                                  "reference point and the pair shares are not reduced over ranks")
        t0, c = time.perf_counter(), self.config
        rows = self._read(batch, ("ref_logprobs",))
        layout = PreferenceBatch.of(batch, preference)
        means = NanWeightedMeans()  # KTO reports NaN for a side a micro-batch lacks: skipped, not averaged in

        def forward(micro: list[int]):
            mb = self._collate(rows, micro, micro[0])
            return layout.loss(self._response_terms(mb, with_entropy=False)[0], mb, micro)

        def train_minibatch(mini: list[list[int]], first: bool) -> None:
            micros = layout.micro_batches(mini, c.ppo_micro_batch_size_per_gpu)
            optimizer_step(self.engine, micros, forward, self.world_size, means, PhaseTimer())

        self.engine.train()
        shuffle = self._shuffle if c.shuffle else None
        lr = update_steps(c, self.optimizer, self.step, lambda: layout.minibatches(c.ppo_mini_batch_size, shuffle),
                          train_minibatch)
        trim_heap()  # as after update(): the activations' pages go back (memory.py)
        self.step += 1
        self.samples_seen += len(rows)
        out = means.mean()
        out["actor/grad_norm"] = out.pop("grad_norm")
        out.update({"actor/lr": lr, "timing_s/update_actor": time.perf_counter() - t0})
        return out

    def sft_update(self, batch: Any) -> dict[str, float]:
        """One supervised update on a committed SFT batch (prompt_ids, response_ids and
        response_mask, 1 on the assistant's tokens; gpu_jobs/stages/sft_data.py): the token-mean
        negative log-likelihood (gpu_jobs.algos.sft.sft_loss) through update()'s loop: ppo_epochs
        passes of shuffled mini-batches of ppo_mini_batch_size demonstrations, micro-batches
        weighted by their share of the loss tokens, one optimizer step each, on every rank.
        Returns train/loss (verl's SFT name), actor/grad_norm, actor/lr, perf/* and timings."""
        from gpu_jobs.algos.sft import sft_loss

        def loss_of(mb: dict[str, Any]):
            return sft_loss(self._response_terms(mb, with_entropy=False)[0], mb["response_mask"])

        return self._run_update(self._read(batch), loss_of, "token-mean", role="actor")

    def _single_step(self, rows: Rows) -> bool:
        """Whether this update is one optimizer step from unchanged weights with a deterministic
        forward: then every micro-batch's forward scores it with the weights the separate
        old-log-prob pass would use, and that pass can be skipped (TRL does the same)."""
        c = self.config
        return (c.ppo_epochs == 1 and c.ppo_mini_batch_size * rows.samples_per_prompt >= len(rows)
                and self._no_dropout)

    def _loss(self, mb: dict[str, Any], loss_fn: Any, old_from_forward: bool = False,
              first: "_FirstMiniBatch | None" = None):
        log_prob, entropy = self._response_terms(mb)
        if first is not None:
            first.collect(mb, log_prob)
        if old_from_forward:  # ratio = exp(log_prob - log_prob.detach()): 1, with the PPO gradient
            mb = {**mb, "old_logprobs": log_prob.detach()}
        return policy_loss(log_prob, entropy, mb, loss_fn, self.config)

    def reference(self) -> "AdapterOffRef":
        """With LoRA, the reference model is this trainer with its adapter switched off (verl's
        way): the base weights, no second copy of the model."""
        if self.lora is None:
            raise ValueError("reference() needs a LoRA trainer; build a RefModel for full fine-tuning")
        return AdapterOffRef(self)

    # ---- exact resume extras -------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        kl = self.kl_controller
        return {"kl_controller": kl.state_dict() if hasattr(kl, "state_dict") else None}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if self.kl_controller is not None and state.get("kl_controller") is not None:
            self.kl_controller.load_state_dict(state["kl_controller"])


class _FirstMiniBatch:
    """The probe of PolicyTrainer.update: collects the trainer's log-probs of the first
    mini-batch's response tokens as its forwards score them, and hands them with the rollout's to
    ``probe`` once, before that mini-batch's optimizer step."""

    def __init__(self, probe: Callable[[Any, Any, Any], None] | None):
        self.probe, self.failed, self.parts = probe, False, []

    def collect(self, mb: dict[str, Any], log_prob: Any) -> None:
        if self.probe is not None:
            keep = mb["response_mask"].bool()
            self.parts.append((mb["rollout_logprobs"][keep], log_prob.detach()[keep]))

    def before_step(self) -> None:
        import torch

        if self.probe is None:
            return
        probe, self.probe = self.probe, None
        rollout, trainer = (torch.cat([part[i] for part in self.parts])[None] for i in (0, 1))
        self.parts = []
        try:
            probe(rollout, trainer, torch.ones_like(rollout))
        except BaseException:
            self.failed = True
            raise


class AdapterOffRef:
    """RefModel's face over a LoRA PolicyTrainer: log-probs under the base model (the adapter
    disabled for the pass; peft's disable_adapter context restores it)."""

    def __init__(self, trainer: PolicyTrainer):
        self.trainer = trainer

    def compute_log_probs(self, batch: Any) -> list[np.ndarray]:
        with self.trainer.engine.module.disable_adapter():
            return self.trainer.compute_log_probs(batch)

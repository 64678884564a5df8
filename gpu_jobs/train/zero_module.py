"""What the policy, the reference model and the critic share: an HF model inside a DeepSpeed
engine, sharded row iteration, gathered weights and HF checkpoints.

Not public: use PolicyTrainer, RefModel or Critic.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .attention import attention_for_packing
from .batch import Rows, collate, plan_microbatches
from .checkpoint import Resumable
from .config import _UpdateConfig
from .loop import MetricSums, PhaseTimer, adamw, optimizer_step, optimizer_steps
from .memory import trim_heap
from .ranks import dist

__all__ = ["ZeroModule"]

LossOf = Callable[[dict[str, Any]], tuple[Any, dict[str, Any]]]


def load_tokenizer_if_any(model_path: str) -> Any:
    """The folder's tokenizer, or None for a weights-only folder (AutoTokenizer would invent
    an empty one there); save_hf then writes no tokenizer files."""
    if not any(os.path.exists(os.path.join(model_path, f))
               for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


class ZeroModule(Resumable):
    """An HF model wrapped in a DeepSpeed engine (``self.zero_stage``: the config's, with "auto"
    resolved for this world size).

    Subclasses pass ``auto_class`` (e.g. AutoModelForCausalLM) and ``train`` (with an AdamW
    optimizer) and add their losses.
    """

    def __init__(
        self,
        model_path: str,
        config: _UpdateConfig,
        *,
        auto_class: Any,
        train: bool,
        tokenizer: Any = None,
        config_overrides: dict[str, Any] | None = None,
        storage: Any = None,
        lora: Any = None,
    ) -> None:
        import torch

        dist.init_distributed()
        self.config = config
        self.lora = lora  # gpu_jobs.models.lora.LoraSpec: train adapters only; None = every weight
        self.storage = storage  # StorageConfig for save/load/save_hf URLs (None: AWS env vars)
        from gpu_jobs.models import resolve_model_path

        self.model_path = resolve_model_path(model_path, storage)
        self.rank, self.world_size = dist.rank(), dist.world_size()
        self.zero_stage = config.resolved_zero_stage(self.world_size)  # "auto" made concrete
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer_if_any(self.model_path)
        self.step = 0  # update() calls so far
        self.samples_seen = 0  # data cursor: rows consumed by update() so far
        self._shuffle = torch.Generator().manual_seed(config.seed)
        with torch.random.fork_rng(devices=[]):  # seed a fresh head (critic), keep the caller's RNG
            torch.manual_seed(config.seed)
            model = self._build_model(auto_class, config_overrides or {})
        if train and config.checkpoints_layers(model.config):
            # Non-reentrant: works with inputs that need no grad and with ZeRO-3's hooks.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model_config = model.config
        self._param_shapes = {
            n: list(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()
        }
        # Names that are a second name of a parameter (lm_head.weight tied to the embedding):
        # consolidated ZeRO checkpoints list them, named_parameters() does not.
        self._aliases = set(model.state_dict()) - set(self._param_shapes) - {
            n for n, _ in model.named_buffers()
        }
        self.engine, self.optimizer = self._build_engine(model, train)
        self.device = self.engine.device

    # ---- construction --------------------------------------------------------------------
    def _build_model(self, auto_class: Any, overrides: dict[str, Any]) -> Any:
        import torch
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(self.model_path)
        # Set, not passed as from_pretrained kwargs: transformers 5 drops a kwarg that is not
        # already a field of the config class (the critic's classifier_dropout=0.0 was ignored,
        # leaving its value head's dropout at 0.1).
        for key, value in overrides.items():
            setattr(hf_config, key, value)
        # fp32 whatever config.dtype: bf16 computes under autocast (compute_precision), over fp32
        # weights, gradients and Adam state.
        kwargs = {"config": hf_config, "dtype": torch.float32}
        if self.config.use_remove_padding:
            kwargs["attn_implementation"] = attention_for_packing(hf_config)
        if self.zero_stage != 3:
            model = auto_class.from_pretrained(self.model_path, **kwargs)
            if self.lora is None:
                return model
            from gpu_jobs.models.lora import apply_lora

            return apply_lora(model, self.lora)  # under the caller's seeded RNG: lora_A's init
        if self.lora is not None:
            raise ValueError("LoRA adapters with ZeRO-3: set zero_stage to 0, 1, 2 or 'auto' on one rank")
        from transformers.integrations import HfDeepSpeedConfig
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        # HfDeepSpeedConfig makes from_pretrained build inside zero.Init, so no rank ever holds
        # the full model. It is a process-wide switch: unset it at once, or every later
        # from_pretrained in this process (a rollout engine, a test) would be partitioned too.
        hf_ds = HfDeepSpeedConfig(self.config.deepspeed_config(self.world_size))
        try:
            return auto_class.from_pretrained(self.model_path, **kwargs)
        finally:
            del hf_ds
            unset_hf_deepspeed_config()

    def _build_engine(self, model: Any, train: bool) -> tuple[Any, Any]:
        import deepspeed

        ds_config = self.config.deepspeed_config(self.world_size, train=train)
        if not train:
            model.requires_grad_(False)
            engine, *_ = deepspeed.initialize(model=model, config=ds_config)
            return engine, None
        # Frozen weights (a LoRA base) stay out of the optimizer: no moments, no decay for them.
        optimizer = adamw(self.config, [p for p in model.parameters() if p.requires_grad])
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config
        )
        if self.world_size == 1 and self.zero_stage == 0:
            # Nothing to average over one rank: DeepSpeed would still flatten every gradient into
            # one buffer, all-reduce it with itself and copy it back (0.2 s per SmolLM2 step).
            engine.enable_backward_allreduce = False
        return engine, optimizer

    def compute_precision(self) -> Any:
        """The context every forward runs in (its backward follows it): ``torch.autocast`` to
        bf16 when ``config.dtype`` is bf16, else nothing.

        Why autocast and not DeepSpeed's bf16: DeepSpeed keeps bf16 weights over an fp32 master
        in a ZeRO-1+ optimizer, whose step cost 3x the fp32 one on CPU (1.04 s against 0.34 s on
        SmolLM2, bench_update --compare-dtype), and whose gradients a failed agreement probe
        cannot drop (ZeRO-0 only). Autocast keeps the weights, gradients and Adam state fp32 (a
        ZeRO-0 fp32 engine, checkpoint and optimizer step) and runs the matmuls in bf16, as TRL's
        bf16=True does: forward and backward 2.2 + 4.6 s against an all-bf16 module's 2.1 + 4.4 s
        (4 micro-batches of 8 rows of SmolLM2). It casts the weights in every forward, so many
        small micro-batches cost more: 9.6 s per update with 8 of 4 rows, 7.4 s with one of 32."""
        import torch

        if self.config.dtype != "bf16":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    # ---- the update loop -----------------------------------------------------------------
    def _run_update(self, rows: Rows, loss_of: LossOf, agg_mode: str, role: str,
                    prep_seconds: float = 0.0, before_first_step: Callable[[], None] | None = None
                    ) -> dict[str, float]:
        """ppo_epochs passes of shuffled mini-batches, one optimizer step each; returns the
        metrics of ``loss_of`` averaged over steps and ranks, plus lr, throughput and timings.
        ``prep_seconds`` (e.g. recomputing old log-probs) counts towards perf/throughput.
        ``before_first_step`` runs once, before the first optimizer step; if it raises, the first
        mini-batch's gradients are dropped and nothing trains."""
        timer, t0 = PhaseTimer(), time.perf_counter()
        sums = MetricSums()
        self.engine.train()

        def train_minibatch(mini: np.ndarray, first: bool) -> None:
            before_step = before_first_step if first else None
            self._train_minibatch(rows, mini, loss_of, agg_mode, timer, sums, before_step)

        lr = optimizer_steps(self.config, self.optimizer, self.step, rows, self._shuffle, train_minibatch)
        trim_heap()  # the activations' pages: else they stay resident until the next update (memory.py)
        self.step += 1
        self.samples_seen += len(rows)
        seconds = time.perf_counter() - t0
        out = sums.mean()
        out[f"{role}/grad_norm"] = out.pop("grad_norm")
        tokens = self.config.ppo_epochs * sum(
            len(p) + len(r) for p, r in zip(rows.prompt_ids, rows.response_ids)
        )
        out.update({
            f"{role}/lr": lr,
            "perf/total_num_tokens": float(tokens),
            "perf/throughput": tokens / max(seconds + prep_seconds, 1e-9) / self.world_size,
            f"timing_s/update_{role}": seconds,
        })
        out.update({f"timing_s/update_{role}/{k}": v for k, v in timer.seconds.items()})
        return out

    def _train_minibatch(self, rows: Rows, mini: np.ndarray, loss_of: LossOf, agg_mode: str,
                         timer: PhaseTimer, sums: MetricSums,
                         before_step: Callable[[], None] | None = None) -> None:
        """Accumulate gradients over this rank's micro-batches, then one optimizer step.

        Each micro-batch loss is scaled by its share of the mini-batch (tokens for token-mean,
        rows otherwise) times world_size (DeepSpeed averages gradients over ranks), so the step
        equals one step on the whole mini-batch whatever the micro-batching or rank count
        (loop.optimizer_step, which the preference update takes its steps with too)."""
        c = self.config
        tokens, n = max(1, rows.response_tokens(mini)), len(mini)
        # Dr. GRPO's constant normaliser is the padded width: keep it the batch's, not the micro's.
        pad_to = max(map(len, rows.response_ids)) if agg_mode == "seq-mean-token-sum-norm" else None
        micros = self._local_microbatches(
            rows, mini, micro_size=c.ppo_micro_batch_size_per_gpu,
            max_tokens=c.ppo_max_token_len_per_gpu if c.use_dynamic_bsz else None,
        )
        shares = [rows.response_tokens(m) / tokens if agg_mode == "token-mean" else len(m) / n for m in micros]
        fallback = int(mini[0])
        optimizer_step(self.engine, list(zip(micros, shares)),
                       lambda micro: loss_of(self._collate(rows, micro, fallback, pad_to)),
                       self.world_size, sums, timer, before_step)
        sums.steps += 1

    # ---- sharded iteration ---------------------------------------------------------------
    def _local_microbatches(
        self, rows: Rows, idx: Sequence[int], *, micro_size: int, max_tokens: int | None
    ) -> list[list[int]]:
        """This rank's micro-batches of the rows ``idx``, padded with empty entries so every
        rank runs the same number of forwards (ZeRO-3 gathers weights collectively per forward)."""
        local = list(idx)[self.rank :: self.world_size]
        micro = plan_microbatches(rows, local, micro_size=micro_size, max_tokens=max_tokens,
                                  packed=self.config.use_remove_padding)
        n = int(dist.all_reduce_max(len(micro)))
        return micro + [[] for _ in range(n - len(micro))]

    def _collate(self, rows: Rows, micro: list[int], fallback: int, pad_to: int | None = None):
        """Tensors on the engine's device; an empty micro-batch becomes row ``fallback`` (its
        loss is multiplied by 0: it only keeps this rank in step with the others)."""
        batch = collate(rows, micro or [fallback], pad_response_to=pad_to,
                        packed=self.config.use_remove_padding)
        # cu_seq_lens stays on the host: the packed attention reads the row bounds there, and a
        # device copy would cost a sync in every layer on a GPU.
        return {k: v.to(self.device) if hasattr(v, "to") and k != "cu_seq_lens" else v
                for k, v in batch.items()}

    # ---- the two layouts -----------------------------------------------------------------
    def _forward(self, mb: dict[str, Any], **kwargs: Any) -> Any:
        """The HF model's output on a collated micro-batch (``kwargs`` to its forward), computed
        in the configured precision (``compute_precision``)."""
        with self.compute_precision():
            return self.engine(**self._model_inputs(mb), **kwargs)

    @staticmethod
    def _model_inputs(mb: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments of the HF forward for a collated micro-batch, padded or packed."""
        if not mb["packed"]:
            return {"input_ids": mb["input_ids"], "attention_mask": mb["attention_mask"],
                    "position_ids": mb["position_ids"], "use_cache": False}
        # attention_mask=None with restarting position_ids; cu_seq_lens_q (flash-attention's
        # name) reaches the attention function through transformers' **kwargs.
        return {"input_ids": mb["input_ids"], "position_ids": mb["position_ids"], "use_cache": False,
                "cu_seq_lens_q": mb["cu_seq_lens"]}

    @staticmethod
    def _flat(x: Any, mb: dict[str, Any]) -> Any:
        """A ``(b, R)`` response tensor in the order the model's outputs come in: all ``b * R``
        slots (padded), or the ``n`` real tokens (packed)."""
        flat = x.reshape(-1)
        return flat[mb["token_slot"]] if mb["packed"] else flat

    @staticmethod
    def _rows(flat: Any, mb: dict[str, Any]) -> Any:
        """``_flat``'s inverse: ``(m,)`` per-token outputs back to ``(b, R)``, zeros in the
        slots a packed micro-batch has no token for (response_mask is 0 there)."""
        b, R = mb["response_mask"].shape
        if not mb["packed"]:
            return flat.reshape(b, R)
        return flat.new_zeros(b * R).index_copy(0, mb["token_slot"], flat).reshape(b, R)

    def _map_rows_no_grad(
        self, rows: Rows, fn: Callable[[dict[str, Any]], Any], micro_size: int
    ) -> list[np.ndarray]:
        """``fn(micro_batch) -> (b, R) tensor`` on every row, sharded over ranks, returned as one
        float32 array per row (response length) on every rank."""
        import torch

        idx = np.arange(len(rows))
        max_tokens = self.config.ppo_max_token_len_per_gpu if self.config.use_dynamic_bsz else None
        local: dict[int, np.ndarray] = {}
        self.engine.eval()
        with torch.no_grad():
            for micro in self._local_microbatches(
                rows, idx, micro_size=micro_size, max_tokens=max_tokens
            ):
                out = fn(self._collate(rows, micro, fallback=0)).float().cpu().numpy()
                for j, i in enumerate(micro):
                    local[i] = out[j, : len(rows.response_ids[i])].copy()
        trim_heap()
        merged: dict[int, np.ndarray] = {}
        for part in dist.all_gather_object(local):
            merged.update(part)
        return [merged[i] for i in range(len(rows))]

    # ---- weights out ---------------------------------------------------------------------
    def _gather_params(self, params: list[Any], modifier_rank: int | None = None):
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)

    def gathered_state_dict(self) -> dict[str, Any]:
        """Full fp32 weights (HF names) on rank 0, ``{}`` on other ranks. All ranks must call it.

        Gathers one parameter at a time, so peak extra memory is one full tensor per rank.
        """
        import torch

        module = self.engine.module
        if self.lora is not None:  # one rank, ZeRO <= 2: every weight is whole here
            from gpu_jobs.models.lora import merged_state_dict

            return merged_state_dict(module) if self.rank == 0 else {}
        out: dict[str, torch.Tensor] = {}
        for name, p in module.named_parameters():
            with self._gather_params([p]):
                if self.rank == 0:
                    out[name] = p.detach().to(torch.float32, copy=True).cpu()
        keys = set(module.state_dict().keys()) if self.rank == 0 else set()
        for name, b in module.named_buffers():
            if name in keys:  # persistent buffers only, as in state_dict()
                out[name] = b.detach().to(torch.float32, copy=True).cpu()
        return out

    def save_hf(self, url: str) -> str | None:
        """Write an HF safetensors checkpoint (config, tokenizer, weights) to ``url`` via storage;
        loads with ``from_pretrained``. All ranks call it; rank 0 writes and returns the URL."""
        if self.lora is not None:
            return self._save_adapter(url)
        state = self.gathered_state_dict()
        result = None
        if self.rank == 0:
            from storage import save_checkpoint

            result = save_checkpoint(url, state, config=self.model_config, tokenizer=self.tokenizer,
                                     storage=self.storage)
        dist.barrier()
        return result

    def _save_adapter(self, url: str) -> str | None:
        """A LoRA policy folder: the adapter (KBs to MBs), the tokenizer and a pointer to the
        base model (storage.save_adapter); readers merge it (gpu_jobs.models.lora)."""
        from gpu_jobs.models.lora import adapter_config_dict, adapter_tensors
        from storage.checkpoints import save_adapter

        result = None
        if self.rank == 0:
            module = self.engine.module
            result = save_adapter(url, adapter_tensors(module), adapter_config=adapter_config_dict(module, self.model_path),
                                  base=self.lora.pointer(), tokenizer=self.tokenizer, storage=self.storage)
        dist.barrier()
        return result

    # ---- weights in ----------------------------------------------------------------------
    def load_weights(self, state: dict[str, Any]) -> None:
        """Copy a full state dict (HF names) into the engine; every rank passes the same dict.
        The optimizer's fp32 master copy is refreshed; its moments are left as they are."""
        import torch

        state = {k: v for k, v in state.items() if k not in self._aliases}
        self.check_shapes({k: list(v.shape) for k, v in state.items()}, "state dict")
        for name, p in self.engine.module.named_parameters():
            with self._gather_params([p], modifier_rank=0):
                if self.rank == 0 or self.zero_stage != 3:
                    with torch.no_grad():
                        p.data.copy_(state[name].to(p.dtype))
        refresh = getattr(self.engine.optimizer, "refresh_fp32_params", None)
        if self.optimizer is not None and refresh is not None:
            refresh()

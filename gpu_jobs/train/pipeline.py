"""Pipeline-parallel policy updates: DeepSpeed PipelineModule with ZeRO stage 0 or 1.

DeepSpeed cannot combine pipeline parallelism with ZeRO-2/3 (ActorConfig rejects that), so
this is the second trainer config next to ZeRO-3 data parallelism. Run it on
``pipeline_parallel_size x data_parallel`` ranks:

    torchrun --nproc_per_node 2 my_script.py   # with
    trainer = PipelinePolicyTrainer(model_dir, ActorConfig(pipeline_parallel_size=2, zero_stage=1))
    metrics = trainer.update(batch)             # same batch on every rank, same metrics back

The HF decoder is cut into layers [embed, decoder x L, norm, lm_head] (the lm_head tied to the
embedding when the model ties them). Each rank builds the whole HF model once and keeps its
stage: fine for the small models this is tested on, wasteful for big ones. The old log-probs
are recomputed through the pipeline (eval_batch) with the same loss machinery.
save()/load() resume exactly with the same world size, pipeline size and ZeRO stage; another
layout is refused (no consolidated-weights fallback for pipeline checkpoints yet).

This module imports torch at the top: load it only where a pipeline is wanted.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from .ranks import dist
from .batch import Rows, collate, plan_microbatches, read_rows
from .checkpoint import Resumable
from .config import ActorConfig
from gpu_jobs.models import resolve_model_path

from .zero_module import load_tokenizer_if_any
from .errors import TrainInputError
from .loop import MetricSums, PhaseTimer, adamw, optimizer_steps
from .memory import set_host_memory
from .policy import policy_objective, required_columns
from .protocol import InProcessTrainer, Probe

__all__ = ["PipelinePolicyTrainer"]

_LABELS = ("responses", "response_mask", "old_logprobs", "advantages", "ref_logprobs", "scale")


class _Embed(nn.Module):
    """(input_ids, position_ids, attention_mask) -> (hidden, position_ids, attention_mask)."""

    def __init__(self, embed_tokens: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens

    def hf_params(self):
        return [("model.embed_tokens.weight", self.embed_tokens.weight)]

    def forward(self, inputs):
        ids, pos, mask = inputs
        return self.embed_tokens(ids), pos, mask


class _Block(nn.Module):
    """One HF decoder layer; rebuilds the causal mask and rotary angles from the int tensors
    that travel between stages (only the hidden state needs a gradient)."""

    def __init__(self, hf_config: Any, layer: nn.Module, rotary: nn.Module, index: int):
        super().__init__()
        self.hf_config, self.layer, self.rotary, self.index = hf_config, layer, rotary, index

    def hf_params(self):
        return [(f"model.layers.{self.index}.{n}", p) for n, p in self.layer.named_parameters()]

    def forward(self, inputs):
        h, pos, mask = inputs
        causal = create_causal_mask(config=self.hf_config, inputs_embeds=h, attention_mask=mask,
                                    past_key_values=None, position_ids=pos)
        h = self.layer(h, attention_mask=causal, position_ids=pos,
                       position_embeddings=self.rotary(h, pos))
        return h, pos, mask


class _Norm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def hf_params(self):
        return [("model.norm.weight", self.norm.weight)]

    def forward(self, inputs):
        return self.norm(inputs[0])


class _Head(nn.Module):
    def __init__(self, lm_head: nn.Module):
        super().__init__()
        self.lm_head = lm_head

    def hf_params(self):
        return [("lm_head.weight", self.lm_head.weight)]

    def forward(self, h):
        return self.lm_head(h).float()


def _tied_head(module: _Embed, h: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(h, module.embed_tokens.weight).float()


def _layers(hf: Any) -> list[Any]:
    """The HF causal LM as pipeline layers: embed, decoder x L, norm, lm_head. A tied lm_head
    is a TiedLayerSpec of the embedding (DeepSpeed all-reduces its gradient across stages)."""
    from deepspeed.pipe import TiedLayerSpec

    model = hf.model
    blocks = [_Block(hf.config, model.layers[i], model.rotary_emb, i)
              for i in range(hf.config.num_hidden_layers)]
    if not hf.config.tie_word_embeddings:
        return [_Embed(model.embed_tokens), *blocks, _Norm(model.norm), _Head(hf.lm_head)]
    tied = dict(tied_weight_attr=["embed_tokens.weight"])
    return [TiedLayerSpec("embed", _Embed, model.embed_tokens, **tied), *blocks, _Norm(model.norm),
            TiedLayerSpec("embed", _Embed, model.embed_tokens, forward_fn=_tied_head, **tied)]


def _sum_over_ranks(sums: MetricSums) -> dict[str, float]:
    """Metric sums exist only on last-stage ranks, so merge dicts rather than all-reduce lists."""
    merged: dict[str, float] = {}
    for part in dist.all_gather_object(dict(sums.sums)):
        for k, v in part.items():
            merged[k] = merged.get(k, 0.0) + v
    return {k: v / max(1, sums.steps) for k, v in merged.items()}


class PipelinePolicyTrainer(Resumable, InProcessTrainer):
    """PolicyTrainer's ``update``, ``compute_log_probs``, ``gathered_state_dict``, ``save_hf``,
    ``save`` and ``load`` on a DeepSpeed pipeline (``config.pipeline_parallel_size`` stages,
    ZeRO stage 0 or 1; data parallel over the remaining ranks). Tested in fp32."""

    def __init__(self, model_path: str, config: ActorConfig, *, tokenizer: Any = None) -> None:
        import deepspeed
        import torch
        from deepspeed.pipe import PipelineModule
        from transformers import AutoModelForCausalLM

        set_host_memory(config.host_memory)  # the process's (memory.py)
        dist.init_distributed()
        pp = config.pipeline_parallel_size
        if pp < 2 or dist.world_size() % pp:
            raise TrainInputError(
                f"PipelinePolicyTrainer needs pipeline_parallel_size >= 2 dividing the world size "
                f"({dist.world_size()} ranks), got {pp}; use PolicyTrainer for ZeRO-3 data parallel."
            )
        self.config, self.rank, self.world_size = config, dist.rank(), dist.world_size()
        self.step, self.samples_seen = 0, 0
        self.model_path = resolve_model_path(model_path)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer_if_any(self.model_path)
        # bf16 weights in bf16: DeepSpeed's bf16 (below) keeps the fp32 master copy.
        dtype = torch.bfloat16 if config.dtype == "bf16" else torch.float32
        hf = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        self.model_config = hf.config
        self._param_shapes = {n: list(p.shape) for n, p in hf.named_parameters()}
        self.pipe = PipelineModule(layers=_layers(hf), num_stages=pp, loss_fn=self._loss_fn,
                                   partition_method="uniform", dynamic_shape=True)
        ds = config.deepspeed_config(dist.world_size() // pp)
        # DeepSpeed's PipelineEngine runs the stages' forwards itself: no autocast around them
        # (ZeroModule's bf16); its own bf16 keeps bf16 weights over fp32 master weights instead.
        ds["bf16"] = {"enabled": config.dtype == "bf16"}
        optimizer = adamw(config, [p for p in self.pipe.parameters() if p.requires_grad])
        self.engine, *_ = deepspeed.initialize(model=self.pipe, optimizer=optimizer, config=ds)
        self.optimizer = optimizer
        self.dp_rank, self.dp_size = self.engine.grid.data_parallel_id, self.engine.grid.data_parallel_size
        self._shuffle = torch.Generator().manual_seed(config.seed)
        self._mode = "train"
        self._outputs: list[Any] = []

    # ---- the loss as DeepSpeed's pipeline calls it (last stage only) ----------------------
    def _loss_fn(self, logits: Any, labels: tuple) -> Any:
        mb = dict(zip(_LABELS, labels))
        R = mb["responses"].shape[1]
        logits = logits[:, -R - 1 : -1, :] / self.config.temperature
        if self._mode == "logprobs":
            from gpu_jobs.algos import logprobs_from_logits

            self._outputs.append(logprobs_from_logits(logits, mb["responses"]).detach().cpu())
            return logits.sum() * 0.0
        loss, metrics = policy_objective(logits, mb, self._loss_impl, self.config)
        self._outputs.append((metrics, float(mb["scale"][0])))
        # The pipeline engine divides by its gradient_accumulation_steps: "scale" undoes that
        # and applies this micro-batch's share of the mini-batch (see ZeroModule._train_minibatch).
        return loss * mb["scale"][0]

    # ---- batches -------------------------------------------------------------------------
    def _micro_items(self, rows: Rows, mini: np.ndarray, shares: bool) -> list[tuple]:
        import torch

        c = self.config
        local = list(mini)[self.dp_rank :: self.dp_size]
        micros = plan_microbatches(rows, local, micro_size=c.ppo_micro_batch_size_per_gpu,
                                   max_tokens=c.ppo_max_token_len_per_gpu if c.use_dynamic_bsz else None)
        n_micro = int(dist.all_reduce_max(len(micros)))
        micros += [[] for _ in range(n_micro - len(micros))]
        tokens, n = max(1, rows.response_tokens(mini)), len(mini)
        items = []
        for micro in micros:
            mb = collate(rows, micro or [int(mini[0])])
            share = rows.response_tokens(micro) / tokens if c.policy_loss.loss_agg_mode == "token-mean" else len(micro) / n
            scale = share * self.dp_size * n_micro if shares else 1.0
            zeros = torch.zeros_like(mb["response_mask"])
            labels = tuple(mb.get(k, zeros) for k in _LABELS[:-1]) + (torch.tensor([scale]),)
            items.append(((mb["input_ids"], mb["position_ids"], mb["attention_mask"]), labels, micro))
        return items

    def _run(self, items: list[tuple], train: bool) -> Any:
        self.engine.set_train_batch_size(len(items) * self.dp_size)
        data = iter([(inp, lab) for inp, lab, _ in items])
        if train:
            return self.engine.train_batch(data_iter=data)
        return self.engine.eval_batch(data_iter=data, num_micro_batches=len(items))

    def compute_log_probs(self, batch: Any) -> list[np.ndarray]:
        """Per-row float32 log-probs of each response token (no grad), on every rank."""
        return self._old_logprobs(read_rows(batch, vocab_size=self.model_config.vocab_size))

    def _old_logprobs(self, rows: Rows) -> list[np.ndarray]:
        self._mode, self._outputs, local = "logprobs", [], {}
        items = self._micro_items(rows, np.arange(len(rows)), shares=False)
        self._run(items, train=False)
        if self.engine.is_last_stage():
            for (_, _, micro), lp in zip(items, self._outputs):
                local.update({i: lp[j, : len(rows.response_ids[i])].numpy() for j, i in enumerate(micro)})
        merged: dict[int, np.ndarray] = {}
        for part in dist.all_gather_object(local):
            merged.update(part)
        self._mode = "train"
        return [merged[i] for i in range(len(rows))]

    # ---- the update ----------------------------------------------------------------------
    def update(self, batch: Any, probe: Probe | None = None) -> dict[str, float]:
        """Same contract and metric names as PolicyTrainer.update; no ``probe`` (several ranks)."""
        from gpu_jobs.algos import get_policy_loss_fn

        if probe is not None:
            raise ValueError("a pipeline cannot score the agreement probe in its update: check agreement with "
                             "compute_log_probs before update()")
        c, timer, t0 = self.config, PhaseTimer(), time.perf_counter()
        self._loss_impl = get_policy_loss_fn(c.policy_loss.loss_mode)
        rows = read_rows(batch, require=required_columns(c, batch), vocab_size=self.model_config.vocab_size)
        with timer("old_log_prob"):
            if c.recompute_old_logprobs:
                rows.columns["old_logprobs"] = self._old_logprobs(rows)
            elif "old_logprobs" not in rows.columns:
                rows.columns["old_logprobs"] = rows.columns["rollout_logprobs"]
        sums = MetricSums()
        lr = optimizer_steps(c, self.optimizer, self.step, rows, self._shuffle,
                             lambda mini, first: self._train_minibatch(rows, mini, timer, sums))
        self.step += 1
        self.samples_seen += len(rows)
        return self._metrics(rows, sums, timer, lr, time.perf_counter() - t0)

    def _train_minibatch(self, rows: Rows, mini: np.ndarray, timer: PhaseTimer, sums: MetricSums) -> None:
        """One optimizer step: DeepSpeed's train_batch runs the micro-batches through the stages."""
        self._outputs = []
        with timer("train_batch"):
            self._run(self._micro_items(rows, mini, shares=True), train=True)
        n_micro = max(1, len(self._outputs))
        for metrics, scale in self._outputs:  # filled on the last stage only
            sums.add(metrics, scale / (self.dp_size * n_micro))
        if self.engine.is_last_stage():
            sums.add({"grad_norm": float(self.engine.get_global_grad_norm() or 0.0)}, 1.0 / self.dp_size)
        sums.steps += 1

    def _metrics(self, rows: Rows, sums: MetricSums, timer: PhaseTimer, lr: float,
                 seconds: float) -> dict[str, float]:
        out = _sum_over_ranks(sums)
        out["actor/grad_norm"] = out.pop("grad_norm")
        tokens = self.config.ppo_epochs * sum(len(p) + len(r) for p, r in zip(rows.prompt_ids, rows.response_ids))
        out.update({"actor/lr": lr, "perf/total_num_tokens": float(tokens),
                    "perf/throughput": tokens / seconds / dist.world_size(),
                    "timing_s/update_actor": seconds - timer.seconds["old_log_prob"],
                    "timing_s/old_log_prob": timer.seconds.pop("old_log_prob")})
        out.update({f"timing_s/update_actor/{k}": v for k, v in timer.seconds.items()})
        return out

    # ---- weights out ---------------------------------------------------------------------
    def gathered_state_dict(self) -> dict[str, Any]:
        """Full fp32 weights (HF names) on rank 0, ``{}`` elsewhere; all ranks call it."""
        local = {}
        for module in self.pipe.modules():
            if hasattr(module, "hf_params"):
                local.update({n: p.detach().float().cpu().clone() for n, p in module.hf_params()})
        parts = dist.all_gather_object(local if self.dp_rank == 0 else {})
        if self.rank != 0:
            return {}
        out: dict[str, Any] = {}
        for part in parts:
            out.update(part)
        return out

    def save_hf(self, url: str) -> str | None:
        """HF safetensors checkpoint at ``url`` (rank 0 writes); loads with from_pretrained."""
        state = self.gathered_state_dict()
        result = None
        if self.rank == 0:
            from storage import save_checkpoint

            result = save_checkpoint(url, state, config=self.model_config, tokenizer=self.tokenizer)
        dist.barrier()
        return result

    def load_weights(self, state: dict[str, Any]) -> None:
        """Called by load() only for a checkpoint of another layout, which pipelines refuse."""
        raise TrainInputError(
            "this pipeline trainer state was saved with another world size, pipeline_parallel_size "
            "or zero_stage: resume it with the layout it was saved with, or start from its HF "
            "checkpoint (save_hf) with a fresh optimizer."
        )

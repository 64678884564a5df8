"""Typed configs for the policy trainer and the critic (verl field names), and their DeepSpeed view.

    from gpu_jobs.train import ActorConfig
    cfg = ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=8, lr=1e-5)
    cfg.deepspeed_config(world_size=2)   # the dict handed to deepspeed.initialize
    cfg.resolved_zero_stage(world_size=1)  # 0: zero_stage "auto" on one rank
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpu_jobs.algos import KLConfig, PolicyLossConfig

from .memory import HostMemory

__all__ = ["ActorConfig", "CriticConfig", "PIPELINE_ZERO_ERROR"]

PIPELINE_ZERO_ERROR = (
    "zero_stage={stage} with pipeline_parallel_size={pp}: DeepSpeed cannot combine pipeline "
    "parallelism with ZeRO-2/3 (it asserts 'ZeRO-2 and ZeRO-3 are incompatible with pipeline "
    "parallelism'). Fix: set zero_stage to 0 or 1 to keep pipeline_parallel_size={pp}, or set "
    "pipeline_parallel_size=1 to keep ZeRO-{stage} data parallelism."
)

# Options only the ZeRO trainers (policy.py, critic.py) implement, refused with a pipeline when
# set to true rather than ignored. Their default, "auto" (on), the pipeline goes without, as it
# pads instead of use_remove_padding.
_PIPELINE_UNSUPPORTED = ("gradient_checkpointing", "entropy_from_logits_with_chunking")

# gradient_checkpointing="auto": bytes of activations a decoder layer keeps for the backward per
# token and hidden unit without checkpointing (measured on SmolLM2-135M: ~50 KB per token per
# layer at hidden size 576), and the micro-batch's activations past which it is turned on.
ACTIVATION_BYTES_PER_UNIT = 88
ACTIVATION_BUDGET_BYTES = 1 << 30


class _UpdateConfig(BaseModel):
    """Fields the actor and the critic share: batching, optimizer, schedule, parallelism."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    ppo_epochs: int = Field(1, ge=1, description="Passes over each batch per update() call.")
    ppo_mini_batch_size: int = Field(
        16,
        ge=1,
        description="Prompts per optimizer step, as in verl: a mini-batch is this many prompts "
        "times their n samples (rows sharing a group_id). Without group_id, rows.",
    )
    ppo_micro_batch_size_per_gpu: int = Field(
        4, ge=1, description="Rows per forward/backward on one rank (ignored with use_dynamic_bsz)."
    )
    use_dynamic_bsz: bool = Field(
        False,
        description="Pack micro-batches by a token budget (ppo_max_token_len_per_gpu) instead of "
        "a fixed row count.",
    )
    ppo_max_token_len_per_gpu: int = Field(
        16384,
        ge=1,
        description="With use_dynamic_bsz: tokens per micro-batch on one rank, counted as the "
        "model sees them: padded (rows x (prompt+response width)), or with use_remove_padding the "
        "real prompt+response tokens. A longer single row gets a micro-batch of its own.",
    )
    use_remove_padding: bool = Field(
        True,
        description="verl's name. Pack each micro-batch's rows into one sequence without padding: "
        "position_ids restart at 0 per row and attention runs causally within each row (SDPA), so "
        "the forward/backward costs the real tokens, not rows x widest row. Same log-probs, values "
        "and gradients as the padded layout (allclose; tests/train/test_packing.py). Measured on "
        "one CPU rank, interleaved A/B: update 12% faster on a 16M-param model with 8 rows of "
        "40-56 tokens (14% padding); update 5-22% and compute_log_probs 16-26% faster on the "
        "built-in model with arithmetic-sized rows (256 of 8-13 tokens); on par (-5%..+7%) on the "
        "built-in model with 8 rows of 40-56 tokens. The saving grows with the spread of lengths. "
        "False: the padded layout. The pipeline trainer (pipeline_parallel_size > 1) always pads.",
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto",
        description="verl's name (verl's default: on); 'auto' or true/false. HF "
        "gradient_checkpointing_enable, non-reentrant: keep only each decoder layer's input in the "
        "forward and recompute the layer in the backward. Same gradients. Without it a micro-batch "
        "keeps every layer's activations for the backward, ~50 KB per token per layer in fp32 on "
        "SmolLM2-135M (14 GB for an 8192-token micro-batch); with it ~2.3 KB per token per layer "
        "plus one layer. 'auto': on when a micro-batch of ppo_max_token_len_per_gpu tokens would "
        "keep more than 1 GiB of activations (estimated as 88 bytes per token per layer per hidden "
        "unit, SmolLM2's measured rate): on for SmolLM2-135M and the 16M bench model, off for the "
        "built-in model, whose update it would make ~1.9x slower for nothing; off under a pipeline, "
        "which does not implement it. Measured on CPU: update peak 8.1 -> 4.7 GB (SmolLM2-135M, "
        "one 3124-token micro-batch, with entropy_from_logits_with_chunking); 1109 -> 696 MB on a "
        "16M-param model (8 layers, 4 rows of 1088 tokens) for ~1.35x the update time.",
    )
    shuffle: bool = Field(True, description="Shuffle rows into mini-batches with a seeded generator.")

    def checkpoints_layers(self, hf_config: Any) -> bool:
        """gradient_checkpointing made concrete for a model ("auto": see the field)."""
        if self.gradient_checkpointing != "auto":
            return bool(self.gradient_checkpointing)
        layers, hidden = getattr(hf_config, "num_hidden_layers", None), getattr(hf_config, "hidden_size", None)
        if not layers or not hidden:  # an architecture without these names: bound the memory
            return True
        return ACTIVATION_BYTES_PER_UNIT * layers * hidden * self.ppo_max_token_len_per_gpu > ACTIVATION_BUDGET_BYTES

    lr: float = Field(1e-6, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    lr_warmup_steps: int = Field(
        0, ge=0, description="update() calls over which lr rises linearly to `lr`."
    )
    lr_scheduler: Literal["constant", "cosine"] = Field(
        "constant", description="Learning-rate shape after warm-up (verl lr_scheduler_type)."
    )
    total_training_steps: int | None = Field(
        None, ge=1, description="update() calls in the run; required by the cosine schedule."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="Cosine floor as a fraction of `lr`."
    )
    grad_clip: float = Field(
        1.0, ge=0, description="Global gradient-norm clip; 0 disables (set explicitly for DeepSpeed)."
    )
    zero_stage: Literal["auto", 0, 1, 2, 3] = Field(
        "auto",
        description="DeepSpeed ZeRO stage. 3 shards weights, gradients and optimizer state over "
        "the data-parallel ranks; 0 keeps everything whole. 'auto': on one data-parallel rank 0 "
        "(ZeRO-3 there only adds weight gathers); on more ranks 3, "
        "or 1 with pipeline_parallel_size > 1 (which cannot use 2/3). Checkpoints record the "
        "resolved stage.",
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Pipeline stages; >1 needs zero_stage 0 or 1 (DeepSpeed limitation)."
    )
    dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="Training precision. bf16: the forwards and backwards compute in bf16 (torch.autocast: "
        "matmuls and their activations) over fp32 weights, gradients and Adam state, as TRL's bf16=True and "
        "verl's FSDP mixed precision; log-probs, losses and norms stay fp32. Under a pipeline "
        "(pipeline_parallel_size > 1): DeepSpeed's bf16 (bf16 weights over fp32 master weights). 'auto': bf16 where the machine computes bf16 natively (a "
        "CUDA GPU with bf16; a CPU with AVX512_BF16, AMX or Arm BF16), else fp32 (gpu_jobs/models/precision.py); "
        "resolved when the config is read, so `rlmill config show` prints what runs.")
    seed: int = Field(1, description="Seeds the shuffle generator and any freshly initialised head.")

    @field_validator("dtype", mode="before")
    @classmethod
    def _resolve_auto(cls, value: Any) -> Any:
        from gpu_jobs.models.precision import resolve_dtype

        choices = get_args(cls.model_fields["dtype"].annotation)
        return resolve_dtype(value, "trainer", choices) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> "_UpdateConfig":
        if self.pipeline_parallel_size > 1 and self.zero_stage in (2, 3):
            raise ValueError(
                PIPELINE_ZERO_ERROR.format(stage=self.zero_stage, pp=self.pipeline_parallel_size)
            )
        if self.pipeline_parallel_size > 1:
            ignored = [k for k in _PIPELINE_UNSUPPORTED if getattr(self, k, False) is True]
            if ignored:
                raise ValueError(
                    f"{', '.join(ignored)} with pipeline_parallel_size={self.pipeline_parallel_size}: "
                    "the pipeline trainer does not implement it; set it to false, or "
                    "pipeline_parallel_size=1."
                )
        if self.lr_scheduler == "cosine" and self.total_training_steps is None:
            raise ValueError(
                "lr_scheduler='cosine' needs total_training_steps (the number of update() calls); "
                "set it, or use lr_scheduler='constant'."
            )
        return self

    def lr_at(self, step: int) -> float:
        """Learning rate for the update() call numbered ``step`` (0-based)."""
        import math

        if self.lr_warmup_steps and step < self.lr_warmup_steps:
            return self.lr * (step + 1) / self.lr_warmup_steps
        if self.lr_scheduler == "constant":
            return self.lr
        span = max(1, self.total_training_steps - self.lr_warmup_steps)
        progress = min(1.0, (step - self.lr_warmup_steps) / span)
        scale = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * scale

    def resolved_zero_stage(self, world_size: int) -> int:
        """The ZeRO stage a DeepSpeed group of ``world_size`` data-parallel ranks runs: zero_stage,
        with 'auto' resolved (one rank: 0; more: 3, or 1 under a pipeline)."""
        if self.zero_stage != "auto":
            return self.zero_stage
        if world_size == 1:
            return 0
        return 1 if self.pipeline_parallel_size > 1 else 3

    def deepspeed_config(self, world_size: int, train: bool = True) -> dict[str, Any]:
        """The DeepSpeed config dict for ``world_size`` data-parallel ranks. Micro-batching is
        ours: DeepSpeed sees gas=1 and we mark the accumulation boundary ourselves, so
        token-budget micro-batches can vary in number. DeepSpeed runs fp32 whatever ``dtype``: bf16
        is the trainer's autocast (ZeroModule), except under a pipeline (PipelinePolicyTrainer
        turns on DeepSpeed's bf16 itself)."""
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "train_batch_size": world_size,
            "gradient_clipping": self.grad_clip,
            "zero_optimization": {"stage": self.resolved_zero_stage(world_size)},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        if not train:
            cfg.pop("gradient_clipping")
        return cfg


class ActorConfig(_UpdateConfig):
    """Policy (actor) update: PPO-family losses from gpu_jobs.algos on a DeepSpeed engine."""

    entropy_coeff: float = Field(
        0.0, description="Weight of the entropy bonus subtracted from the loss (verl entropy_coeff)."
    )
    policy_loss: PolicyLossConfig = Field(
        default_factory=PolicyLossConfig,
        description="Policy loss variant and its clip ratios / aggregation mode (gpu_jobs.algos).",
    )
    kl_loss: KLConfig = Field(
        default_factory=KLConfig,
        description="KL-to-reference loss (use_kl_loss, kl_loss_coef, kl_loss_type); needs a "
        "ref_logprobs column when enabled.",
    )
    recompute_old_logprobs: bool = Field(
        True,
        description="Compute old_logprobs with the current weights before the first mini-batch "
        "(verl's default). When the update is a single optimizer step (ppo_epochs 1 and one "
        "mini-batch holding the whole batch) the weights have not moved when each micro-batch is "
        "scored, so the old log-probs are taken, detached, from the update's own forward (as TRL "
        "does) instead of a separate no-grad pass. False: use the batch's old_logprobs, else "
        "rollout_logprobs.",
    )
    entropy_from_logits_with_chunking: bool | Literal["auto"] = Field(
        "auto",
        description="verl's name (default off there); 'auto' (on, re-running the LM head only for a "
        "micro-batch of more than entropy_chunk_size response tokens: one chunk's backward holds its "
        "logits either way; off under a pipeline, which does not implement it, and for a model whose "
        "forward changes its LM head's output, e.g. Gemma 2's logit soft-capping) or true/false. "
        "Compute log-probs and entropy from the "
        "final hidden states in chunks of entropy_chunk_size response tokens, re-running the LM "
        "head per chunk in the backward, so the full (response tokens, vocab) logits never exist "
        "(fp32 logits of an 8192-token micro-batch of SmolLM2, vocabulary 49152, are 1.6 GB, and "
        "their gradient as much again): peak logits memory is one chunk's. Same results. Measured "
        "on CPU: peak update memory 1135 -> 590 MB (vocab 16k, 4 rows of 1024 response tokens), "
        "for ~1.1-1.3x the update time. Log-prob passes (no grad) always run in chunks: there is "
        "nothing to re-run. False: one logits tensor per micro-batch.",
    )
    entropy_chunk_size: int = Field(
        1024, ge=1, description="Response tokens per chunk with entropy_from_logits_with_chunking."
    )
    temperature: float = Field(
        1.0, gt=0, description="Logits are divided by it: the rollout's sampling temperature. In a "
        "run it is always rollout.temperature (not a run setting); a standalone trainer passes the "
        "temperature its samples were drawn with."
    )
    log_prob_micro_batch_size_per_gpu: int = Field(
        8, ge=1, description="Rows per forward in compute_log_probs (no grad)."
    )
    host_memory: HostMemory = Field(
        "release", description="What the trainer's process does with the host (C heap) memory a pass "
        "frees, on glibc (gpu_jobs/train/memory.py). 'release': glibc's settings, and the freed pages go "
        "back to the OS after every update and log-prob pass (malloc_trim), so the process rests at its "
        "live tensors; each update faults its memory in again (~0.85M page faults per SmolLM2 update of "
        "1.5k tokens). 'keep': large tensors come from the heap (no mmap) and nothing is trimmed, so an "
        "update reuses the pages of the last one: no page faults from the third update on; a SmolLM2 "
        "update beside an in-process vLLM engine took 0.79-0.84x the time on 2 CPU cores (0.93x "
        "without one). The process rests at its peak, and what every phase freed (validation, "
        "checkpoints) stays too: the peak rose 0.2 GB in bench_e2e's run, 1.7-2.8 GB in a whole "
        "make run-smollm2 (8.8-10.0 GB against 7.1-7.2). Set for the whole "
        "process (glibc's settings are per process): the last trainer built decides. No effect on a "
        "GPU's memory or on another C library."
    )


class CriticConfig(_UpdateConfig):
    """Value model update: clipped value loss (PPO) on a scalar head over the LM's hidden states."""

    lr: float = Field(1e-5, gt=0, description="Peak AdamW learning rate.")
    cliprange_value: float = Field(
        0.5, ge=0, description="Clip new values to old values +- this (PPO value clipping)."
    )
    loss_agg_mode: str = Field(
        "token-mean", description="Aggregation of the per-token value loss (gpu_jobs.algos.agg_loss)."
    )
    critic_warmup: int = Field(
        0, ge=0, description="The first this-many iterations update only the critic: the actor's "
        "weights (and optimizer, lr schedule) start moving at iteration critic_warmup + 1."
    )
    log_prob_micro_batch_size_per_gpu: int = Field(
        8, ge=1, description="Rows per forward in compute_values (no grad)."
    )

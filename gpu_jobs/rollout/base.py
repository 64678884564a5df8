"""The rollout interface shared by every backend, its configs, and the backend registry.

    >>> from gpu_jobs.rollout import get_rollout_engine, SamplingConfig
    >>> engine = get_rollout_engine("hf", "/path/to/hf/folder", RolloutEngineConfig())
    >>> rows = engine.generate([[7, 11, 14, 8, 9, 18]], n=4,
    ...                        sampling=SamplingConfig(temperature=1.0, max_response_length=8, seed=0))
    >>> rows[0]["response_ids"], rows[0]["rollout_logprobs"], rows[0]["finish_reason"]

What `rollout_logprobs` means (the same in every backend): the log-probability of each sampled
token under the distribution it was actually sampled from, i.e. log_softmax of
logits / temperature after top-k and top-p filtering (renormalised). With temperature 0
(greedy) it is the plain log_softmax of the logits. This is vLLM's
`logprobs_mode="processed_logprobs"`; with the RL defaults (top_k=-1, top_p=1) it equals
what a trainer computes as log_softmax(logits / temperature), which is what importance-sampling
corrections between rollout and trainer need.

A response includes its final EOS token when finish_reason is "stop".
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, get_args, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpu_jobs.registry import Registry


class SamplingConfig(BaseModel):
    """How to sample responses; temperature 0 means greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 = greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1.0 = off.")
    top_k: int = Field(-1, description="Keep the k most likely tokens; -1 (or 0) = off.")
    max_response_length: int = Field(32, ge=1, description="Most tokens generated per response.")
    seed: int | None = Field(None, description="Sampling seed; None = not reproducible.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks only).")

    @model_validator(mode="after")
    def _check_top_k(self) -> "SamplingConfig":
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        return self


class RolloutEngineConfig(BaseModel):
    """Engine settings (not per-call sampling): dtype, batching, vLLM memory knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights/activations dtype of the rollout model. 'auto': bfloat16 where the machine "
        "computes bf16 natively (a CUDA GPU with bf16; a CPU with AVX512_BF16, AMX or Arm BF16), else float32 "
        "(gpu_jobs/models/precision.py), resolved when the config is read.")
    max_batch_size: int = Field(
        256, ge=1, description="hf: most sequences decoded together (prompts x n); vllm: max_num_seqs.")
    compact_fraction: float = Field(
        0.125, gt=0.0, le=1.0,
        description="hf: drop finished rows from the batch once this fraction of it has "
                    "finished (dropping copies the KV cache, so not after every row).")
    max_model_len: int | None = Field(
        None, description="vllm: longest prompt+response; None = the model's maximum.")
    kv_cache_memory_bytes: int = Field(1 << 30, description="vllm: KV cache size in bytes.")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="vllm: memory share.")
    enforce_eager: bool = Field(True, description="vllm: no CUDA graphs / compilation (CPU needs it).")
    seed: int = Field(0, description="vllm: engine seed (used when a request has no seed).")
    data_parallel_size: int = Field(
        1, ge=1, description="Rollout replicas, each its own process with a full copy of the weights; prompts are "
        "split evenly and every weight sync reaches every replica (verl rollout data parallelism). On GPU "
        "replica j uses devices j*tensor_parallel_size..; on CPU the replicas share the cores.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="vllm on CUDA only: GPUs one replica's model is split across (vLLM tensor "
        "parallelism, verl rollout.tensor_model_parallel_size).")

    @field_validator("dtype", mode="before")
    @classmethod
    def _resolve_auto(cls, value: Any) -> Any:
        from gpu_jobs.models.precision import resolve_dtype

        choices = get_args(cls.model_fields["dtype"].annotation)
        return resolve_dtype(value, "rollout", choices) if isinstance(value, str) else value


Row = dict[str, Any]  # prompt_index, sample_index, prompt_ids, response_ids, rollout_logprobs, finish_reason


@runtime_checkable
class RolloutEngine(Protocol):
    """What every rollout backend provides."""

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list[Row]:
        """`n` responses per prompt, prompt-major: row k is prompt k // n, sample k % n.

        Each row: prompt_index, sample_index, prompt_ids (list[int]), response_ids (list[int],
        EOS included when it stopped on it), rollout_logprobs (list[float], one per response
        token, see the module docstring), finish_reason ("stop" | "length").
        """
        ...

    def update_weights(self, weights: Any) -> None:
        """Load new weights: an in-memory state dict (name -> tensor, HF names) or a checkpoint
        folder path / storage URL. Later generate calls use only the new weights."""
        ...

    # Multi-turn rollouts (gpu_jobs.rollout.agent_loop) also need, from both backends:
    #   score_tokens(sequences, temperature) -> per sequence, the log-prob of each token after the
    #   first by teacher forcing (the tool turns' tokens, which were not sampled).


ROLLOUT_ENGINES: Registry = Registry("rollout engine")
register_rollout_engine = ROLLOUT_ENGINES.register
"""Decorator registering a backend factory `(model, config, **kwargs) -> RolloutEngine`."""


def get_rollout_engine(name: str, model_path, config: RolloutEngineConfig | None = None,
                       **kwargs) -> RolloutEngine:
    """Build the backend `name` ("hf" | "vllm") on `model_path` (a local HF folder, a storage
    URL, "builtin" for the built-in tiny model; "hf" also takes an nn.Module). kwargs go to
    the backend (both take `storage=StorageConfig`; "hf" also `tokenizer=`). The backends
    register themselves when the package is imported (gpu_jobs/rollout/__init__.py), which
    importing this module already did."""
    config = config or RolloutEngineConfig()
    check_parallelism(name, config)
    if config.data_parallel_size > 1:  # built one layer up: the replicas build their engines through here
        raise ValueError(f"data_parallel_size={config.data_parallel_size} is several roles: build them with "
                         "gpu_jobs.rollout.data_parallel.build_rollout_engine")
    return ROLLOUT_ENGINES[name](model_path, config, **kwargs)


def check_parallelism(name: str, config: RolloutEngineConfig, cuda: bool | None = None) -> None:
    """Refuse parallel layouts the backend or machine cannot run, naming the fix."""
    if config.tensor_parallel_size == 1:
        return
    if name != "vllm":
        raise ValueError(f"rollout tensor parallelism is vLLM's: tensor_parallel_size="
                         f"{config.tensor_parallel_size} needs rollout.engine=vllm (the {name} engine runs whole "
                         f"models); or set it to 1")
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        raise ValueError(f"rollout tensor_parallel_size={config.tensor_parallel_size} splits the model across "
                         f"GPUs and no CUDA device is visible: set it to 1 on CPU (use data_parallel_size for "
                         f"replicas)")


def make_row(prompt_index: int, sample_index: int, prompt_ids, response_ids, logprobs,
             finish_reason: str) -> Row:
    """One output row with plain Python types (lists of int/float), as the sample table wants."""
    return {
        "prompt_index": prompt_index,
        "sample_index": sample_index,
        "prompt_ids": [int(t) for t in prompt_ids],
        "response_ids": [int(t) for t in response_ids],
        "rollout_logprobs": [float(x) for x in logprobs],
        "finish_reason": finish_reason,
    }

"""A trainer's weights into the rollout engine, and how they are cut into buckets on the way.

    n = stream_weights_into_rollout(rollout, trainer)   # parts sent (1: one whole state dict)

Buckets hold whole layers (plan_buckets): vLLM 0.32's reload_weights keeps a layer that is absent
from a call but rebuilds one that is only partly present (a fused qkv_proj/gate_up_proj) from
partial data. The rank group's ranks (ranks/worker.py) and the in-process trainers
(protocol.InProcessTrainer.iter_weight_buckets) cut them the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["DEFAULT_BUCKET_BYTES", "stream_weights_into_rollout", "plan_buckets", "layer_key", "state_dict_buckets"]

DEFAULT_BUCKET_BYTES = 256 << 20


def stream_weights_into_rollout(engine: Any, trainer: Any, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                                dtype: Any = None) -> int:
    """Hand the trainer's full weights to a rollout engine; returns the number of parts sent.

    An engine with ``update_weights_partial(dict)`` (and optionally ``finish_weight_update()``,
    called after the last part) gets the weights bucket by bucket (``trainer.iter_weight_buckets``):
    from a rank group this process then holds one bucket at a time. Every other engine takes one
    whole state dict through ``update_weights``: this process then holds the full fp32 weights
    once (what the engine's API needs), plus, from a rank group, one bucket while reading the
    files; the ranks hold one bucket (rank 0) and one gathered parameter each. The rollout engines
    of gpu_jobs.rollout (hf, vllm) take whole dicts; the data-parallel one takes buckets."""
    from .memory import trim_heap

    partial = getattr(engine, "update_weights_partial", None)  # an optional extension of RolloutEngine
    if partial is None:
        engine.update_weights(trainer.gathered_state_dict())
        trim_heap()  # the gathered copy's pages (memory.py): measured +513 MB at rest on SmolLM2 without
        return 1
    n = 0
    for bucket in trainer.iter_weight_buckets(bucket_bytes, dtype):
        partial(dict(bucket))
        n += 1
    finish = getattr(engine, "finish_weight_update", None)
    if finish is not None:
        finish()
    trim_heap()
    return n


def state_dict_buckets(state: dict[str, Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: Any = None
                       ) -> Iterator[list[tuple[str, Any]]]:
    """A whole state dict as plan_buckets' buckets of (name, tensor), cast to ``dtype`` if given."""
    sizes = [(n, t.numel() * t.element_size()) for n, t in state.items()]
    for names in plan_buckets(sizes, bucket_bytes) if state else []:
        yield [(n, state[n] if dtype is None else state[n].to(dtype)) for n in names]


def plan_buckets(sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Group parameters (name, bytes) into buckets of about ``bucket_bytes``. A bucket ends only
    between two modules of different layers (decoder layer ``...layers.<i>``, else the parent
    module), so no layer is split across buckets (roles that reload layer by layer need that);
    a bucket exceeds ``bucket_bytes`` by at most one layer. Deterministic: every rank plans the
    same buckets."""
    buckets: list[list[str]] = []
    current: list[str] = []
    used, last_key = 0, None
    for name, size in sizes:
        key = layer_key(name)
        if current and key != last_key and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += size
        last_key = key
    if current or not buckets:
        buckets.append(current)
    return buckets


def layer_key(name: str) -> str:
    """``model.layers.3`` for ``model.layers.3.self_attn.q_proj.weight``; else the module path
    (``model.embed_tokens``, ``lm_head``)."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if parts[i] in ("layers", "h", "blocks", "layer") and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return ".".join(parts[:-1])

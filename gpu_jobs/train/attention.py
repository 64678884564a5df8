"""The attention packed micro-batches run with (use_remove_padding): causal SDPA over each packed
row separately, registered with transformers on first use (attention_for_packing).

No ``(T, T)`` mask is built and no score is computed between two rows: transformers builds no
mask at all for an implementation it has no mask function for, which is what this one wants.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PACKED_ATTENTION", "attention_for_packing"]

PACKED_ATTENTION = "rlmill_packed_sdpa"


def _packed_sdpa_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                           dropout: float = 0.0, scaling: float | None = None,
                           cu_seq_lens_q: Any = None, **kwargs: Any) -> tuple[Any, None]:
    """Causal SDPA within each packed row. ``query`` ``(1, heads, T, d)``, ``key``/``value``
    ``(1, kv_heads, T, d)``, rows bounded by ``cu_seq_lens_q`` ``(b+1,)``; returns
    ``(1, T, heads, d)`` as transformers' attention functions do. Rows of one length share one
    batched SDPA call, so the Python loop runs over distinct lengths, not rows."""
    import torch
    import torch.nn.functional as F

    unsupported = [k for k in ("sliding_window", "softcap", "s_aux") if kwargs.get(k) is not None]
    if cu_seq_lens_q is None or query.shape[0] != 1 or unsupported:
        raise RuntimeError(
            f"{PACKED_ATTENTION} runs packed micro-batches only (one row, cu_seq_lens_q) of models "
            f"without {unsupported or 'sliding windows, soft-capping or sinks'}; set "
            "use_remove_padding=false for this model."
        )
    bounds = cu_seq_lens_q.tolist()  # kept on the host by _collate: no device sync
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    order = sorted(range(len(lengths)), key=lengths.__getitem__)  # rows by length, stable
    groups: list[list[int]] = []  # [length, rows] runs of equal length in that order
    for j in order:
        if groups and groups[-1][0] == lengths[j]:
            groups[-1][1] += 1
        else:
            groups.append([lengths[j], 1])
    # One gather puts the rows in length order (its backward is one scatter); split() then hands
    # each group a view, and its backward is one concatenation. Slicing row by row instead
    # would cost a full-size zero gradient per row.
    sorted_already = order == list(range(len(order)))
    perm = None if sorted_already else torch.cat(
        [torch.arange(bounds[j], bounds[j + 1], device=query.device) for j in order])
    q, k, v = (x[0] if perm is None else x[0].index_select(1, perm) for x in (query, key, value))
    sizes = [length * rows for length, rows in groups]
    outputs = []
    for (length, rows), qg, kg, vg in zip(groups, q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1)):
        qg, kg, vg = (x.unflatten(1, (rows, length)).transpose(0, 1) for x in (qg, kg, vg))
        o = F.scaled_dot_product_attention(qg, kg, vg, dropout_p=dropout, scale=scaling, is_causal=True,
                                           enable_gqa=qg.shape[1] != kg.shape[1])  # (rows, h, L, d)
        outputs.append(o.transpose(0, 1).flatten(1, 2))  # (heads, rows * length, d)
    out = torch.cat(outputs, dim=1)
    if perm is not None:  # back to packed order
        out = out.new_empty(out.shape).index_copy(1, perm, out)
    return out.transpose(0, 1).unsqueeze(0), None


def attention_for_packing(hf_config: Any) -> str:
    """The attention implementation for packed rows: PACKED_ATTENTION, registered with
    transformers once per process; plain "sdpa" for a model with sliding-window layers (there
    transformers builds the block-diagonal mask itself from the restarting position_ids: right,
    but it computes the masked scores)."""
    from transformers import AttentionInterface

    layer_types = getattr(hf_config, "layer_types", None) or ["full_attention"]
    if set(layer_types) != {"full_attention"} or getattr(hf_config, "use_sliding_window", False):
        return "sdpa"
    if PACKED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_ATTENTION, _packed_sdpa_attention)
    return PACKED_ATTENTION

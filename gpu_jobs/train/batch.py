"""From a committed sample table to tensors: validation, collation, mini/micro-batch plans.

Padded layout of one micro-batch of ``b`` rows (``P`` = widest prompt, ``R`` = widest response):

    input_ids      (b, P+R)  prompts left-padded, responses right-padded
    attention_mask (b, P+R)  1 on real tokens
    position_ids   (b, P+R)  cumsum(attention_mask) - 1, so left padding does not shift positions
    responses      (b, R)    the response tokens; logits at P-1 .. P+R-2 predict them
    response_mask  (b, R)    1 on real response tokens the model generated (a multi-turn batch's
                             `response_mask` column puts 0 on tool turns' tokens: no loss there)
    <column>       (b, R)    float32 per-token columns (advantages, old_logprobs, ...), 0-padded

Packed layout (``collate(..., packed=True)``, verl's use_remove_padding): the ``T`` real tokens
of the rows, prompt then response, one row after the other, no padding:

    input_ids      (1, T)    row 0's prompt + response, row 1's, ...
    position_ids   (1, T)    restarting at 0 for each row
    cu_seq_lens    (b+1,)    int32 row boundaries in the packed sequence (flash-attention's name)
    token_index    (n,)      the packed positions whose outputs predict the n real response tokens
    token_slot     (n,)      where each of those n tokens sits in a flattened (b, R) tensor
    responses, response_mask, <column>   (b, R) as in the padded layout
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import TrainInputError

__all__ = ["Rows", "read_rows", "collate", "plan_minibatches", "plan_microbatches"]

TOKEN_COLUMNS = ("advantages", "old_logprobs", "rollout_logprobs", "ref_logprobs", "values", "returns")


@dataclass
class Rows:
    """A validated batch held as ragged numpy rows (one entry per response)."""

    prompt_ids: list[np.ndarray]
    response_ids: list[np.ndarray]
    columns: dict[str, list[np.ndarray]] = field(default_factory=dict)
    samples_per_prompt: int = 1
    masks: list[np.ndarray] | None = None  # per-token 1/0 (multi-turn); None = every token counts

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def lengths(self, idx: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(prompt lengths, response lengths) of the rows ``idx``."""
        return (
            np.array([len(self.prompt_ids[i]) for i in idx], dtype=np.int64),
            np.array([len(self.response_ids[i]) for i in idx], dtype=np.int64),
        )

    def response_tokens(self, idx: Sequence[int]) -> int:
        """Tokens of rows ``idx`` that carry a loss (token-mean's denominator)."""
        if self.masks is not None:
            return int(sum(self.masks[i].sum() for i in idx))
        return int(sum(len(self.response_ids[i]) for i in idx))


def _ragged(table: Any, name: str) -> list[np.ndarray]:
    arr = table.column(name).combine_chunks()
    if arr.null_count:
        bad = arr.is_null().to_numpy(zero_copy_only=False).nonzero()[0][0]
        raise TrainInputError(
            f"column {name!r} is null in row {bad}: every row needs a list; fix the stage that "
            f"wrote {name} (or drop the row before training)."
        )
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(arr))]


def _check_columns(table: Any, require: Sequence[str]) -> None:
    if table is None or table.num_rows == 0:
        raise TrainInputError(
            "empty batch: the table has 0 rows, so there is nothing to train on; check that the "
            "rollout stage committed samples (DAPO filter_groups can drop every group) and pass "
            "that manifest."
        )
    missing = [c for c in ("prompt_ids", "response_ids", *require) if c not in table.column_names]
    if missing:
        hint = {
            "advantages": "run the advantage stage (compute_advantage) first",
            "returns": "run the advantage stage (gae writes returns) first",
            "values": "run the critic's compute_values first",
            "ref_logprobs": "compute them with RefModel.compute_log_probs, or set kl_loss.use_kl_loss=false",
            "old_logprobs": "compute them with compute_log_probs, or set recompute_old_logprobs=true",
        }
        fixes = "; ".join(f"{c}: {hint.get(c, 'add it to the table')}" for c in missing)
        raise TrainInputError(
            f"batch is missing column(s) {missing} (has {table.column_names}). Fix: {fixes}."
        )


def _check_token_column(name: str, rows: list[np.ndarray], responses: list[np.ndarray]) -> None:
    for i, (vals, resp) in enumerate(zip(rows, responses)):
        if len(vals) != len(resp):
            raise TrainInputError(
                f"column {name!r} row {i} has {len(vals)} values but the response has {len(resp)} "
                f"tokens: per-token columns need one value per response token; recompute {name} "
                f"for this batch rather than reusing one from another batch."
            )
        if not np.isfinite(vals).all():
            j = int(np.flatnonzero(~np.isfinite(vals))[0])
            raise TrainInputError(
                f"column {name!r} row {i} token {j} is {vals[j]} (not finite): an update would "
                f"turn the weights into NaN; fix the stage that produced {name} (e.g. a reward "
                f"of NaN, or a zero-std group with norm_adv_by_std_in_grpo) and recompute it."
            )


def _check_tokens(prompts: list[np.ndarray], responses: list[np.ndarray], vocab_size: int) -> None:
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise TrainInputError(
                f"row {i} has an empty prompt: the first response token needs a prompt token to "
                f"be predicted from; drop the row or add a BOS token to the prompt."
            )
    if not any(len(r) for r in responses):
        raise TrainInputError(
            "every response in the batch is empty, so no token carries a loss; check the rollout "
            "stage (max_response_length, stop tokens)."
        )
    for name, seqs in (("prompt_ids", prompts), ("response_ids", responses)):
        for i, s in enumerate(seqs):
            if len(s) and (s.min() < 0 or s.max() >= vocab_size):
                raise TrainInputError(
                    f"{name} row {i} holds token id {int(s.max() if s.max() >= vocab_size else s.min())}"
                    f" outside the model's vocabulary [0, {vocab_size}): the batch was tokenized "
                    f"for another model; roll out with this model's tokenizer."
                )


def _samples_per_prompt(table: Any) -> int:
    if "group_id" not in table.column_names:
        return 1
    groups = len(set(table.column("group_id").to_pylist()))
    return max(1, round(table.num_rows / groups))


def read_rows(table: Any, *, require: Sequence[str] = (), vocab_size: int) -> Rows:
    """Validate a pyarrow sample table and return its rows; raises TrainInputError naming the fix.

    Checks: rows exist; prompt_ids, response_ids and ``require`` columns exist; no nulls;
    per-token columns have one finite value per response token; token ids fit ``vocab_size``.
    """
    _check_columns(table, require)
    prompts = [a.astype(np.int64) for a in _ragged(table, "prompt_ids")]
    responses = [a.astype(np.int64) for a in _ragged(table, "response_ids")]
    _check_tokens(prompts, responses, vocab_size)
    columns = {}
    for name in TOKEN_COLUMNS:
        if name in table.column_names:
            columns[name] = [a.astype(np.float32) for a in _ragged(table, name)]
            _check_token_column(name, columns[name], responses)
    return Rows(prompts, responses, columns, _samples_per_prompt(table), _read_masks(table, responses))


def _read_masks(table: Any, responses: list[np.ndarray]) -> list[np.ndarray] | None:
    """The optional ``response_mask`` column (multi-turn: 0 on tool tokens), checked."""
    if "response_mask" not in table.column_names:
        return None
    masks = [a.astype(np.float32) for a in _ragged(table, "response_mask")]
    _check_token_column("response_mask", masks, responses)
    for i, m in enumerate(masks):
        if not np.isin(m, (0.0, 1.0)).all():
            raise TrainInputError(f"column 'response_mask' row {i} holds values other than 0 and 1: it marks "
                                  "model tokens (1) and tool tokens (0); fix the rollout that wrote it.")
    if not any(m.any() for m in masks):
        raise TrainInputError("response_mask is 0 on every token of the batch, so no token carries a loss; "
                              "check the multi-turn rollout (tool answers filling max_response_length?).")
    return masks


def collate(rows: Rows, idx: Sequence[int], pad_response_to: int | None = None, *,
            packed: bool = False) -> dict[str, Any]:
    """Tensors for rows ``idx``: the padded layout, or the packed one (module docstring).
    ``mb["packed"]`` says which."""
    import torch

    plen, rlen = rows.lengths(idx)
    P = int(plen.max())
    R = max(int(rlen.max()), pad_response_to or 0, 1)
    b = len(idx)
    responses = np.zeros((b, R), dtype=np.int64)
    response_mask = np.zeros((b, R), dtype=np.float32)
    cols = {k: np.zeros((b, R), dtype=np.float32) for k in rows.columns}
    for j, i in enumerate(idx):
        r = rows.response_ids[i]
        responses[j, : len(r)] = r
        response_mask[j, : len(r)] = 1 if rows.masks is None else rows.masks[i]
        for k, v in rows.columns.items():
            cols[k][j, : len(r)] = v[i]
    out = _packed_inputs(rows, idx, R) if packed else _padded_inputs(rows, idx, P, R)
    out.update({
        "responses": torch.from_numpy(responses),
        "response_mask": torch.from_numpy(response_mask),
        "response_width": R,
        "packed": packed,
    })
    out.update({k: torch.from_numpy(v) for k, v in cols.items()})
    return out


def _padded_inputs(rows: Rows, idx: Sequence[int], P: int, R: int) -> dict[str, Any]:
    import torch

    input_ids = np.zeros((len(idx), P + R), dtype=np.int64)
    attention = np.zeros((len(idx), P + R), dtype=np.int64)
    for j, i in enumerate(idx):
        p, r = rows.prompt_ids[i], rows.response_ids[i]
        input_ids[j, P - len(p) : P] = p
        input_ids[j, P : P + len(r)] = r
        attention[j, P - len(p) : P + len(r)] = 1
    position_ids = np.clip(np.cumsum(attention, axis=1) - 1, 0, None)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        "position_ids": torch.from_numpy(position_ids),
        "prompt_width": P,
    }


def _packed_inputs(rows: Rows, idx: Sequence[int], R: int) -> dict[str, Any]:
    import torch

    plen, rlen = rows.lengths(idx)
    seq = plen + rlen
    starts = np.concatenate([[0], np.cumsum(seq)])
    input_ids = np.concatenate([np.concatenate([rows.prompt_ids[i], rows.response_ids[i]]) for i in idx])
    position_ids = np.concatenate([np.arange(n) for n in seq])
    # Response token k of row j is predicted by the output at its own position - 1.
    token_index = np.concatenate([starts[j] + plen[j] - 1 + np.arange(rlen[j]) for j in range(len(idx))])
    token_slot = np.concatenate([j * R + np.arange(rlen[j]) for j in range(len(idx))])
    return {
        "input_ids": torch.from_numpy(input_ids.astype(np.int64)[None]),
        "position_ids": torch.from_numpy(position_ids.astype(np.int64)[None]),
        "cu_seq_lens": torch.from_numpy(starts.astype(np.int32)),
        "token_index": torch.from_numpy(token_index.astype(np.int64)),
        "token_slot": torch.from_numpy(token_slot.astype(np.int64)),
    }


def plan_minibatches(n_rows: int, rows_per_minibatch: int, generator: Any | None) -> list[np.ndarray]:
    """Row indices of each mini-batch: a permutation from ``generator`` (None: in order), cut
    into chunks of ``rows_per_minibatch`` (the last one may be shorter, as in verl)."""
    import torch

    order = (
        torch.randperm(n_rows, generator=generator).numpy()
        if generator is not None
        else np.arange(n_rows)
    )
    return [order[s : s + rows_per_minibatch] for s in range(0, n_rows, rows_per_minibatch)]


def plan_microbatches(
    rows: Rows, idx: Sequence[int], *, micro_size: int | None, max_tokens: int | None,
    packed: bool = False,
) -> list[list[int]]:
    """Split rows ``idx`` into micro-batches: fixed ``micro_size`` rows, or (``max_tokens``)
    greedy packing of length-sorted rows while the tokens the model sees stay within the budget:
    rows x padded width, or (``packed``) the sum of the rows' lengths."""
    idx = [int(i) for i in idx]
    if max_tokens is None:
        return [idx[s : s + micro_size] for s in range(0, len(idx), micro_size)]
    plen, rlen = rows.lengths(idx)
    order = np.argsort(plen + rlen, kind="stable")
    batches: list[list[int]] = []
    cur: list[int] = []
    if packed:
        used = 0
        for k in order:
            n = int(plen[k] + rlen[k])
            if cur and used + n > max_tokens:
                batches.append(cur)
                cur, used = [], 0
            cur.append(idx[k])
            used += n
        return batches + ([cur] if cur else [])
    wp = wr = 0
    for k in order:
        np_, nr = max(wp, int(plen[k])), max(wr, int(rlen[k]))
        if cur and (len(cur) + 1) * (np_ + nr) > max_tokens:
            batches.append(cur)
            cur, np_, nr = [], int(plen[k]), int(rlen[k])
        cur.append(idx[k])
        wp, wr = np_, nr
    if cur:
        batches.append(cur)
    return batches

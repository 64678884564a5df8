"""The sample table: one row per response, the schema every stage reads and extends.

Columns (docs/reference/stage-contract.md): uid, group_id, data_source, prompt_ids list<int32>, response_ids list<int32>,
rollout_logprobs list<float32>, response_len, finish_reason, ground_truth (a string; a non-string
ground truth as marked JSON, see `ground_truth_of`), extra_info (json); multi-turn rollouts add
response_mask list<int8> (0 on tool turns' tokens, see RESPONSE_MASK_FIELD), and with an
environment turn_scores list<float32> / turn_ends list<int32> (its reward per stepped model turn
and where that turn ends; also in extra_info as "turn_scores" / "num_turns", verl's route to the
reward function);
later stages join score/reward_extra, old_logprobs/ref_logprobs/values, advantages/returns by uid.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

INT_LIST = pa.list_(pa.int32())
FLOAT_LIST = pa.list_(pa.float32())

SAMPLE_SCHEMA = pa.schema([
    ("uid", pa.string()),
    ("group_id", pa.string()),
    ("sample_index", pa.int32()),
    ("data_source", pa.string()),
    ("prompt_ids", INT_LIST),
    ("response_ids", INT_LIST),
    ("rollout_logprobs", FLOAT_LIST),
    ("response_len", pa.int32()),
    ("finish_reason", pa.string()),
    ("ground_truth", pa.string()),
    ("extra_info", pa.string()),
])


# Multi-turn rollouts only (gpu_jobs.rollout.agent_loop): 1 = a token the model generated, 0 = a
# tool turn's; the trainer multiplies it into its loss mask. Absent = all ones.
RESPONSE_MASK_FIELD = pa.field("response_mask", pa.list_(pa.int8()))
# Rollouts with an environment only (gpu_jobs.rollout.environments): its reward for each model
# turn it answered, the last one final, and the response index of each such turn's last token.
TURN_SCORES_FIELD = pa.field("turn_scores", FLOAT_LIST)
TURN_ENDS_FIELD = pa.field("turn_ends", INT_LIST)


def _json(value: Any) -> str:
    return json.dumps(value, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x))


def ground_truth_of(reward_model: Any) -> str:
    """The `ground_truth` cell of a prompt's `reward_model`: a string as it is, a list, dict or
    number as marked JSON (gpu_jobs.reward.ground_truth), which `score_batch` decodes so the
    reward function receives exactly what the dataset held; None (or no reward_model) as ""."""
    from gpu_jobs.reward.ground_truth import encode_ground_truth

    gt = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    return encode_ground_truth(gt)


def sample_table(rows: Sequence[dict], prompts: Sequence[dict], iteration: int, tag: str = "") -> pa.Table:
    """Engine rows (prompt-major, with prompt_index into `prompts`) -> a table in SAMPLE_SCHEMA.

    `prompts[i]` carries the verl fields of prompt i plus `row` (its index in the dataset), which
    makes group ids stable across retries: the same (iteration, dataset row) is the same group.
    """
    cols: dict[str, list] = {name: [] for name in SAMPLE_SCHEMA.names}
    for r in rows:
        p = prompts[r["prompt_index"]]
        group = f"{tag}{iteration}-{p['row']}"
        cols["uid"].append(f"{group}-{r['sample_index']}")
        cols["group_id"].append(group)
        cols["sample_index"].append(r["sample_index"])
        cols["data_source"].append(p["data_source"])
        cols["prompt_ids"].append(r["prompt_ids"])
        cols["response_ids"].append(r["response_ids"])
        cols["rollout_logprobs"].append(r["rollout_logprobs"])
        cols["response_len"].append(len(r["response_ids"]))
        cols["finish_reason"].append(r["finish_reason"])
        cols["ground_truth"].append(ground_truth_of(p.get("reward_model")))
        cols["extra_info"].append(_json(_extra_info(p, r)))
    table = pa.Table.from_pydict(cols, schema=SAMPLE_SCHEMA)
    if any("response_mask" in r for r in rows):  # multi-turn rows: tool tokens are 0
        masks = [r.get("response_mask", [1] * len(r["response_ids"])) for r in rows]
        table = table.append_column(RESPONSE_MASK_FIELD, pa.array(masks, RESPONSE_MASK_FIELD.type))
    if any("turn_scores" in r for r in rows):  # an environment's rewards, per stepped turn
        for fld in (TURN_SCORES_FIELD, TURN_ENDS_FIELD):
            table = table.append_column(fld, pa.array([r.get(fld.name, []) for r in rows], fld.type))
    return table


def _extra_info(prompt: dict, row: dict) -> dict:
    """The prompt's extra_info; with an environment, plus the response's turn_scores and num_turns
    (what verl's reward managers add), so a reward function can read the environment's rewards."""
    extra = dict(prompt.get("extra_info") or {})
    if "turn_scores" in row:
        extra.update(turn_scores=[float(x) for x in row["turn_scores"]], num_turns=int(row.get("num_turns", 1)))
    return extra


def response_masks(table: pa.Table) -> list[list[int]]:
    """Per-token response_mask of each row: 1 on tokens the model generated, 0 on tool/user turns;
    all ones when the table has no response_mask column (single-turn rollouts)."""
    if "response_mask" in table.column_names:
        return table.column("response_mask").to_pylist()
    return [[1] * n for n in table.column("response_len").to_pylist()]


def join_by_uid(base: pa.Table, *others: pa.Table | None) -> pa.Table:
    """Add the columns of each `other` (keyed by uid) to `base`, keeping base's row order.

    Raises if a uid of `base` is missing in another table: a stage never silently scores or
    trains on a partial batch.
    """
    uids = base.column("uid").to_pylist()
    for other in others:
        if other is None:
            continue
        pos = {u: i for i, u in enumerate(other.column("uid").to_pylist())}
        missing = [u for u in uids if u not in pos]
        if missing:
            raise ValueError(f"{len(missing)} uids missing from a joined stage table, e.g. {missing[:3]}")
        take = pa.array([pos[u] for u in uids], pa.int64())
        for name in other.column_names:
            if name != "uid" and name not in base.column_names:
                base = base.append_column(other.schema.field(name), other.column(name).take(take))
    return base


def padded(lists: Sequence[Sequence[float]], width: int | None = None, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Ragged rows -> (values (bs, T) right-padded with 0, mask (bs, T) of 1 on real positions)."""
    width = max((len(x) for x in lists), default=0) if width is None else width
    values = np.zeros((len(lists), width), dtype=dtype)
    mask = np.zeros((len(lists), width), dtype=np.float32)
    for i, x in enumerate(lists):
        values[i, : len(x)] = x
        mask[i, : len(x)] = 1.0
    return values, mask


def unpadded(values: np.ndarray, lengths: Sequence[int]) -> list[list[float]]:
    """(bs, T) -> ragged rows of the given lengths (inverse of `padded`)."""
    return [values[i, :n].astype(np.float32).tolist() for i, n in enumerate(lengths)]

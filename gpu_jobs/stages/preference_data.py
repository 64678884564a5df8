"""The data of a preference run (the run config's `preference:` section): its rows, read and
checked before any model loads, and each iteration's batch laid out in whole units.

    train, val = preference_frames(cfg)                 # pandas frames of TRL rows; Run.open calls it
    table = preference_table(rows, tokenizer, "dpo", micro_size=4, max_prompt_length=512)

A preference file has TRL's columns (gpu_jobs.data.preferences.PREFERENCE_COLUMNS): DPO pairs
(prompt, chosen, rejected) or KTO rows (prompt, completion, label). Generated data
(preference.generate=arith) is written once into the run's storage root, like the built-in
prompt datasets, and read back like a user's file. Without preference.val_files the first
preference.val_size rows are held out and never trained on.

The batch table has one row per scored sequence (schema in gpu_jobs/train/preference.py):
uid, unit, role, row (the dataset row), prompt_ids, response_ids. A DPO unit is one pair; a KTO
unit is up to `micro_size` examples followed by their mismatched KL rows (example j's prompt with
the completion of example kto_kl_indices(g)[j] of the same unit, TRL's rotation), so a
micro-batch that holds a unit holds everything its loss reads.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from gpu_jobs.data.preferences import PREFERENCE_COLUMNS, arith_preference_rows, check_preference_rows
from storage import exists, join
from storage.datasets import DatasetError, read_prompt_file, write_prompts

__all__ = ["preference_frames", "preference_table", "answer_ids", "check_prompt_lengths"]

_INT_LIST = pa.list_(pa.int32())


def preference_frames(cfg: Any) -> tuple[Any, Any]:
    """(train, held-out) pandas frames of the run's preference rows, every row checked: a missing
    file, a missing column or a bad row raises DatasetError naming the file, the row and the fix."""
    import pandas as pd

    pref = cfg.preference
    files = list(pref.train_files) or [_generated(cfg)]
    train = pd.concat([_read(u, pref.algorithm, "preference.train_files") for u in files], ignore_index=True)
    if pref.val_files:
        val = pd.concat([_read(u, pref.algorithm, "preference.val_files") for u in pref.val_files],
                        ignore_index=True).iloc[: pref.val_size]
    else:
        if len(train) < pref.val_size + cfg.data.train_batch_size:
            raise DatasetError(f"preference data has {len(train)} rows: preference.val_size={pref.val_size} are held "
                               f"out and a batch needs data.train_batch_size={cfg.data.train_batch_size} more; add "
                               "rows, lower those, or name held-out rows in preference.val_files")
        val, train = train.iloc[: pref.val_size], train.iloc[pref.val_size :]
    if len(train) < cfg.data.train_batch_size:
        raise DatasetError(f"preference.train_files hold {len(train)} rows, fewer than data.train_batch_size="
                           f"{cfg.data.train_batch_size}: add rows or lower data.train_batch_size")
    return train.reset_index(drop=True), val.reset_index(drop=True)


def _read(url: str, algorithm: str, key: str) -> Any:
    from storage.fs import redact_url

    shown = f"{redact_url(url)} ({key})"
    try:
        df = read_prompt_file(url, required=(), name=shown)
    except FileNotFoundError:
        raise DatasetError(f"preference file {shown} does not exist: fix the path, or leave preference.train_files "
                           "empty to generate the built-in data (preference.generate=arith)") from None
    need = PREFERENCE_COLUMNS[algorithm]
    missing = [c for c in need if c not in df.columns]
    if missing:
        other = next(a for a in PREFERENCE_COLUMNS if a != algorithm)
        hint = (f": it has {other}'s columns, set preference.algorithm={other}"
                if all(c in df.columns for c in PREFERENCE_COLUMNS[other])
                else ": write those columns (TRL's preference format), one row per pair or rated answer")
        raise DatasetError(f"preference file {shown} has no {', '.join(missing)} column (preference.algorithm="
                           f"{algorithm} reads {', '.join(need)}; its columns: {', '.join(map(str, df.columns))})"
                           f"{hint}")
    df = df[list(need)]
    try:
        check_preference_rows(df.to_dict("records"), algorithm, f"preference file {shown}")
    except ValueError as e:
        raise DatasetError(str(e)) from None
    if algorithm == "kto":
        df["label"] = df["label"].astype(bool)
    return df


def _generated(cfg: Any) -> str:
    """The built-in preference file (preference.generate), written once under the root."""
    from gpu_jobs.data.generators import arith_pairs

    pref = cfg.preference
    n = pref.train_size + (0 if pref.val_files else pref.val_size)
    url = join(cfg.root, "datasets", f"{pref.generate}-{pref.algorithm}-seed{cfg.data.seed}-n{n}", "train.parquet")
    if not exists(url, cfg.storage):
        if n > 90 * 90:
            raise DatasetError(f"preference.train_size + val_size = {n} exceeds the {90 * 90} distinct arith "
                               "problems: lower preference.train_size")
        write_prompts(arith_preference_rows(pref.algorithm, arith_pairs(n, cfg.data.seed), cfg.data.seed), url,
                      storage=cfg.storage)
    return url


def check_prompt_lengths(df: Any, tokenizer: Any, max_prompt_length: int, where: str) -> None:
    """Raise DatasetError naming the first row whose prompt renders longer than
    data.max_prompt_length: before the run starts, not in the iteration that draws it."""
    from gpu_jobs.data import render_many

    for i, ids in enumerate(render_many(df["prompt"].tolist(), tokenizer)):
        if len(ids) > max_prompt_length:
            raise DatasetError(f"{where} row {i}: the prompt renders to {len(ids)} tokens, more than "
                               f"data.max_prompt_length={max_prompt_length}; shorten it or raise data.max_prompt_length")


def answer_ids(text: str, tokenizer: Any) -> list[int]:
    """The assistant's answer as the model emits it: its tokens, then EOS (TRL appends it too:
    a DPO pair also teaches where an answer ends)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


def preference_table(rows: list[dict[str, Any]], tokenizer: Any, algorithm: str, *, micro_size: int,
                     max_prompt_length: int | None, row_ids: list[int] | None = None, tag: str = "") -> pa.Table:
    """The batch table of `rows` (TRL rows of one algorithm), units laid out as the module doc
    says; `row_ids`: each row's index in its dataset (default 0..n-1); `tag` prefixes the uids."""
    from gpu_jobs.data import render_prompt

    row_ids = list(range(len(rows))) if row_ids is None else row_ids
    prompts = [render_prompt(r["prompt"], tokenizer, max_prompt_length) for r in rows]
    out: dict[str, list] = {"uid": [], "unit": [], "role": [], "row": [], "prompt_ids": [], "response_ids": []}

    def add(unit: int, role: str, i: int, prompt: list[int], response: list[int]) -> None:
        out["uid"].append(f"{tag}{row_ids[i]}-{role}-{len(out['uid'])}")
        for key, value in (("unit", unit), ("role", role), ("row", row_ids[i]), ("prompt_ids", prompt),
                           ("response_ids", response)):
            out[key].append(value)

    if algorithm == "dpo":
        for i, r in enumerate(rows):
            add(i, "chosen", i, prompts[i], answer_ids(r["chosen"], tokenizer))
            add(i, "rejected", i, prompts[i], answer_ids(r["rejected"], tokenizer))
    else:
        completions = [answer_ids(r["completion"], tokenizer) for r in rows]
        for unit, members in enumerate(kto_groups(len(rows), micro_size)):
            for i in members:
                add(unit, "desirable" if rows[i]["label"] else "undesirable", i, prompts[i], completions[i])
            for i, j in zip(members, _rotated(members)):
                add(unit, "kl", i, prompts[i], completions[j])
    return pa.table({"uid": pa.array(out["uid"]), "unit": pa.array(out["unit"], pa.int32()),
                     "role": pa.array(out["role"]), "row": pa.array(out["row"], pa.int64()),
                     "prompt_ids": pa.array(out["prompt_ids"], _INT_LIST),
                     "response_ids": pa.array(out["response_ids"], _INT_LIST)})


def kto_groups(n: int, size: int) -> list[list[int]]:
    """Examples 0..n-1 in groups of `size` (>= 2); a last group of one joins the group before
    it (a group of one has no mismatched pair). Needs n >= 2.

    >>> kto_groups(5, 2)
    [[0, 1], [2, 3, 4]]
    """
    if n < 2 or size < 2:
        raise ValueError(f"KTO groups need at least 2 examples and size >= 2, got n={n}, size={size}")
    groups = [list(range(s, min(s + size, n))) for s in range(0, n, size)]
    if len(groups[-1]) == 1:
        last = groups.pop()  # popped first: `groups[-2] += groups.pop()` would overwrite the wrong group
        groups[-1] += last
    return groups


def _rotated(members: list[int]) -> list[int]:
    """The completion each member is mismatched with: TRL's rotation (kto_kl_indices)."""
    from gpu_jobs.algos.preference import kto_kl_indices

    return [members[j] for j in kto_kl_indices(len(members)).tolist()]

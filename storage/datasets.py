"""Prompt datasets in verl's Parquet format: read and write.

    >>> from storage.datasets import read_prompts, write_prompts
    >>> df = read_prompts("s3://bucket/data/gsm8k/train.parquet")   # any fsspec URL
    >>> df.loc[0, "prompt"]
    [{'role': 'user', 'content': '...'}]

A row has verl's fields, so a verl user's `train.parquet` works unchanged:
`data_source` (str, routes the reward), `prompt` (list of {role, content}), `ability` (str),
`reward_model` ({style, ground_truth}), `extra_info` (dict; `split`, `index`, task data).
Generating datasets, sampling batches and rendering prompts with a tokenizer live in
`gpu_jobs.data`, next to the models.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["VERL_COLUMNS", "DatasetError", "write_prompts", "read_prompts", "read_prompt_file"]

VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
# What a verl prompt row looks like, quoted by the errors that ask for one.
VERL_ROW = ('{"data_source": "...", "prompt": [{"role": "user", "content": "..."}], '
            '"reward_model": {"style": "rule", "ground_truth": "..."}}')


class DatasetError(ValueError):
    """A prompt dataset file that cannot be used as it is: the message names the file, the column
    or row, and the fix, in one line."""


def _url_to_fs(url: str, storage=None):
    # Imported here, not at module top, so `storage/__init__` may import this module freely.
    from storage.fs import url_to_fs

    return url_to_fs(url, storage)


# --------------------------------------------------------------------------------------------
# Reading and writing verl-format Parquet
# --------------------------------------------------------------------------------------------
def write_prompts(rows: Sequence[Mapping[str, Any]], url: str, *, storage=None) -> str:
    """Write verl-format rows to one Parquet file at `url`, atomically; returns `url`.

    The file is written under a temporary name next to the target and then moved into place,
    so a reader never sees a partial file (on S3 the upload itself is atomic; the move is a
    server-side copy).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [dict(r) for r in rows]
    # An empty split still has verl's columns, so readers see a dataset with 0 rows.
    table = pa.Table.from_pylist(rows) if rows else pa.table({c: pa.array([], pa.null()) for c in VERL_COLUMNS})
    fs, path = _url_to_fs(url, storage)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{parent}/.{path.rsplit('/', 1)[-1]}.tmp-{uuid.uuid4().hex}" if parent else f".tmp-{uuid.uuid4().hex}"
    try:
        with fs.open(tmp, "wb") as f:
            pq.write_table(table, f, use_dictionary=False)
        fs.mv(tmp, path)
    finally:
        if fs.exists(tmp):
            fs.rm(tmp)
    return url


def read_prompts(urls: str | Iterable[str], *, storage=None, columns: Sequence[str] | None = None):
    """Read one or more verl-format Parquet files into one pandas DataFrame (fresh 0..n-1 index).

    `prompt` cells come back as lists of {role, content, ...} dicts and `reward_model` /
    `extra_info` as dicts, whatever Parquet nesting the writer (pandas, HF datasets, pyarrow)
    used. Raises DatasetError (a ValueError) naming the file and the fix when one is not Parquet or
    lacks a verl column.
    """
    import pandas as pd

    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls:
        raise ValueError("read_prompts needs at least one URL")
    frames = [read_prompt_file(url, storage=storage, columns=columns, plain=False) for url in urls]
    df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    return _plain_cells(df)


def read_prompt_file(url: str, *, storage=None, columns: Sequence[str] | None = None,
                     required: Sequence[str] = ("data_source", "prompt"), plain: bool = True, name: str | None = None):
    """One verl-format Parquet file as a pandas DataFrame (cells as `read_prompts` gives them).

    Raises DatasetError, naming the file (as `name`, default its URL) and the fix, when it is not
    a Parquet file or lacks a `required` column; FileNotFoundError when it does not exist."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from storage.fs import redact_url

    shown = name or redact_url(url)
    fs, path = _url_to_fs(url, storage)
    with fs.open(path, "rb") as f:
        try:
            table = pq.read_table(f, columns=list(columns) if columns else None)
        except pa.ArrowInvalid as exc:  # "Parquet magic bytes not found", a 0-byte file, ...
            why = " ".join(str(exc).split())[:200]
            raise DatasetError(f"data file {shown} is not a Parquet file ({why}): give a verl-format .parquet "
                               "file (pandas `DataFrame.to_parquet`, or `rlmill data make`)") from None
    df = table.to_pandas()
    missing = [c for c in required if c not in df.columns and (not columns or c in columns)]
    if missing:
        have = ", ".join(map(str, df.columns)) or "none"
        raise DatasetError(
            f"data file {shown} has no {' or '.join(repr(c) for c in missing)} column (its columns: {have}): "
            f"write verl's columns, one row like {VERL_ROW}")
    return _plain_cells(df) if plain else df


def _plain_cells(df):
    """`prompt` as lists of message dicts, `reward_model` / `extra_info` as plain dicts."""
    if "prompt" in df.columns:
        # Lenient on purpose: a malformed message is kept as it is for the quality gate to
        # name, instead of failing the read with a bare KeyError.
        df["prompt"] = [[{"role": "user", "content": p}] if isinstance(p, str) else _plain(p) for p in df["prompt"]]
    for col in ("reward_model", "extra_info"):
        if col in df.columns:
            df[col] = [_plain(v) if v is not None else None for v in df[col]]
    return df


def _plain(value: Any) -> Any:
    """numpy scalars/arrays from Parquet -> plain Python, recursively; JSON strings stay strings."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value

"""Prompt datasets in verl's Parquet format: read, generate, sample, render.

    >>> from storage.datasets import make_dataset, read_prompts, sample_batch
    >>> train_url, test_url = make_dataset("arith", "/tmp/data/arith", train_size=512, test_size=64, seed=0)
    >>> df = read_prompts(train_url)            # any fsspec URL: local path, file://, s3://
    >>> df.loc[0, "prompt"]
    [{'role': 'user', 'content': '37+45='}]
    >>> rows = sample_batch(seed=0, iteration=3, batch_size=16, n_rows=len(df))

A row has verl's fields, so a verl user's `train.parquet` works unchanged:
`data_source` (str, routes the reward), `prompt` (list of {role, content}), `ability` (str),
`reward_model` ({style, ground_truth}), `extra_info` (dict; `split`, `index`, task data).

Generators are registered by name: "arith" (the built-in 2-digit addition task),
"gsm_symbolic" (reasoning-gym's GSM8K-style word problems) and "rg:<task>" for any other
reasoning-gym task. A reasoning-gym row keeps the generated entry as a JSON string in
`extra_info["rg_entry"]`, which is what the reward needs to call that task's `score_answer`.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "VERL_COLUMNS",
    "DatasetConfig",
    "OverlongPromptError",
    "GENERATORS",
    "register_generator",
    "get_generator",
    "make_dataset",
    "write_prompts",
    "read_prompts",
    "normalize_messages",
    "sample_batch",
    "epoch_and_step",
    "PromptSampler",
    "render_prompt",
    "render_prompts",
    "render_many",
]

VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
ARITH_SOURCE = "rlmill/arith"
RG_SOURCE_PREFIX = "reasoning_gym/"


class DatasetConfig(BaseModel):
    """How prompts are read and rendered; field names follow verl's `data.*` where one exists."""

    model_config = ConfigDict(extra="forbid")

    train_files: list[str] = Field(
        default_factory=list, description="URLs of training Parquet files (verl format); local or s3://."
    )
    val_files: list[str] = Field(
        default_factory=list, description="URLs of validation Parquet files (verl format)."
    )
    prompt_key: str = Field("prompt", description="Column holding the chat messages (verl: data.prompt_key).")
    max_prompt_length: int = Field(
        512, gt=0, description="Most tokens a rendered prompt (chat template + generation prompt) may have."
    )
    overlong_prompts: Literal["error", "filter"] = Field(
        "error",
        description=(
            "What to do with a prompt longer than max_prompt_length: 'error' raises "
            "OverlongPromptError naming the row (verl truncation='error'); 'filter' drops it and "
            "counts it (verl filter_overlong_prompts=True)."
        ),
    )


class OverlongPromptError(ValueError):
    """A rendered prompt has more tokens than max_prompt_length and the config says 'error'."""


def _url_to_fs(url: str, storage=None):
    # Imported here, not at module top, so `storage/__init__` may import this module freely.
    from storage.fs import url_to_fs

    return url_to_fs(url, storage)


def _join(url: str, *parts: str) -> str:
    from storage.fs import join

    return join(url, *parts)


# --------------------------------------------------------------------------------------------
# Reading and writing verl-format Parquet
# --------------------------------------------------------------------------------------------
def normalize_messages(prompt: Any) -> list[dict[str, str]]:
    """A prompt cell as a plain list of {"role", "content"} dicts.

    Parquet gives back a numpy array of dicts (pandas) or a list; a bare string (some verl
    datasets store raw text) becomes one user message.
    """
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


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
    used. Raises ValueError naming the file when a verl column is missing.
    """
    import pandas as pd
    import pyarrow.parquet as pq

    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls:
        raise ValueError("read_prompts needs at least one URL")
    frames = []
    for url in urls:
        fs, path = _url_to_fs(url, storage)
        with fs.open(path, "rb") as f:
            df = pq.read_table(f, columns=list(columns) if columns else None).to_pandas()
        missing = [c for c in ("data_source", "prompt") if c not in df.columns and (not columns or c in columns)]
        if missing:
            raise ValueError(f"{url} is not a verl prompt dataset: missing column(s) {missing}")
        frames.append(df)
    df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
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


def _json_safe(value: Any) -> Any:
    """Metadata from task generators -> JSON-representable data.

    Tuples and sets become {"__tuple__": [...]} / {"__set__": [...]} so the scorer can rebuild
    them (`gpu_jobs.reward.rules.decode_rg_entry`): some tasks' score_answer compares a parsed
    answer with a tuple in the metadata, and a list would never be equal. Fractions and other
    objects become their str().
    """
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {"__tuple__": [_json_safe(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [_json_safe(v) for v in sorted(value, key=repr)]}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Fraction):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


# --------------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------------
Generator = Callable[[str, int, int], list[dict[str, Any]]]
"""(split, size, seed) -> verl rows. Must be deterministic in its arguments."""

GENERATORS: dict[str, Generator] = {}


def register_generator(name: str) -> Callable[[Generator], Generator]:
    """Decorator: register a dataset generator under `name`; registering a name twice raises."""

    def deco(fn: Generator) -> Generator:
        if name in GENERATORS:
            raise ValueError(f"dataset generator {name!r} is already registered")
        GENERATORS[name] = fn
        return fn

    return deco


def get_generator(name: str) -> Generator:
    """The generator for `name`; "rg:<task>" builds any reasoning-gym task. Unknown names raise."""
    if name in GENERATORS:
        return GENERATORS[name]
    if name.startswith("rg:") and len(name) > 3:
        task = name[3:]
        return lambda split, size, seed: _reasoning_gym_rows(task, split, size, seed)
    raise KeyError(f"unknown dataset generator {name!r}; known: {sorted(GENERATORS)} or 'rg:<reasoning-gym task>'")


def _split_seed(seed: int, split: str) -> int:
    # Train and test draw from different streams, so test is not a prefix of train.
    return int(np.random.SeedSequence([seed, {"train": 0, "test": 1}.get(split, 2)]).generate_state(1)[0])


def arith_pairs(n_total: int, seed: int) -> list[tuple[int, int]]:
    """n_total distinct (a, b) pairs with a, b in 10..99, in a seeded random order."""
    if n_total > 90 * 90:
        raise ValueError(f"arith has only {90 * 90} distinct prompts; asked for {n_total}")
    order = np.random.default_rng(seed).permutation(90 * 90)[:n_total]
    return [(10 + int(k) // 90, 10 + int(k) % 90) for k in order]


def arith_row(a: int, b: int, split: str, index: int) -> dict[str, Any]:
    """One row of the built-in task (the contract): prompt "a+b=", ground truth str(a+b)."""
    return {
        "data_source": ARITH_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}+{b}="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


@register_generator("arith")
def _arith(split: str, size: int, seed: int) -> list[dict[str, Any]]:
    # Standalone use: one split's stream. make_dataset uses _arith_splits so that test
    # prompts never appear in train.
    return [arith_row(a, b, split, i) for i, (a, b) in enumerate(arith_pairs(size, _split_seed(seed, split)))]


def _arith_splits(train_size: int, test_size: int, seed: int):
    pairs = arith_pairs(train_size + test_size, seed)
    test = [arith_row(a, b, "test", i) for i, (a, b) in enumerate(pairs[:test_size])]
    train = [arith_row(a, b, "train", i) for i, (a, b) in enumerate(pairs[test_size:])]
    return train, test


def _reasoning_gym_rows(task: str, split: str, size: int, seed: int) -> list[dict[str, Any]]:
    import reasoning_gym

    if size == 0:  # reasoning-gym refuses size 0
        return []
    ds = reasoning_gym.create_dataset(task, size=size, seed=_split_seed(seed, split))
    rows = []
    for i in range(size):
        entry = ds[i]
        answer = entry.get("answer")
        stored = _json_safe({"question": entry["question"], "answer": answer, "metadata": entry.get("metadata", {})})
        rows.append(
            {
                "data_source": RG_SOURCE_PREFIX + task,
                "prompt": [{"role": "user", "content": entry["question"]}],
                "ability": "reasoning",
                "reward_model": {"style": "rule", "ground_truth": "" if answer is None else str(answer)},
                "extra_info": {"split": split, "index": i, "rg_task": task, "rg_entry": json.dumps(stored)},
            }
        )
    return rows


@register_generator("gsm_symbolic")
def _gsm_symbolic(split: str, size: int, seed: int) -> list[dict[str, Any]]:
    return _reasoning_gym_rows("gsm_symbolic", split, size, seed)


def make_dataset(
    name: str, out_url: str, *, train_size: int, test_size: int, seed: int, storage=None
) -> tuple[str, str]:
    """Generate `name` and write `<out_url>/train.parquet` and `<out_url>/test.parquet`.

    Deterministic in (name, sizes, seed), so re-running (a retried task) rewrites identical
    files. Each file is moved into place whole; a reader never sees a partial file.
    """
    if train_size < 0 or test_size < 0:
        raise ValueError("train_size and test_size must be >= 0")
    if name == "arith":
        train, test = _arith_splits(train_size, test_size, seed)
    else:
        gen = get_generator(name)
        train, test = gen("train", train_size, seed), gen("test", test_size, seed)
    train_url, test_url = _join(out_url, "train.parquet"), _join(out_url, "test.parquet")
    write_prompts(test, test_url, storage=storage)
    write_prompts(train, train_url, storage=storage)
    return train_url, test_url


# --------------------------------------------------------------------------------------------
# Sampling: a pure function of (seed, epoch, iteration)
# --------------------------------------------------------------------------------------------
def epoch_and_step(iteration: int, batch_size: int, n_rows: int) -> tuple[int, int]:
    """(epoch, step within epoch) of a 0-based `iteration`; an epoch is n_rows // batch_size
    batches (the leftover rows of each permutation are skipped, like verl's drop_last=True)."""
    if batch_size <= 0 or n_rows <= 0:
        raise ValueError(f"batch_size and n_rows must be > 0, got {batch_size=} {n_rows=}")
    if batch_size > n_rows:
        raise ValueError(f"batch_size {batch_size} is larger than the dataset ({n_rows} rows)")
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    steps_per_epoch = n_rows // batch_size
    return iteration // steps_per_epoch, iteration % steps_per_epoch


def epoch_permutation(seed: int, epoch: int, n_rows: int) -> np.ndarray:
    """The row order of one epoch: a permutation of range(n_rows) seeded by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def sample_batch(seed: int, iteration: int, batch_size: int, n_rows: int) -> list[int]:
    """Row indices of training batch `iteration`: batch k of the permutation of its epoch.

    A pure function of its arguments, so a resumed run sees exactly the prompts it would have
    seen. Epoch e covers iterations [e*S, (e+1)*S) with S = n_rows // batch_size.
    """
    epoch, step = epoch_and_step(iteration, batch_size, n_rows)
    perm = epoch_permutation(seed, epoch, n_rows)
    return perm[step * batch_size : (step + 1) * batch_size].tolist()


class PromptSampler:
    """Deterministic training batches over a dataset of `n_rows` rows.

        >>> s = PromptSampler(seed=0, batch_size=4, n_rows=10)
        >>> s.indices(0), s.epoch(5)          # iteration 5 is epoch 2 (2 batches per epoch)
    """

    def __init__(self, *, seed: int, batch_size: int, n_rows: int):
        epoch_and_step(0, batch_size, n_rows)  # validates the arguments
        self.seed, self.batch_size, self.n_rows = seed, batch_size, n_rows

    @property
    def steps_per_epoch(self) -> int:
        return self.n_rows // self.batch_size

    def epoch(self, iteration: int) -> int:
        return epoch_and_step(iteration, self.batch_size, self.n_rows)[0]

    def indices(self, iteration: int) -> list[int]:
        return sample_batch(self.seed, iteration, self.batch_size, self.n_rows)


# --------------------------------------------------------------------------------------------
# Rendering prompts with the tokenizer's chat template
# --------------------------------------------------------------------------------------------
def _ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding by default; we ask for plain ids but accept both.
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def render_prompt(messages: Any, tokenizer, max_prompt_length: int | None = None) -> list[int]:
    """Token ids of `messages` through the chat template, with the generation prompt added.

    Raises OverlongPromptError when the result is longer than `max_prompt_length`.
    """
    ids = _ids(
        tokenizer.apply_chat_template(
            normalize_messages(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    if max_prompt_length is not None and len(ids) > max_prompt_length:
        raise OverlongPromptError(f"prompt renders to {len(ids)} tokens > max_prompt_length={max_prompt_length}")
    return ids


def render_many(prompts: Iterable[Any], tokenizer) -> list[list[int]]:
    """Token ids of many prompts (no length limit). One batched chat-template call: ~3x faster
    than rendering one by one (4096 short prompts: ~0.2 s)."""
    convs = [normalize_messages(m) for m in prompts]
    if not convs:
        return []
    out = tokenizer.apply_chat_template(convs, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [_ids(x) for x in out]


def render_prompts(prompts: Iterable[Any], tokenizer, cfg: DatasetConfig) -> tuple[list[list[int]], list[int], int]:
    """Render many prompts; returns (token ids of the kept prompts, their positions, n_filtered).

    With cfg.overlong_prompts == "error" the first overlong prompt raises, naming its position
    and length; with "filter" it is left out and counted in n_filtered (never dropped silently).
    """
    kept_ids, kept_pos, n_filtered = [], [], 0
    for i, ids in enumerate(render_many(prompts, tokenizer)):
        if len(ids) > cfg.max_prompt_length:
            if cfg.overlong_prompts == "error":
                raise OverlongPromptError(
                    f"prompt at row {i} renders to {len(ids)} tokens > max_prompt_length="
                    f"{cfg.max_prompt_length}; raise max_prompt_length or set overlong_prompts='filter'"
                )
            n_filtered += 1
            continue
        kept_ids.append(ids)
        kept_pos.append(i)
    return kept_ids, kept_pos, n_filtered

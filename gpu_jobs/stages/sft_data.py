"""The data of an SFT run (the run config's `sft:` section): its demonstrations, read and checked
before any model loads, and each iteration's batch as the trainer reads it.

    train, val = sft_frames(cfg)                         # pandas frames; Run.open calls it
    table = sft_table(rows, tokenizer, cfg)              # uid, row, prompt_ids, response_ids, response_mask

A demonstrations file is verl's SFT Parquet: a prompt column (sft.prompt_key: text, one user
turn, or chat messages) and a response column (sft.response_key: the assistant's text), or with
sft.multiturn.enable one column of whole conversations (sft.multiturn.messages_key). Generated
data (sft.generate=arith) is written once into the run's storage root and read back like a
user's file. Without sft.val_files the first sft.val_size rows are held out, never trained on.

A row is laid out in tokens exactly as a rollout of the same conversation would be, so what SFT
teaches is what RL samples and scores later:

    prompt_ids      the messages before the first assistant turn through the chat template, with
                    the generation prompt (data.render_prompt; a multi-turn row's through the
                    rollout's turn format, tools shown, as HermesTurns.prompt splices them)
    response_ids    each assistant turn's tokens and EOS (mask 1: the engine samples them and stops
                    at EOS), the turns between them as the rollout's turn format renders them after
                    a model turn (mask 0: TURN_FORMATS[...].message_ids, ending with the next
                    assistant header); nothing after the last assistant turn
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from storage import exists, join
from storage.datasets import DatasetError, read_prompt_file, write_prompts

__all__ = ["sft_frames", "sft_table", "demonstration_ids", "check_lengths"]

_INT_LIST = pa.list_(pa.int32())


def sft_frames(cfg: Any) -> tuple[Any, Any]:
    """(train, held-out) pandas frames of the run's demonstrations, every row checked: a missing
    file, a missing column or a bad row raises DatasetError naming the file, the row and the fix."""
    import pandas as pd

    sft = cfg.sft
    files = list(sft.train_files) or [_generated(cfg)]
    train = pd.concat([_read(u, sft, "sft.train_files") for u in files], ignore_index=True)
    if sft.val_files:
        val = pd.concat([_read(u, sft, "sft.val_files") for u in sft.val_files], ignore_index=True).iloc[: sft.val_size]
    else:
        if len(train) < sft.val_size + cfg.data.train_batch_size:
            raise DatasetError(f"the demonstrations hold {len(train)} rows: sft.val_size={sft.val_size} are held out "
                               f"and a batch needs data.train_batch_size={cfg.data.train_batch_size} more; add rows, "
                               "lower those, or name held-out rows in sft.val_files")
        val, train = train.iloc[: sft.val_size], train.iloc[sft.val_size :]
    if len(train) < cfg.data.train_batch_size:
        raise DatasetError(f"sft.train_files hold {len(train)} rows, fewer than data.train_batch_size="
                           f"{cfg.data.train_batch_size}: add rows or lower data.train_batch_size")
    return train.reset_index(drop=True), val.reset_index(drop=True)


def _columns(sft: Any) -> tuple[str, ...]:
    return (sft.multiturn.messages_key,) if sft.multiturn.enable else (sft.prompt_key, sft.response_key)


def _read(url: str, sft: Any, key: str) -> Any:
    from storage.fs import redact_url

    shown = f"{redact_url(url)} ({key})"
    try:
        df = read_prompt_file(url, required=(), name=shown)
    except FileNotFoundError:
        raise DatasetError(f"demonstrations file {shown} does not exist: fix the path, or leave sft.train_files "
                           "empty to generate the built-in data (sft.generate=arith)") from None
    need = _columns(sft)
    missing = [c for c in need if c not in df.columns]
    if missing:
        what = ("sft.multiturn.messages_key" if sft.multiturn.enable else "sft.prompt_key / sft.response_key")
        hint = (": its rows look multi-turn, set sft.multiturn.enable=true" if not sft.multiturn.enable
                and sft.multiturn.messages_key in df.columns else f": name the columns with {what}")
        raise DatasetError(f"demonstrations file {shown} has no {', '.join(missing)} column (its columns: "
                           f"{', '.join(map(str, df.columns))}){hint}")
    df = df[list(need)]
    for i, row in enumerate(df.to_dict("records")):
        why = _bad_row(row, sft)
        if why:
            raise DatasetError(f"demonstrations file {shown} row {i}: {why}")
    return df


def _bad_row(row: dict[str, Any], sft: Any) -> str | None:
    """Why a row cannot be trained on (None: it can)."""
    if not sft.multiturn.enable:
        prompt, response = row[sft.prompt_key], row[sft.response_key]
        if not isinstance(response, str) or not response:
            return f"{sft.response_key} must be non-empty text (the assistant's answer), got {type(response).__name__}"
        return _bad_messages(prompt, sft.prompt_key, need_assistant=False)
    return _bad_messages(row[sft.multiturn.messages_key], sft.multiturn.messages_key, need_assistant=True)


def _bad_messages(value: Any, column: str, need_assistant: bool) -> str | None:
    if isinstance(value, str):
        if need_assistant:
            return f"{column} must be chat messages ({{role, content}} each) with an assistant turn, not text"
        return None if value else f"{column} is empty"
    try:
        msgs = list(value)
        roles = [m["role"] for m in msgs]
        contents = [m["content"] for m in msgs]
    except (TypeError, KeyError):
        return f"{column} must be text or chat messages ({{role, content}} each)"
    if any(not isinstance(c, str) and not (c is None and r == "assistant") for c, r in zip(contents, roles)):
        return f"{column}: every message's content must be text (an assistant's may be null beside tool_calls)"
    if not msgs or any(r not in ("system", "user", "assistant", "tool") for r in roles):
        return f"{column} has no messages or a role other than system/user/assistant/tool: {roles}"
    if need_assistant and "assistant" not in roles:
        return f"{column} has no assistant turn, so nothing to train on"
    if need_assistant and roles[0] == "assistant":
        return f"{column} opens with an assistant turn: a conversation starts with a prompt (system or user)"
    return None


def _generated(cfg: Any) -> str:
    """The built-in demonstrations file (sft.generate), written once under the root: the
    built-in task's prompts ("a+b=") answered with their sum."""
    from gpu_jobs.data.generators import arith_pairs

    sft = cfg.sft
    n = sft.train_size + (0 if sft.val_files else sft.val_size)
    url = join(cfg.root, "datasets", f"sft-{sft.generate}-seed{cfg.data.seed}-n{n}", "train.parquet")
    if not exists(url, cfg.storage):
        if n > 90 * 90:
            raise DatasetError(f"sft.train_size + val_size = {n} exceeds the {90 * 90} distinct arith problems: "
                               "lower sft.train_size")
        rows = [{sft.prompt_key: [{"role": "user", "content": f"{a}+{b}="}], sft.response_key: str(a + b)}
                for a, b in arith_pairs(n, cfg.data.seed)]
        if sft.multiturn.enable:
            rows = [{sft.multiturn.messages_key: [*r[sft.prompt_key], {"role": "assistant",
                                                                         "content": r[sft.response_key]}]} for r in rows]
        write_prompts(rows, url, storage=cfg.storage)
    return url


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def _assistant_text(message: dict[str, Any]) -> str:
    """An assistant turn as the model writes it: its text, then its calls in the Hermes format
    (hermes_messages' layout; the `brackets` format's calls are plain text in `content`)."""
    from gpu_jobs.chat.hermes import hermes_messages

    return hermes_messages([message], None)[0]["content"]


def demonstration_ids(row: dict[str, Any], tokenizer: Any, sft: Any, turns: Any = None
                      ) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, response_ids, response_mask) of one row, laid out as the module doc says.
    `turns`: the rollout's turn format (TURN_FORMATS[rollout.multi_turn.format]); needed for a
    multi-turn row."""
    from gpu_jobs.data import render_prompt
    from gpu_jobs.data.rendering import conversation_messages

    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if not sft.multiturn.enable:
        answer = _encode(tokenizer, row[sft.response_key]) + eos
        return render_prompt(row[sft.prompt_key], tokenizer), answer, [1] * len(answer)
    msgs = conversation_messages(row[sft.multiturn.messages_key])
    first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    head = msgs[:first]
    prompt = turns.prompt(render_prompt(head, tokenizer), head)
    ids: list[int] = []
    mask: list[int] = []
    between: list[dict[str, Any]] = []
    for m in msgs[first:]:
        if m["role"] != "assistant":
            between.append(m)
            continue
        if between:  # the environment's turns after a model turn, ending with the next assistant header
            context = turns.message_ids(between)
            ids, mask, between = ids + context, mask + [0] * len(context), []
        turn = _encode(tokenizer, _assistant_text(m)) + eos
        ids, mask = ids + turn, mask + [1] * len(turn)
    return prompt, ids, mask


def sft_table(rows: list[dict[str, Any]], tokenizer: Any, cfg: Any, row_ids: list[int] | None = None,
              tag: str = "") -> pa.Table:
    """The batch table of `rows` (one per demonstration): uid, row (its index in its dataset,
    default 0..n-1), prompt_ids, response_ids, response_mask; `tag` prefixes the uids."""
    row_ids = list(range(len(rows))) if row_ids is None else row_ids
    turns = rollout_turns(cfg, tokenizer) if cfg.sft.multiturn.enable else None
    laid = [demonstration_ids(r, tokenizer, cfg.sft, turns) for r in rows]
    return pa.table({"uid": pa.array([f"{tag}{i}" for i in row_ids]), "row": pa.array(row_ids, pa.int64()),
                     "prompt_ids": pa.array([p for p, _, _ in laid], _INT_LIST),
                     "response_ids": pa.array([r for _, r, _ in laid], _INT_LIST),
                     "response_mask": pa.array([m for _, _, m in laid], _INT_LIST)})


def rollout_turns(cfg: Any, tokenizer: Any) -> Any:
    """The turn format a multi-turn rollout of this config renders conversations with
    (rollout.multi_turn.format and its tools): the same tokens an RL run after this one samples."""
    from gpu_jobs.chat.tools import ToolSet
    from gpu_jobs.chat.turn_formats import TURN_FORMATS

    mt = cfg.rollout.multi_turn
    return TURN_FORMATS[mt.format](tokenizer, ToolSet(mt.tool_entries()))


def check_lengths(cfg: Any, tokenizer: Any, frames: dict[str, Any]) -> None:
    """Raise DatasetError naming the first row of each frame (`frames`: what -> frame) that
    renders longer than sft.max_length, or whose response carries no loss token: before the run
    starts, not in the iteration that draws it."""
    sft = cfg.sft
    turns = rollout_turns(cfg, tokenizer) if sft.multiturn.enable else None
    for where, df in frames.items():
        for i, row in enumerate(df.to_dict("records")):
            prompt, response, mask = demonstration_ids(row, tokenizer, sft, turns)
            if len(prompt) + len(response) > sft.max_length:
                raise DatasetError(f"{where} row {i}: the demonstration renders to {len(prompt) + len(response)} "
                                   f"tokens, more than sft.max_length={sft.max_length}; shorten it or raise sft.max_length")
            if not any(mask):
                raise DatasetError(f"{where} row {i}: no assistant token to train on")

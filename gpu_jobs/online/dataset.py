"""Answers joined with their feedback by answer id: training rows in verl's prompt-dataset format.

    rows = training_rows("s3://bucket/rl", "arith")                  # list of dicts
    write_training_dataset("s3://bucket/rl", "arith", "s3://bucket/data/arith-feedback.parquet")
    storage.datasets.read_prompts("s3://bucket/data/arith-feedback.parquet")   # reads it back

One row per answer choice that received feedback:
  data_source    "rlmill/feedback/<model>"
  prompt         chat messages (a completion's text prompt becomes one user message); a served
                 agent's whole conversation, OpenAI-shaped: assistant turns with `tool_calls`
                 (arguments as JSON text) and `tool` results with `tool_call_id`
  tools          JSON text of the OpenAI tools the request offered, None without (verl's
                 `data.tools_key` column, "tools", read with json.loads as its tool datasets do)
  ability        "feedback"
  reward_model   {"style": "feedback", "ground_truth": the answer's text}
  extra_info     {answer_id, index, model, version, response, response_ids, prompt_ids, reward,
                  scores, thumbs, preferred_over, rejected_for, texts, users, endpoint, prompt_kind,
                  tool_calls}: prompt_ids and response_ids are the tokens the model saw and
                  sampled (token-in/token-out); tool_calls the answer's calls as OpenAI returned
                  them (JSON text, None without), while `response` is the text the model wrote
  response, reward, model_version   the same, as columns of their own
`reward` is the mean over the choice's voters of each voter's latest rating (signals.rating: a
row's score, else its thumbs -- never an average of a row's two; one vote per voter, choice and
kind of signal, signals.one_vote_each), None when it only has preferences or text: the number the
canary's arms are made of (canary_stats.py). `scores` and `thumbs` list what those rows carried.
Preferences are kept as pairs: `preferred_over` lists the "<answer id>#<choice>"
this one won against, `rejected_for` those that won against it.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Collection
from typing import Any

__all__ = ["read_segments", "training_rows", "write_training_dataset"]


def read_segments(root: str, model: str, storage=None,
                  feedback_from: Collection[str] | None = None) -> tuple[list[dict], list[dict]]:
    """(answer rows, feedback rows) of every committed segment of `model`, verified on read,
    without the rows of forgotten users (governance.forget_user); with `feedback_from` (segment
    manifest URIs), feedback only from those segments (answers from all: a rating may come in a
    later segment than its answer)."""
    from storage import check_name, join

    from gpu_jobs.online.consumer import FEEDBACK_DIR, manifest_rows, segment_manifests

    from gpu_jobs.online.governance import forgotten_users

    answers, feedback = [], []
    wanted = None if feedback_from is None else set(feedback_from)
    forgotten = forgotten_users(root, storage)  # their rows train nothing (rlmill feedback forget)
    for m in segment_manifests(join(root, FEEDBACK_DIR, check_name(model, "model name")), storage):
        files = [f for f in m.files if f.path.startswith("answers-") or wanted is None or m.uri in wanted]
        for f, rows in zip(files, (manifest_rows(m, [f], storage) for f in files)):
            (answers if f.path.startswith("answers-") else feedback).extend(
                r for r in rows if r.get("user") not in forgotten)
    return answers, feedback



def training_rows(root: str, model: str, storage=None,
                  feedback_from: Collection[str] | None = None) -> list[dict[str, Any]]:
    """The verl-format rows described in the module docstring, oldest answer first; with
    `feedback_from` (segment manifest URIs: a retrain window), only the feedback of those segments
    counts, so a choice rated in two windows carries each window's ratings in that window's rows.
    One vote per voter, choice and kind of signal (signals.one_vote_each: the latest)."""
    from gpu_jobs.online.signals import one_vote_each, rating

    answers, feedback = read_segments(root, model, storage, feedback_from)
    feedback = one_vote_each(feedback)  # repeated votes of one voter on one choice count once
    by_choice = {(a["answer_id"], a["index"]): a for a in answers}
    signals: dict[tuple[str, int], dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for f in sorted(feedback, key=lambda f: f["created"]):
        key = (f["answer_id"], f["index"])
        s = signals[key]
        if (value := rating(f)) is not None:
            s["ratings"].append(value)
        if f["score"] is not None:
            s["scores"].append(float(f["score"]))
        if f["thumbs"] is not None:
            s["thumbs"].append(f["thumbs"])
        if f["text"] is not None:
            s["texts"].append(f["text"])
        if f["user"] is not None:
            s["users"].append(f["user"])
        if f["preferred_over"] is not None:
            loser = (f["preferred_over"], f["preferred_over_index"] or 0)
            s["preferred_over"].append(f"{loser[0]}#{loser[1]}")
            signals[loser]["rejected_for"].append(f"{key[0]}#{key[1]}")
    rows = [_row(by_choice[key], s) for key, s in signals.items() if key in by_choice]
    return sorted(rows, key=lambda r: (r["extra_info"]["created"], r["extra_info"]["answer_id"],
                                       r["extra_info"]["index"]))


def _row(a: dict, s: dict[str, list]) -> dict[str, Any]:
    prompt = json.loads(a["prompt"])
    messages = prompt if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt) else \
        [{"role": "user", "content": prompt if isinstance(prompt, str) else json.dumps(prompt)}]
    values = s.get("ratings", [])
    reward = math.fsum(values) / len(values) if values else None
    extra = {"answer_id": a["answer_id"], "index": a["index"], "model": a["model"], "version": a["version"],
             "created": a["created"], "endpoint": a["endpoint"],
             "prompt_kind": "chat" if isinstance(prompt, list) else "text",
             "response": a["text"], "response_ids": list(a["token_ids"]), "prompt_ids": list(a["prompt_ids"]),
             "tool_calls": a.get("tool_calls"), "reward": reward,
             **{k: list(s.get(k, [])) for k in ("scores", "thumbs", "preferred_over", "rejected_for", "texts", "users")}}
    return {"data_source": f"rlmill/feedback/{a['model']}", "prompt": messages, "ability": "feedback",
            "reward_model": {"style": "feedback", "ground_truth": a["text"]}, "extra_info": extra,
            "response": a["text"], "reward": reward, "model_version": a["version"], "tools": a.get("tools")}


def write_training_dataset(root: str, model: str, out_url: str, storage=None) -> int:
    """Write training_rows to one verl-format Parquet file at `out_url`; returns the row count."""
    from storage.datasets import write_prompts

    rows = training_rows(root, model, storage)
    write_prompts(rows, out_url, storage=storage)
    return len(rows)

"""The events serving emits, their Arrow tables, and the quality gate the consumer applies.

    >>> e = feedback_event("chatcmpl-x", model="arith", version="v1", score=0.5)
    >>> check_event(e) is None, check_event({**e, "score": 2.0})
    (True, 'score 2.0 is outside [0, 1]')

Two kinds, one JSON object each on the stream (field "event"):
- answer: event_id, answer_id, endpoint ("chat.completions" | "completions"), model, version,
  created (Unix s), latency_s, prompt (chat messages or text), prompt_ids, choices [{index, text,
  token_ids, logprobs, finish_reason}], sampling {temperature, top_p, top_k, max_tokens, n, seed,
  stop}, user, session_id.
- feedback: event_id, answer_id, index (the choice), model, version, created, and at least one
  signal: score in [0, 1], thumbs "up" | "down", preferred_over (another answer id, with
  preferred_over_index), text; user, session_id.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pyarrow as pa

from gpu_jobs.serve.answers import new_event_id

__all__ = ["ANSWER_SCHEMA", "FEEDBACK_SCHEMA", "QUARANTINE_SCHEMA", "answer_event", "feedback_event",
           "check_event", "event_problem", "gate_columns", "gate_expectations", "encode", "decode", "answers_table",
           "feedback_table", "quarantine_table"]

ANSWER_SCHEMA = pa.schema([
    ("event_id", pa.string()), ("answer_id", pa.string()), ("index", pa.int32()), ("endpoint", pa.string()),
    ("model", pa.string()), ("version", pa.string()), ("created", pa.float64()), ("latency_s", pa.float64()),
    ("prompt", pa.string()),  # JSON: the chat messages, or the text of a completion prompt
    ("prompt_ids", pa.list_(pa.int32())), ("text", pa.string()), ("token_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())), ("finish_reason", pa.string()),
    ("sampling", pa.string()),  # JSON
    ("user", pa.string()), ("session_id", pa.string()),
    ("principal", pa.string()),  # the API key's principal (None: served without keys)
])
FEEDBACK_SCHEMA = pa.schema([
    ("event_id", pa.string()), ("answer_id", pa.string()), ("index", pa.int32()), ("model", pa.string()),
    ("version", pa.string()), ("created", pa.float64()), ("score", pa.float64()), ("thumbs", pa.string()),
    ("preferred_over", pa.string()), ("preferred_over_index", pa.int32()), ("text", pa.string()),
    ("user", pa.string()), ("session_id", pa.string()),
    ("principal", pa.string()),  # the API key's principal (None: served without keys)
])
QUARANTINE_SCHEMA = pa.schema([
    ("event_id", pa.string()), ("stream_id", pa.string()), ("reason", pa.string()), ("event", pa.string()),
])
SIGNALS = ("score", "thumbs", "preferred_over", "text")


def answer_event(answer_id: str, *, endpoint: str, model: str, version: str, created: float, latency_s: float,
                 prompt: Any, prompt_ids: list[int], choices: list[dict], sampling: dict,
                 user: str | None = None, session_id: str | None = None, principal: str | None = None) -> dict:
    """One answered request (all its choices); `principal`: who the API key names (never the key)."""
    return {"kind": "answer", "event_id": new_event_id(), "answer_id": answer_id, "endpoint": endpoint,
            "model": model, "version": version, "created": created, "latency_s": latency_s, "prompt": prompt,
            "prompt_ids": list(prompt_ids), "choices": choices, "sampling": sampling, "user": user,
            "session_id": session_id, "principal": principal}


def feedback_event(answer_id: str, *, model: str, version: str, index: int = 0, score: float | None = None,
                   thumbs: str | None = None, preferred_over: str | None = None, preferred_over_index: int = 0,
                   text: str | None = None, user: str | None = None, session_id: str | None = None,
                   principal: str | None = None) -> dict:
    """One piece of feedback on choice `index` of answer `answer_id`."""
    return {"kind": "feedback", "event_id": new_event_id(), "answer_id": answer_id, "index": index,
            "model": model, "version": version, "created": time.time(), "score": score, "thumbs": thumbs,
            "preferred_over": preferred_over,
            "preferred_over_index": preferred_over_index if preferred_over else None, "text": text,
            "user": user, "session_id": session_id, "principal": principal}


def encode(event: dict) -> dict[str, str]:
    """The stream entry's fields."""
    return {"event": json.dumps(event, separators=(",", ":"))}


def decode(fields: dict) -> Any:
    """The event of a stream entry (bytes or str keys), or the raw fields when it is not JSON."""
    raw = fields.get(b"event", fields.get("event"))
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", "replace")
    try:
        return json.loads(raw) if raw is not None else dict(fields)
    except ValueError:
        return {"unparsed": raw}


def _check_kind(e: Any) -> str | None:
    if not isinstance(e, dict):
        return f"not an event object ({type(e).__name__})"
    kind = e.get("kind")
    return None if kind in ("answer", "feedback") else f"unknown kind {kind!r} (answer or feedback)"


def _check_ids(e: dict) -> str | None:
    for key in ("event_id", "answer_id", "model", "version"):
        if not isinstance(e.get(key), str) or not e[key]:
            return f"no {key.replace('_', ' ')}"
    return None


def _check_model(e: dict) -> str | None:
    from storage import check_name
    from storage.errors import InvalidNameError

    try:
        check_name(e["model"], "model name")
    except InvalidNameError as exc:
        return str(exc)
    return None


def _check_created(e: dict) -> str | None:
    created = e.get("created")
    if not isinstance(created, (int, float)) or not math.isfinite(created) or created <= 0:
        return f"no valid created timestamp ({created!r})"
    return None


def _check_body(e: dict) -> str | None:
    return _check_answer(e) if e["kind"] == "answer" else _check_feedback(e)


# The stream gate's checks, in order (each assumes the ones before it passed); one dq_<name>_ok
# column each in the great-expectations gate (gate_columns).
CHECKS = (("kind", _check_kind), ("ids", _check_ids), ("model", _check_model), ("created", _check_created),
          ("body", _check_body))


def event_problem(e: Any) -> tuple[str, str] | None:
    """(check name, reason) of the first check the event fails, or None."""
    for name, check in CHECKS:
        if (reason := check(e)) is not None:
            return name, reason
    return None


def check_event(e: Any) -> str | None:
    """Why the event cannot be stored as data (the quarantine reason), or None when it can.
    Feedback for an answer never logged is the consumer's check: it needs the stored answers."""
    problem = event_problem(e)
    return None if problem is None else problem[1]


def gate_columns(events: list[Any]) -> dict[str, list]:
    """The derived columns the stream's great-expectations gate checks, one row per event:
    dq_<check>_ok (True, False for the first check that failed, None for the checks after it,
    which did not run) and dq_score (a feedback's score, None without one)."""
    cols: dict[str, list] = {f"dq_{name}_ok": [] for name, _ in CHECKS}
    cols["dq_score"] = []
    for e in events:
        failed = event_problem(e)
        failed_at = len(CHECKS) if failed is None else [n for n, _ in CHECKS].index(failed[0])
        for i, (name, _) in enumerate(CHECKS):
            cols[f"dq_{name}_ok"].append(True if i < failed_at else False if i == failed_at else None)
        score = e.get("score") if isinstance(e, dict) else None
        cols["dq_score"].append(float(score) if isinstance(score, (int, float)) and not isinstance(score, bool)
                                else None)
    return cols


def gate_expectations(gxe) -> list:
    """Every check passed (nulls, the checks that did not run, are not counted), scores in [0, 1]."""
    return [*(gxe.ExpectColumnValuesToBeInSet(column=f"dq_{name}_ok", value_set=[True]) for name, _ in CHECKS),
            gxe.ExpectColumnValuesToBeBetween(column="dq_score", min_value=0.0, max_value=1.0)]


def _check_answer(e: dict) -> str | None:
    choices = e.get("choices")
    if not isinstance(choices, list) or not choices:
        return "answer without choices"
    for c in choices:
        if not isinstance(c, dict) or not isinstance(c.get("text"), str):
            return "a choice without text"
        ids, lps = c.get("token_ids"), c.get("logprobs")
        if not isinstance(ids, list) or not isinstance(lps, list) or len(ids) != len(lps):
            return f"choice {c.get('index')}: token_ids and logprobs missing or of different lengths"
    if not isinstance(e.get("prompt_ids"), list):
        return "no prompt_ids"
    return None


def _check_feedback(e: dict) -> str | None:
    if not any(e.get(k) is not None for k in SIGNALS):
        return f"feedback without a signal (one of {', '.join(SIGNALS)})"
    score = e.get("score")
    if score is not None and (not isinstance(score, (int, float)) or not 0.0 <= score <= 1.0):
        return f"score {score!r} is outside [0, 1]"
    if e.get("thumbs") not in (None, "up", "down"):
        return f"thumbs {e.get('thumbs')!r} is not 'up' or 'down'"
    if not isinstance(e.get("index", 0), int) or e.get("index", 0) < 0:
        return f"choice index {e.get('index')!r} is not a non-negative int"
    return None


def answers_table(events: list[dict]) -> pa.Table:
    """One row per choice of each answer event."""
    rows = []
    for e in events:
        common = {k: e.get(k) for k in ("event_id", "answer_id", "endpoint", "model", "version", "created",
                                        "latency_s", "user", "session_id", "principal")}
        common["prompt"], common["prompt_ids"] = json.dumps(e["prompt"]), e["prompt_ids"]
        common["sampling"] = json.dumps(e.get("sampling") or {}, sort_keys=True)
        for c in e["choices"]:
            rows.append({**common, "index": c.get("index", 0), "text": c["text"], "token_ids": c["token_ids"],
                         "logprobs": c["logprobs"], "finish_reason": c.get("finish_reason")})
    return pa.Table.from_pylist(rows, schema=ANSWER_SCHEMA)


def feedback_table(events: list[dict]) -> pa.Table:
    return pa.Table.from_pylist([{k: e.get(k) for k in FEEDBACK_SCHEMA.names} for e in events],
                                schema=FEEDBACK_SCHEMA)


def quarantine_table(items: list[tuple[str, Any, str]]) -> pa.Table:
    """(stream id, event, reason) -> rows; the event is kept whole, as JSON."""
    rows = [{"event_id": e.get("event_id") if isinstance(e, dict) and isinstance(e.get("event_id"), str) else None,
             "stream_id": sid, "reason": reason, "event": json.dumps(e, default=str)} for sid, e, reason in items]
    return pa.Table.from_pylist(rows, schema=QUARANTINE_SCHEMA)

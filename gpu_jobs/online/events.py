"""The events serving emits, their Arrow tables, and the quality gate the consumer applies.

    >>> e = feedback_event("chatcmpl-x", model="arith", version="v1", score=0.5)
    >>> check_event(e) is None, check_event({**e, "score": 2.0})
    (True, 'score 2.0 is outside [0, 1]')

Two kinds, one JSON object each on the stream (field "event", parsed within bounds by wire.py):
- answer: event_id, answer_id, endpoint ("chat.completions" | "completions"), model, version,
  created (Unix s), latency_s, prompt (chat messages {role, content[, tool_calls][, tool_call_id]}
  or text), prompt_ids, choices [{index, text, token_ids, logprobs, finish_reason[, tool_calls]}],
  sampling {temperature, top_p, top_k, max_tokens, n, seed, stop}, tools (OpenAI's tool list or
  None), user, session_id, voter: a served agent's whole turn (the conversation with its calls and
  results, the tools, the calls it made), bounded as tools.py bounds a request.
- feedback: event_id, answer_id, index (the choice), model, version, created, and at least one
  signal: score in [0, 1], thumbs "up" | "down", preferred_over (another answer id, with
  preferred_over_index), text; user, session_id, voter.
principal and voter are the server's (from the API key), never the caller's body.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pyarrow as pa

from gpu_jobs.online.answers import new_event_id
from gpu_jobs.online.signals import fields as signal_fields, signal_problem
from gpu_jobs.online.tools import calls_problem, message_problem, tools_problem
from gpu_jobs.online.wire import MAX_ENTRY_BYTES, Unreadable, decode, encode  # noqa: F401 -- re-exported

__all__ = ["ANSWER_SCHEMA", "FEEDBACK_SCHEMA", "QUARANTINE_SCHEMA", "answer_event", "feedback_event",
           "check_event", "event_problem", "gate_columns", "gate_expectations", "encode", "decode", "answers_table",
           "feedback_table", "quarantine_table", "Unreadable", "event_json"]

ANSWER_SCHEMA = pa.schema([
    ("event_id", pa.string()), ("answer_id", pa.string()), ("index", pa.int32()), ("endpoint", pa.string()),
    ("model", pa.string()), ("version", pa.string()), ("created", pa.float64()), ("latency_s", pa.float64()),
    ("prompt", pa.string()),  # JSON: the chat messages, or the text of a completion prompt
    ("prompt_ids", pa.list_(pa.int32())), ("text", pa.string()), ("token_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())), ("finish_reason", pa.string()),
    ("sampling", pa.string()),  # JSON
    ("user", pa.string()), ("session_id", pa.string()),
    ("principal", pa.string()),  # the API key's principal (None: served without keys)
    ("voter", pa.string()),  # who the server counts the caller as (from the key; None: anonymous)
    ("tools", pa.string()),  # JSON: the request's OpenAI tools (None: none)
    ("tool_calls", pa.string()),  # JSON: the choice's OpenAI tool_calls (None: none)
])
FEEDBACK_SCHEMA = pa.schema([
    ("event_id", pa.string()), ("answer_id", pa.string()), ("index", pa.int32()), ("model", pa.string()),
    ("version", pa.string()), ("created", pa.float64()), ("score", pa.float64()), ("thumbs", pa.string()),
    ("preferred_over", pa.string()), ("preferred_over_index", pa.int32()), ("text", pa.string()),
    ("user", pa.string()), ("session_id", pa.string()),
    ("principal", pa.string()),  # the API key's principal (None: served without keys)
    ("voter", pa.string()),  # who the server counts this vote as (set by the server from the key)
])
QUARANTINE_SCHEMA = pa.schema([
    ("event_id", pa.string()), ("stream_id", pa.string()), ("reason", pa.string()), ("event", pa.string()),
])
SIGNALS = signal_fields()  # the feedback signals' fields; each one's check is signals.py's
ENDPOINTS = ("chat.completions", "completions")
_COMMON = {"kind", "event_id", "answer_id", "model", "version", "created", "user", "session_id", "principal",
           "voter"}
FIELDS = {"answer": _COMMON | {"endpoint", "latency_s", "prompt", "prompt_ids", "choices", "sampling", "tools"},
          "feedback": _COMMON | {"index", "score", "thumbs", "preferred_over", "preferred_over_index", "text"}}
CHOICE_FIELDS = {"index", "text", "token_ids", "logprobs", "finish_reason", "tool_calls"}
# Bounds of the strict schema: what one event may hold. An entry past them is quarantined, never
# half-stored (e.g. an index past int32 no longer reaches Parquet's int32 column).
MAX_ID_CHARS = 128
MAX_VOTER_CHARS = 2 * MAX_ID_CHARS + 1  # "<principal>:<user>" at most
MAX_TEXT_CHARS = 100_000
MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 256
MAX_TOKENS = 131_072
MAX_CHOICES = 128
MAX_EVENT_AGE_S = 30 * 86400.0  # created at most this long before the entry reached the stream
MAX_CLOCK_SKEW_S = 3600.0  # ... and at most this long after it
MAX_INT = 2**64  # no field holds a bigger integer (decode refuses past 20 digits already)


def answer_event(answer_id: str, *, endpoint: str, model: str, version: str, created: float, latency_s: float,
                 prompt: Any, prompt_ids: list[int], choices: list[dict], sampling: dict,
                 user: str | None = None, session_id: str | None = None, principal: str | None = None,
                 tools: list[dict] | None = None, voter: str | None = None) -> dict:
    """One answered request (all its choices); `principal`: who the API key names (never the key);
    `tools`: the OpenAI tools the request offered; `voter`: who the server counts the caller as."""
    return {"kind": "answer", "event_id": new_event_id(), "answer_id": answer_id, "endpoint": endpoint,
            "model": model, "version": version, "created": created, "latency_s": latency_s, "prompt": prompt,
            "prompt_ids": list(prompt_ids), "choices": choices, "sampling": sampling, "user": user,
            "session_id": session_id, "principal": principal, "tools": tools or None, "voter": voter}


def feedback_event(answer_id: str, *, model: str, version: str, index: int = 0, score: float | None = None,
                   thumbs: str | None = None, preferred_over: str | None = None, preferred_over_index: int = 0,
                   text: str | None = None, user: str | None = None, session_id: str | None = None,
                   principal: str | None = None, voter: str | None = None) -> dict:
    """One piece of feedback on choice `index` of answer `answer_id`; `voter`: who the server
    counts it as (from the key, never from the body)."""
    return {"kind": "feedback", "event_id": new_event_id(), "answer_id": answer_id, "index": index,
            "model": model, "version": version, "created": time.time(), "score": score, "thumbs": thumbs,
            "preferred_over": preferred_over,
            "preferred_over_index": preferred_over_index if preferred_over else None, "text": text,
            "user": user, "session_id": session_id, "principal": principal, "voter": voter}


def _check_kind(e: Any, received: float) -> str | None:
    if isinstance(e, Unreadable):
        return e.reason
    if not isinstance(e, dict):
        return f"not an event object ({type(e).__name__})"
    if not all(isinstance(k, str) for k in e):
        return "an event object with non-text keys"
    kind = e.get("kind")
    return None if kind in FIELDS else f"unknown kind {_short(kind)} (answer or feedback)"


def _check_ids(e: dict, received: float) -> str | None:
    for key in ("event_id", "answer_id", "model", "version"):
        if not isinstance(e.get(key), str) or not e[key]:
            return f"no {key.replace('_', ' ')}"
    for key in ("event_id", "answer_id", "version"):
        if (reason := _id(e[key], key.replace("_", " "))) is not None:
            return reason
    return None


def _check_model(e: dict, received: float) -> str | None:
    from storage import check_name
    from storage.errors import InvalidNameError

    try:
        check_name(e["model"], "model name")
    except InvalidNameError as exc:
        return str(exc)
    return None


def _check_created(e: dict, received: float) -> str | None:
    created = e.get("created")
    if not _is_number(created) or not math.isfinite(created) or created <= 0:
        return f"no valid created timestamp ({_short(created)})"
    if not received - MAX_EVENT_AGE_S <= created <= received + MAX_CLOCK_SKEW_S:
        return (f"created {created!r} is not within {MAX_EVENT_AGE_S / 86400:g} days before and "
                f"{MAX_CLOCK_SKEW_S:g} s after the entry reached the stream ({received:.0f})")
    return None


def _check_body(e: dict, received: float) -> str | None:
    allowed = FIELDS[e["kind"]]
    if unknown := sorted(set(e) - allowed):
        return f"unknown field(s) {', '.join(_short(k) for k in unknown[:5])} in a {e['kind']} event"
    for key in ("user", "session_id", "principal"):
        if (reason := _optional_text(e.get(key), key, MAX_ID_CHARS)) is not None:
            return reason
    if (reason := _voter(e.get("voter"))) is not None:
        return reason
    return _check_answer(e) if e["kind"] == "answer" else _check_feedback(e)


# The stream gate's checks, in order (each assumes the ones before it passed); one dq_<name>_ok
# column each in the great-expectations gate (gate_columns).
CHECKS = (("kind", _check_kind), ("ids", _check_ids), ("model", _check_model), ("created", _check_created),
          ("body", _check_body))


def event_problem(e: Any, received: float | None = None) -> tuple[str, str] | None:
    """(check name, reason) of the first check the event fails, or None. `received`: when the
    entry reached the stream (Unix s; its stream id's time), the reference for `created`; now
    when None."""
    received = time.time() if received is None else received
    for name, check in CHECKS:
        try:
            reason = check(e, received)
        except Exception as exc:  # noqa: BLE001 -- RecursionError, MemoryError, ...: that event's problem
            reason = f"the {name} check failed on it ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})"
        if reason is not None:
            return name, reason
    return None


def check_event(e: Any, received: float | None = None) -> str | None:
    """Why the event cannot be stored as data (the quarantine reason), or None when it can.
    Feedback for an answer never logged is the consumer's check: it needs the stored answers."""
    problem = event_problem(e, received)
    return None if problem is None else problem[1]


def gate_columns(events: list[Any], received: list[float] | None = None) -> dict[str, list]:
    """The derived columns the stream's great-expectations gate checks, one row per event:
    dq_<check>_ok (True, False for the first check that failed, None for the checks after it,
    which did not run) and dq_score (a feedback's score, None without one). `received`: each
    event's stream time (event_problem)."""
    cols: dict[str, list] = {f"dq_{name}_ok": [] for name, _ in CHECKS}
    cols["dq_score"] = []
    for i, e in enumerate(events):
        failed = event_problem(e, None if received is None else received[i])
        failed_at = len(CHECKS) if failed is None else [n for n, _ in CHECKS].index(failed[0])
        for i, (name, _) in enumerate(CHECKS):
            cols[f"dq_{name}_ok"].append(True if i < failed_at else False if i == failed_at else None)
        score = e.get("score") if isinstance(e, dict) else None
        cols["dq_score"].append(float(score) if _is_number(score) and math.isfinite(score) else None)
    return cols


def gate_expectations(gxe) -> list:
    """Every check passed (nulls, the checks that did not run, are not counted), scores in [0, 1]."""
    return [*(gxe.ExpectColumnValuesToBeInSet(column=f"dq_{name}_ok", value_set=[True]) for name, _ in CHECKS),
            gxe.ExpectColumnValuesToBeBetween(column="dq_score", min_value=0.0, max_value=1.0)]


def _check_answer(e: dict) -> str | None:
    if e.get("endpoint") not in ENDPOINTS:
        return f"endpoint {_short(e.get('endpoint'))} is not one of {', '.join(ENDPOINTS)}"
    latency = e.get("latency_s")
    if latency is not None and not (_is_number(latency) and math.isfinite(latency) and latency >= 0):
        return f"latency_s {_short(latency)} is not a non-negative number"
    if (reason := _check_prompt(e.get("prompt"))) is not None:
        return reason
    if (reason := _token_ids(e.get("prompt_ids"), "prompt_ids")) is not None:
        return reason
    if not e["prompt_ids"]:
        return "an answer with no prompt_ids"
    if e.get("tools") is not None and (reason := tools_problem(e["tools"])) is not None:
        return reason
    sampling = e.get("sampling")
    if sampling is not None and (not isinstance(sampling, dict) or len(json.dumps(sampling, default=str)) > 4096):
        return "sampling is not an object of at most 4096 characters"
    choices = e.get("choices")
    if not isinstance(choices, list) or not choices:
        return "answer without choices"
    if len(choices) > MAX_CHOICES:
        return f"{len(choices)} choices: at most {MAX_CHOICES}"
    seen: set[int] = set()
    for c in choices:
        if (reason := _check_choice(c, seen)) is not None:
            return reason
    return None


def _check_choice(c: Any, seen: set[int]) -> str | None:
    if not isinstance(c, dict) or not isinstance(c.get("text"), str):
        return "a choice without text"
    if unknown := sorted(set(c) - CHOICE_FIELDS):
        return f"unknown choice field(s) {', '.join(_short(k) for k in unknown[:5])}"
    index = c.get("index", 0)
    if not _is_int(index) or not 0 <= index < MAX_CHOICES or index in seen:
        return f"choice index {_short(index)} is not a distinct int in [0, {MAX_CHOICES})"
    seen.add(index)
    if len(c["text"]) > MAX_TEXT_CHARS:
        return f"choice {index}: text of {len(c['text'])} characters (at most {MAX_TEXT_CHARS})"
    ids, lps = c.get("token_ids"), c.get("logprobs")
    if not isinstance(ids, list) or not isinstance(lps, list) or len(ids) != len(lps):
        return f"choice {index}: token_ids and logprobs missing or of different lengths"
    if (reason := _token_ids(ids, f"choice {index}: token_ids")) is not None:
        return reason
    if not all(_is_number(x) and not math.isnan(x) and x <= 0 for x in lps):
        return f"choice {index}: logprobs must be numbers <= 0"
    if (reason := _optional_text(c.get("finish_reason"), "finish_reason", MAX_ID_CHARS)) is not None:
        return f"choice {index}: {reason}"
    if c.get("tool_calls") is not None and (reason := calls_problem(c["tool_calls"])) is not None:
        return f"choice {index}: {reason}"
    return None


def _check_prompt(prompt: Any) -> str | None:
    """A completion's text, or chat messages: objects with a text role and content."""
    if isinstance(prompt, str):
        return None if len(prompt) <= MAX_PROMPT_CHARS else f"a prompt of {len(prompt)} characters " \
                                                              f"(at most {MAX_PROMPT_CHARS})"
    if not isinstance(prompt, list) or not prompt or len(prompt) > MAX_MESSAGES:
        return f"prompt is not text or a list of 1 to {MAX_MESSAGES} chat messages"
    size = len(json.dumps(prompt, default=str))
    if size > MAX_PROMPT_CHARS:
        return f"a prompt of {size} characters (at most {MAX_PROMPT_CHARS})"
    return next((reason for m in prompt if (reason := message_problem(m)) is not None), None)


def _check_feedback(e: dict) -> str | None:
    if not any(e.get(k) is not None for k in SIGNALS):
        return f"feedback without a signal (one of {', '.join(SIGNALS)})"
    if (reason := signal_problem(e)) is not None:  # each signal's own check (gpu_jobs/online/signals.py)
        return reason
    if not _is_int(e.get("index", 0)) or not 0 <= e.get("index", 0) < MAX_CHOICES:
        return f"choice index {_short(e.get('index'))} is not an int in [0, {MAX_CHOICES})"
    if e.get("preferred_over") is not None:
        other = e.get("preferred_over_index", 0)
        if other is not None and (not _is_int(other) or not 0 <= other < MAX_CHOICES):
            return f"preferred_over_index {_short(other)} is not an int in [0, {MAX_CHOICES})"
    elif e.get("preferred_over_index") is not None:
        return "preferred_over_index without preferred_over"
    return None


def _is_number(x: Any) -> bool:
    """A number the checks can do arithmetic on: a float, or an int within +-MAX_INT (a bigger one
    cannot become a float, and no field holds one)."""
    if isinstance(x, bool):
        return False
    return isinstance(x, float) or (isinstance(x, int) and -MAX_INT <= x <= MAX_INT)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and -MAX_INT <= x <= MAX_INT


def _id(value: Any, what: str) -> str | None:
    """An id reaches paths and folder names: one safe segment (storage's check_name rules)."""
    from storage import check_name
    from storage.errors import InvalidNameError

    try:
        check_name(value, what)
    except InvalidNameError:
        return f"invalid {what} {_short(value)}: 1-{MAX_ID_CHARS} letters, digits, '.', '_' or '-', without '..'"
    return None


def _optional_text(value: Any, what: str, most: int) -> str | None:
    if value is None or (isinstance(value, str) and len(value) <= most):
        return None
    return f"{what} is not text of at most {most} characters ({_short(value)})"


def _voter(value: Any) -> str | None:
    """The server's voter: printable text of at most MAX_VOTER_CHARS (no control characters: it is
    a key of the canary's per-voter counts and shows in logs)."""
    if value is None or (isinstance(value, str) and 0 < len(value) <= MAX_VOTER_CHARS and value.isprintable()):
        return None
    return f"voter is not printable text of 1-{MAX_VOTER_CHARS} characters ({_short(value)})"


def _token_ids(ids: Any, what: str) -> str | None:
    if not isinstance(ids, list):
        return f"no {what}"
    if len(ids) > MAX_TOKENS:
        return f"{what}: {len(ids)} tokens (at most {MAX_TOKENS})"
    if not all(_is_int(t) and 0 <= t < 2**31 for t in ids):
        return f"{what}: token ids must be ints in [0, 2**31)"
    return None


def _short(value: Any, most: int = 40) -> str:
    """repr of a value from the network, cut to `most` characters (a reason stays one short line)."""
    if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:  # its repr alone may take seconds, or raise
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 -- a value that cannot even be shown is named by its type
        return f"a {type(value).__name__}"
    return text if len(text) <= most else text[:most] + f"...({len(text)} chars)"


def answers_table(events: list[dict]) -> pa.Table:
    """One row per choice of each answer event."""
    rows = []
    for e in events:
        common = {k: e.get(k) for k in ("event_id", "answer_id", "endpoint", "model", "version", "created",
                                        "latency_s", "user", "session_id", "principal", "voter")}
        common["prompt"], common["prompt_ids"] = json.dumps(e["prompt"]), e["prompt_ids"]
        common["sampling"] = json.dumps(e.get("sampling") or {}, sort_keys=True)
        common["tools"] = json.dumps(e["tools"]) if e.get("tools") else None
        for c in e["choices"]:
            rows.append({**common, "index": c.get("index", 0), "text": c["text"], "token_ids": c["token_ids"],
                         "logprobs": c["logprobs"], "finish_reason": c.get("finish_reason"),
                         "tool_calls": json.dumps(c["tool_calls"]) if c.get("tool_calls") else None})
    return pa.Table.from_pylist(rows, schema=ANSWER_SCHEMA)


def feedback_table(events: list[dict]) -> pa.Table:
    return pa.Table.from_pylist([{k: e.get(k) for k in FEEDBACK_SCHEMA.names} for e in events],
                                schema=FEEDBACK_SCHEMA)


def quarantine_table(items: list[tuple[str, Any, str]]) -> pa.Table:
    """(stream id, event, reason) -> rows; the event is kept whole, as JSON."""
    rows = [{"event_id": e["event_id"] if isinstance(e, dict) and _id(e.get("event_id"), "") is None else None,
             "stream_id": _utf8(sid), "reason": _utf8(reason)[:2000], "event": event_json(e)}
            for sid, e, reason in items]
    return pa.Table.from_pylist(rows, schema=QUARANTINE_SCHEMA)


def _utf8(text: str) -> str:
    """`text` with anything UTF-8 cannot hold (a lone surrogate from JSON) escaped."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


def event_json(e: Any) -> str:
    """The quarantined event as JSON, whatever it holds (bytes keys, NaN, an Unreadable entry)."""
    if isinstance(e, Unreadable):
        e = {"unreadable": e.raw}
    try:
        return json.dumps(e, default=str, allow_nan=True)  # ensure_ascii: lone surrogates escaped too
    except (TypeError, ValueError, RecursionError):  # keys that are not text, a self-referencing object
        return json.dumps({"unserializable": repr(e)[:2000]})

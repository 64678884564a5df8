"""A stream entry <-> an event: the entry's fields, its signature, and JSON parsed within bounds.

    fields = encode(event, key)              # {"event": <json>, "sig": <hex HMAC>} ({"event"} without a key)
    decode(fields, key)                      # the event, or Unreadable(reason, raw); never raises

What an entry may be (anything else is Unreadable, so the consumer quarantines it with the reason):
- the fields "event" (and "sig"), the event at most MAX_ENTRY_BYTES of UTF-8 JSON;
- with a key: signed (signing.py), checked over the exact bytes before anything is parsed;
- nested at most MAX_DEPTH deep, found by a scan of its brackets before json.loads recurses (so no
  RecursionError, and no object the checks after it cannot walk);
- every integer at most MAX_INT_DIGITS digits (|n| < 10**20, past 2**64) and every float finite,
  refused while parsing: no number that reaches the checks or the tables can overflow a float
  conversion or take seconds to print (an integer of 400 digits once made every consume raise
  OverflowError, issue 61). NaN and Infinity are not JSON and are refused too.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from dataclasses import dataclass
from typing import Any

from gpu_jobs.online.signing import sign, verified

__all__ = ["MAX_DEPTH", "MAX_ENTRY_BYTES", "MAX_INT_DIGITS", "Unreadable", "decode", "encode", "too_deep"]

MAX_ENTRY_BYTES = 4 << 20
MAX_DEPTH = 32  # an answer's tools' parameters (16 deep, tools.MAX_SCHEMA_DEPTH) sit 4 levels down
MAX_INT_DIGITS = 20
FIELDS = ({"event"}, {"event", "sig"})

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


@dataclass(frozen=True)
class Unreadable:
    """A stream entry that holds no event: the gate refuses it with `reason`; `raw` is what it
    held, as text (cut), for the quarantine row."""

    reason: str
    raw: dict[str, str]


class _Refused(ValueError):
    """A bound broken while parsing: the message is the quarantine reason."""


def encode(event: dict, key: bytes | None = None) -> dict[str, str]:
    """The stream entry's fields: the event's JSON, and with `key` its signature over those bytes."""
    data = json.dumps(event, separators=(",", ":"))
    return {"event": data} if key is None else {"event": data, "sig": sign(key, data.encode("utf-8"))}


def decode(fields: Any, key: bytes | None = None) -> Any:
    """The event of a stream entry, or Unreadable (see the module docstring). With `key`, an
    entry that is unsigned or whose signature does not match is Unreadable; without one, a "sig"
    field is allowed and not looked at. Never raises, whatever the entry holds."""
    if not isinstance(fields, dict) or not fields:
        return Unreadable("an empty entry (trimmed from the stream before it was read)", {})
    raw = {_text(k)[:64]: _text(v)[:200] for k, v in list(fields.items())[:8]}
    named = {_text(k): v for k, v in fields.items()}
    if set(named) not in FIELDS:
        return Unreadable(f"an entry with fields {', '.join(map(repr, raw))}, not 'event' (and 'sig')", raw)
    value = named["event"]
    value = value if isinstance(value, (bytes, str)) else str(value)
    if len(value) > MAX_ENTRY_BYTES:
        return Unreadable(f"an entry of {len(value)} bytes (at most {MAX_ENTRY_BYTES})", raw)
    data = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
    if key is not None and (reason := _signature_problem(key, data, named.get("sig"))) is not None:
        return Unreadable(reason, raw)
    try:
        text = data.decode("utf-8")
        if too_deep(text):
            return Unreadable(f"an entry nested more than {MAX_DEPTH} deep", raw)
        return json.loads(text, parse_constant=_no_constant, parse_int=_int, parse_float=_float)
    except _Refused as exc:
        return Unreadable(str(exc), raw)
    except (ValueError, RecursionError, MemoryError) as exc:  # UnicodeDecodeError and JSONDecodeError: ValueErrors
        return Unreadable(f"an entry that is not UTF-8 JSON ({type(exc).__name__})", raw)


def _signature_problem(key: bytes, data: bytes, sig: Any) -> str | None:
    if sig is None:
        return ("unsigned entry (no 'sig' field): this consumer has an event key, so only events serve signed "
                "with it are stored (give serve the same RLMILL_EVENT_KEY_FILE)")
    if not verified(key, data, sig):
        return ("signature does not match (the event's bytes were not signed with this consumer's key: forged, "
                "altered, or serve has another RLMILL_EVENT_KEY_FILE)")
    return None


def too_deep(text: str) -> bool:
    """Whether JSON `text` nests arrays and objects more than MAX_DEPTH deep. Strings are cut out
    first (a bracket in a string is text), then the running depth over the brackets left is
    summed in C (accumulate over map): linear in the entry, no recursion, no Python per character."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return False
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > MAX_DEPTH


def _int(digits: str) -> int:
    # Checked on the text, before int(): 10**4300 digits would take the conversion itself long.
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an entry with an integer of {len(digits.lstrip('-'))} digits (at most {MAX_INT_DIGITS}): "
                       "refused before any arithmetic")
    return int(digits)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"an entry with a number out of range ({text[:20]}{'...' if len(text) > 20 else ''})")
    return value


def _no_constant(name: str) -> None:
    raise _Refused(f"an entry with {name} (not JSON: a number must be finite)")


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)

"""What a vote is: the feedback signals, who gave one, and the one number a rating is worth.

    >>> rating({"score": 0.25, "thumbs": "up"}), rating({"thumbs": "down"}), rating({"text": "meh"})
    (0.25, 0.0, None)
    >>> SIGNALS["thumbs"].check("sideways")
    "thumbs 'sideways' is not 'up' or 'down'"

Every reader of feedback asks this module: the API's validation of POST /v1/feedback
(protocol.py), the stream gate's checks of a feedback event (events.py), the training rows
(dataset.py), the preference pairs and KTO labels built from them (gpu_jobs/data/preferences.py)
and the canary's arms (canary_stats.py). So the number a canary decides on is the number that
trains.

A signal (SIGNALS, a registry: registering a name twice raises, an unknown name lists the valid
ones) names its event field, its check (the problem with a value, as one line, or None) and, for
a rating, its value in [0, 1]:
  - score      `score`, a number in [0, 1]: the value itself
  - thumbs     `thumbs`, "up" | "down": 1 / 0
  - preference `preferred_over`, another answer's id: no value (a pair, not a rating)
  - text       `text`, at most TEXT_CHARS characters: no value

The rule (`rating`): a row's rating is the value of its first rating signal in registry order,
its score, else its thumbs; a row carrying both says one thing, and the score is the finer
statement of it. Never an average of the two.

Who gave a row (`voter_of`): the server's `voter` field (derived from the API key, never from the
body: app.py), else for rows written before that field existed the key's principal; None for an
anonymous row (a server without keys), which counts once per answer (canary_stats.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpu_jobs.registry import Registry

__all__ = ["SIGNALS", "Signal", "TEXT_CHARS", "fields", "one_vote_each", "rating", "register_signal",
           "signal_problem", "voter_of"]

TEXT_CHARS = 10_000  # a feedback text's length at most (the API's bound, and the stream gate's)
ID_CHARS = 128


@dataclass(frozen=True)
class Signal:
    """One kind of feedback: the event field it lives in, its check, and its value as a rating."""

    name: str
    field: str
    check: Callable[[Any], str | None]  # the problem with a (non-None) value, or None
    value: Callable[[Any], float | None]  # the rating in [0, 1] a valid value gives, None: not a rating
    label: str  # what it is, for messages and docs

    @property
    def rates(self) -> bool:
        """Whether the signal is a rating (score, thumbs) rather than a pair or a comment."""
        return self.name in RATING_SIGNALS


SIGNALS: Registry[Signal] = Registry("feedback signal")
RATING_SIGNALS: list[str] = []  # registry order of the signals with a value: `rating`'s precedence


def register_signal(signal: Signal, rates: bool = False) -> Signal:
    """Add `signal` (DuplicateNameError when its name is taken); `rates`: it gives a rating,
    ranked after the ratings registered before it."""
    SIGNALS.register(signal.name)(signal)
    if rates:
        RATING_SIGNALS.append(signal.name)
    return signal


def _short(value: Any, most: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= most else text[:most] + f"...({len(text)} chars)"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _score_problem(x: Any) -> str | None:
    # math.isfinite first: an int past 2**1024 does not convert to float (OverflowError), so the
    # comparison is on the int itself
    if not _number(x) or (isinstance(x, float) and not math.isfinite(x)) or not 0 <= x <= 1:
        return f"score {_short(x)} is outside [0, 1]"
    return None


def _thumbs_problem(x: Any) -> str | None:
    return None if x in ("up", "down") and isinstance(x, str) else f"thumbs {_short(x)} is not 'up' or 'down'"


def _id_problem(x: Any) -> str | None:
    from storage import check_name
    from storage.errors import InvalidNameError

    try:
        check_name(x, "preferred_over")
    except (InvalidNameError, TypeError):
        return (f"invalid preferred_over {_short(x)}: an answer id of 1-{ID_CHARS} letters, digits, '.', '_' or '-', "
                "without '..'")
    return None


def _text_problem(x: Any) -> str | None:
    if isinstance(x, str) and len(x) <= TEXT_CHARS:
        return None
    return f"text is not text of at most {TEXT_CHARS} characters ({_short(x)})"


register_signal(Signal("score", "score", _score_problem, float, "a score in [0, 1]"), rates=True)
register_signal(Signal("thumbs", "thumbs", _thumbs_problem, lambda t: 1.0 if t == "up" else 0.0,
                       "thumbs up (1) or down (0)"), rates=True)
register_signal(Signal("preference", "preferred_over", _id_problem, lambda _: None,
                       "preferred over another answer (its id, and preferred_over_index)"))
register_signal(Signal("text", "text", _text_problem, lambda _: None, "a comment"))


def fields() -> tuple[str, ...]:
    """The event fields that carry a signal, in registry order.

    >>> fields()
    ('score', 'thumbs', 'preferred_over', 'text')
    """
    return tuple(s.field for s in SIGNALS.values())


def signal_problem(row: dict[str, Any]) -> str | None:
    """What is wrong with the signals of a feedback body or event, as one line; None when it
    carries at least one signal and each one it carries passes its check."""
    given = [s for s in SIGNALS.values() if row.get(s.field) is not None]
    if not given:
        return "give one of " + ", ".join(f"{s.field} ({s.label})" for s in SIGNALS.values())
    return next((p for s in given if (p := s.check(row[s.field])) is not None), None)


def rating(row: dict[str, Any]) -> float | None:
    """The row's rating in [0, 1] (the module docstring's rule), or None when it carries none."""
    for name in RATING_SIGNALS:
        s = SIGNALS[name]
        if row.get(s.field) is not None:
            return s.value(row[s.field])
    return None


def voter_of(row: dict[str, Any]) -> str | None:
    """Who gave a row: the server's `voter`, else (rows from before it) "key:<principal>"; None
    for an anonymous row. A self-asserted `user` alone is nobody: any caller can write one.

    >>> voter_of({"voter": "web/alice", "principal": "web"}), voter_of({"principal": "a", "user": "u"})
    ('web/alice', 'key:a')
    >>> voter_of({"user": "u1"}) is None
    True
    """
    if row.get("voter"):
        return str(row["voter"])
    return f"key:{row['principal']}" if row.get("principal") else None


def one_vote_each(feedback: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with one vote per (answer, choice, voter, kind of signal): a rating, a preference
    over one other choice, a text. The latest of each counts (a voter may change their mind); an
    anonymous row's voter is the answer itself, so an answer takes one anonymous vote of each
    kind per choice. Rows carrying several signals are kept when any of their signals is the
    latest of its kind. Oldest first.

    >>> rows = [{"answer_id": "a", "index": 0, "voter": "u", "thumbs": "up", "created": 1.0},
    ...         {"answer_id": "a", "index": 0, "voter": "u", "thumbs": "up", "created": 2.0},
    ...         {"answer_id": "a", "index": 0, "voter": "v", "thumbs": "down", "created": 3.0},
    ...         {"answer_id": "a", "index": 0, "user": "x", "score": 1.0, "created": 4.0},
    ...         {"answer_id": "a", "index": 0, "user": "y", "score": 0.0, "created": 5.0}]
    >>> [(r.get("voter") or r["user"], r["created"]) for r in one_vote_each(rows)]
    [('u', 2.0), ('v', 3.0), ('y', 5.0)]
    """
    ordered = sorted(feedback, key=lambda r: r.get("created") or 0.0)
    latest: dict[tuple, int] = {}
    for i, row in enumerate(ordered):
        who = voter_of(row) or f"anonymous:{row.get('answer_id')}"
        choice = (row.get("answer_id"), row.get("index") or 0, who)
        if rating(row) is not None:
            latest[(*choice, "rating")] = i
        if row.get("preferred_over") is not None:
            latest[(*choice, "preference", row["preferred_over"], row.get("preferred_over_index") or 0)] = i
        if row.get("text") is not None:
            latest[(*choice, "text")] = i
    keep = set(latest.values())
    return [row for i, row in enumerate(ordered) if i in keep]

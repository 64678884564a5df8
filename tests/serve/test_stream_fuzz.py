"""2,000+ hostile stream entries and not one stall (issue 61 item 1): integers past 2**1024 (and
past Python's 4,300-digit limit) in every numeric field, floats written as strings, NaN and
Infinity tokens, numbers out of float range, deep nesting in every field, wrong types; one
hostile value or several per entry, seeded. Valid answers and feedback are mixed in, and one
valid feedback is XADDed after all of them: every valid event is committed exactly once, every
hostile entry is quarantined with its reason, nothing stays pending. Also: a check or a round that
raises on one entry quarantines that entry alone (the safety nets under the bounds)."""

from __future__ import annotations

import json
import random
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from gpu_jobs.online.answers import new_answer_id
from gpu_jobs.online.consumer import consume
from gpu_jobs.online.events import FIELDS, answer_event, encode, feedback_event
from tests.serve.conftest import redis_server

HOSTILE_ENTRIES = 2_000
# Numbers as raw JSON text: json.dumps could not write most of them.
BIG_NUMBERS = ["1" + "0" * 400, str(2**1024 + 1), "-" + str(2**1030), "9" * 5000, str(2**70), "1e400",
               "-1e999", "1.7976931348623157e309", "NaN", "Infinity", "-Infinity", "1" * 21]
AS_STRINGS = ['"1e400"', '"0.5"', '"NaN"', '"Infinity"', '"1' + "0" * 400 + '"', '"-0"', '"1_000"']
WRONG = ["true", "null", '""', "[]", "{}", '{"$gt": ""}', '"\\u0000"', '"\\ud800"', "-1", "2147483648"]
NUMERIC = {  # every field that holds a number, as a path into the event
    "feedback": [("created",), ("score",), ("index",), ("preferred_over_index",)],
    "answer": [("created",), ("latency_s",), ("prompt_ids", 0), ("choices", 0, "index"),
               ("choices", 0, "token_ids", 0), ("choices", 0, "logprobs", 0), ("sampling", "temperature"),
               ("sampling", "max_tokens"), ("sampling", "seed")],
}


def _nested(depth: int, rng: random.Random) -> str:
    inner = rng.choice(["1", '"x"', "[]", "{}", "1" + "0" * 400])
    if rng.random() < 0.5:
        return "[" * depth + inner + "]" * depth
    return '{"a":' * depth + inner + "}" * depth


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    import redis

    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url, redis.Redis.from_url(url)


def _answer(rng: random.Random) -> dict:
    n = rng.randint(1, 3)
    choices = [{"index": i, "text": str(i), "token_ids": [7 + i, 9], "logprobs": [-0.5, -0.1], "finish_reason": "stop"}
               for i in range(n)]
    return answer_event(new_answer_id("chatcmpl"), endpoint="chat.completions", model="arith", version="v1",
                        created=time.time(), latency_s=0.01, prompt=[{"role": "user", "content": "1+1="}],
                        prompt_ids=[5, 6], choices=choices, sampling={"temperature": 1.0, "max_tokens": 4, "seed": 1})


def _feedback(a: dict, rng: random.Random) -> dict:
    other = {"preferred_over": a["answer_id"], "preferred_over_index": 0} if rng.random() < 0.3 else {}
    return feedback_event(a["answer_id"], model="arith", version="v1", index=rng.randrange(len(a["choices"])),
                          score=rng.random(), user=f"u{rng.randrange(50)}", **other)


def _with_raw(event: dict, changes: list[tuple[tuple, str]]) -> str:
    """The event's JSON with the value at each path replaced by raw JSON text (a path whose parent
    an earlier change replaced is skipped)."""
    e = json.loads(json.dumps(event))
    marks = {}
    for path, raw in changes:
        target = e
        for step in path[:-1]:
            target = target[step] if isinstance(target, (dict, list)) else None
        if isinstance(target, dict) or (isinstance(target, list) and len(target) > path[-1]):
            marks[mark := f"__hostile_{uuid.uuid4().hex}__"] = raw
            target[path[-1]] = mark
    text = json.dumps(e)
    for mark, raw in marks.items():
        text = text.replace(json.dumps(mark), raw)
    return text


def _hostile(rng: random.Random, a: dict) -> str:
    """One hostile entry's "event" text: a valid event of either kind with a value no event may hold
    (a number past the bounds, a number written as a string where a number belongs, nesting past
    32) and up to two more changes of any kind (wrong types too, which may or may not be valid
    where they land)."""
    event = rng.choice([a, _feedback(a, rng)])
    event = {**event, "event_id": f"evt-{uuid.uuid4()}"}
    fields = sorted(FIELDS[event["kind"]] - {"kind"})
    how = rng.choice(["number", "string", "nested"])
    if how == "number":
        first = (rng.choice(NUMERIC[event["kind"]] + [(f,) for f in fields]), rng.choice(BIG_NUMBERS))
    elif how == "string":  # not sampling: its values are free-form
        first = (rng.choice([p for p in NUMERIC[event["kind"]] if p[0] != "sampling"]), rng.choice(AS_STRINGS))
    else:
        first = ((rng.choice(fields),), _nested(rng.choice([33, 200, 1_500, 5_000]), rng))
    extra = [((rng.choice(fields),), rng.choice(WRONG + BIG_NUMBERS + AS_STRINGS)) for _ in range(rng.randint(0, 2))]
    if first[0][0] == "preferred_over_index":
        event["preferred_over"] = a["answer_id"]
    return _with_raw(event, [*extra, first])  # the bound-breaking change last: nothing overwrites it


def test_two_thousand_hostile_entries_and_not_one_stall(broker, tmp_path):
    from tests.serve.test_ingestion import _committed

    url, r = broker
    stream = f"fuzz:{uuid.uuid4().hex[:8]}"
    rng = random.Random(61)
    answers = [_answer(rng) for _ in range(20)]
    valid = [*answers, *(_feedback(rng.choice(answers), rng) for _ in range(60))]
    entries = [(encode(e), True) for e in answers]  # answers before feedback on them
    rest = [(encode(e), True) for e in valid[len(answers):]]
    rest += [({"event": _hostile(rng, rng.choice(answers))}, False) for _ in range(HOSTILE_ENTRIES)]
    rng.shuffle(rest)
    last = _feedback(answers[0], rng)  # XADDed after every hostile entry: it must land
    entries += rest + [(encode(last), True)]
    pipe = r.pipeline(transaction=False)
    for fields, _ in entries:
        pipe.xadd(stream, fields)
    sids = [s.decode() for s in pipe.execute()]
    hostile_sids = {sid for sid, (_, ok) in zip(sids, entries) if not ok}

    result = consume(str(tmp_path), url, stream=stream, group="g", event_key=None)

    ids, quarantined = _committed(str(tmp_path))
    want = sorted(e["event_id"] for e in [*valid, last])
    assert sorted(ids) == want  # nothing valid lost, nothing committed twice; `last` among them
    assert result.read == len(entries) and r.xpending(stream, "g")["pending"] == 0
    assert result.quarantined == HOSTILE_ENTRIES == len(quarantined)
    assert {q["stream_id"] for q in quarantined} == hostile_sids and all(q["reason"] for q in quarantined)
    # Each refused by the bound it broke, not by a safety net catching an exception
    kinds = Counter(q["reason"].split(" (")[0][:60] for q in quarantined)
    assert not any("failed on it" in q["reason"] for q in quarantined), kinds
    assert any("integer of" in k for k in kinds) and any("nested more than" in k for k in kinds), kinds
    assert result.isolated == 0
    r.delete(stream)


def test_a_check_or_a_round_that_raises_quarantines_that_entry_alone(broker, tmp_path, monkeypatch):
    """Under the bounds, two nets: a gate check that raises (here OverflowError) refuses only its
    event; a round that raises something not an outage (here TypeError) is committed again one
    entry at a time and the entry it fails on is quarantined with the error."""
    import gpu_jobs.online.events as events
    import gpu_jobs.online.ingest as ingest

    url, r = broker
    stream = f"nets:{uuid.uuid4().hex[:8]}"
    rng = random.Random(1)
    a, b, c = _answer(rng), _answer(rng), _answer(rng)
    real_check, real_resolved = events._check_created, ingest.Round._resolved

    def check_created(e, received):
        if e["event_id"] == b["event_id"]:
            raise OverflowError("int too large to convert to float")
        return real_check(e, received)

    def resolved(self, sid, e):
        if e["event_id"] == c["event_id"]:
            raise TypeError("something no check foresaw")
        return real_resolved(self, sid, e)

    monkeypatch.setattr(events, "CHECKS", tuple((n, check_created if n == "created" else f) for n, f in events.CHECKS))
    monkeypatch.setattr(ingest.Round, "_resolved", resolved)
    fb = feedback_event(a["answer_id"], model="arith", version="v1", thumbs="up")
    for e in (a, b, c, fb):
        r.xadd(stream, encode(e))
    result = consume(str(tmp_path), url, stream=stream, group="g", event_key=None)
    from tests.serve.test_ingestion import _committed

    ids, quarantined = _committed(str(tmp_path))
    assert sorted(ids) == sorted([a["event_id"], fb["event_id"]]) and result.isolated == 1
    reasons = {json.loads(q["event"])["event_id"]: q["reason"] for q in quarantined}
    assert reasons[b["event_id"]].startswith("the created check failed on it (OverflowError")
    assert reasons[c["event_id"]].startswith("the consumer failed on it (TypeError: something no check foresaw")
    assert r.xpending(stream, "g")["pending"] == 0 and not any(p.name != "feedback" for p in Path(tmp_path).iterdir())

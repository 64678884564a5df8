"""`rlmill feedback forget` deletes (issue 61 item 6): after it, 0 bytes of the party's prompts are
anywhere under the storage root (every file's bytes, and every Parquet file's rows decompressed),
in the event stream or in its dead letters; every other party's rows are still there; a
redelivered forgotten event is not committed again; `rlmill models lineage` names the version
already trained on them. And a forget that dies between its steps loses nothing and finishes when
run again. Segments are committed by the real consumer from a real redis-server, windows by
storage's WindowLog and the retrain flow's own window-rows writer (no model is trained)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpu_jobs.online.answers import new_answer_id
from gpu_jobs.online.consumer import consume, segment_manifests
from gpu_jobs.online.events import answer_event, encode, event_json, feedback_event
from tests.cli_output import cli_output as _cli
from tests.serve.conftest import redis_server

SECRET = "ANN-SECRET"  # in every prompt of the forgotten party, and nowhere else
PARTY = ["--user", "ann", "--session", "sess-ann", "--principal", "ann-key"]
DEAD = "rlmill:events:dead"


def _answer(prompt: str, **who) -> dict:
    return answer_event(new_answer_id("chatcmpl"), endpoint="chat.completions", model="arith", version="v1",
                        created=time.time(), latency_s=0.01, prompt=[{"role": "user", "content": prompt}],
                        prompt_ids=[5, 6], choices=[{"index": 0, "text": "2", "token_ids": [7], "logprobs": [-0.5],
                                                     "finish_reason": "stop"}], sampling={}, **who)


def _rate(r, prompt: str, **who) -> dict:
    a = _answer(prompt, **who)
    r.xadd("rlmill:events", encode(a))
    r.xadd("rlmill:events", encode(feedback_event(a["answer_id"], model="arith", version="v1", score=1.0, **who)))
    return a


def _traffic(r) -> dict[str, dict]:
    """Ann by user, by session only and by principal only; bob and cat beside her; a quarantined
    entry and an unparseable one of hers, one of bob's."""
    sent = {"ann-user": _rate(r, f"{SECRET}-1 2+2=", user="ann"),
            "ann-session": _rate(r, f"{SECRET}-2 3+3=", session_id="sess-ann"),
            "ann-principal": _rate(r, f"{SECRET}-3 4+4=", principal="ann-key"),
            "bob": _rate(r, "BOB-KEEP-1 5+5=", user="bob"),
            "cat": _rate(r, "CAT-KEEP-1 6+6=", user="cat", session_id="sess-cat")}
    r.xadd("rlmill:events", {"event": json.dumps({**_answer(f"{SECRET}-Q 7+7=", user="ann"), "bogus": 1})})
    r.xadd("rlmill:events", {"event": '{"kind": "answer", "user": "ann", "prompt": "' + SECRET + '-RAW'})
    r.xadd("rlmill:events", {"event": json.dumps({**_answer("BOB-KEEP-Q 8+8=", user="bob"), "bogus": 1})})
    return sent


def _everything_under(root: Path) -> str:
    """Every file's bytes as text, and every Parquet file's rows decompressed (as JSON)."""
    import pyarrow.parquet as pq

    out = []
    for p in root.rglob("*"):
        if p.is_file():
            out.append(p.read_bytes().decode("utf-8", "replace"))
            if p.suffix == ".parquet":
                out.append(json.dumps(pq.read_table(p).to_pylist(), default=str))
    return "\n".join(out)


def _stream_text(r, stream: str) -> str:
    return "\n".join(f"{k!r}={v!r}" for _, fields in r.xrange(stream) for k, v in fields.items())


def _window(root: str, seq_rows: bool = True):
    """Window over every segment no window holds, its training file written by the retrain flow's writer."""
    from flows.online.retrain import feedback_pieces, run_id_for, write_window_rows
    from gpu_jobs.online.windows import WindowLog
    from storage.layout import ModelLayout

    log = WindowLog(ModelLayout(root, "arith"))
    w = log.claim(feedback_pieces(root, "arith"), run_id_for=lambda seq: run_id_for("arith", seq))
    dest = f"{ModelLayout(root, 'arith').root}/retrain/{w.run_id}/window.parquet"
    assert write_window_rows.fn(root, "arith", w, dest, None) > 0
    return log, w


def test_forget_deletes_every_byte_of_the_party_and_keeps_everyone_else(tmp_path):
    import redis

    from flows.cli import main
    from gpu_jobs.online.dataset import read_segments
    from gpu_jobs.online.governance import Party

    root = tmp_path / "store"
    with redis_server(tmp_path) as url:
        r = redis.Redis.from_url(url)
        sent = _traffic(r)
        consume(str(root), url)
        log, first = _window(str(root))
        log.finish(first, {"decision": "promote", "promoted_version": "v2"})  # v2 trained on ann's rows
        time.sleep(1.1)  # window 2's segments are committed after window 1 (1 s resolution of times)
        _rate(r, f"{SECRET}-4 9+9=", user="ann")
        _rate(r, "DAN-KEEP-1 1+9=", user="dan")
        consume(str(root), url)
        _, second = _window(str(root))  # claimed, not trained yet
        r.xadd(DEAD, {"stream_id": "1-1", "reason": "delivered 6 times", "event": event_json(
            _answer(f"{SECRET}-DEAD", principal="ann-key"))})
        r.xadd(DEAD, {"stream_id": "1-2", "reason": "delivered 6 times", "event": event_json(
            _answer("BOB-KEEP-DEAD", user="bob"))})
        late = {"ann": _answer(f"{SECRET}-LATE", user="ann"), "bob": _answer("BOB-KEEP-LATE", user="bob")}
        for a in late.values():  # in the stream, not consumed yet
            r.xadd("rlmill:events", encode(a))
        assert SECRET in _everything_under(root) and SECRET in _stream_text(r, DEAD)
        party = Party.of(users=["ann"], sessions=["sess-ann"], principals=["ann-key"])
        before = [sorted(x["event_id"] for x in rows if not party.matches(x))
                  for rows in read_segments(str(root), "arith")]

        out = _cli("feedback", "forget", "--root", str(root), *PARTY, "--redis", url, "--reason", "asked by email")
        assert "'ann', 'session:sess-ann', 'principal:ann-key' forgotten" in out, out
        assert "1 stream entr(ies) and 1 dead letter(s)" in out and "already trained on their rows: v2" in out, out

        text = _everything_under(root)
        assert SECRET not in text, text[text.find(SECRET) - 300:text.find(SECRET) + 100]
        for keep in ("BOB-KEEP-1", "CAT-KEEP-1", "DAN-KEEP-1", "BOB-KEEP-Q"):
            assert keep in text, keep
        assert SECRET not in _stream_text(r, "rlmill:events") + _stream_text(r, DEAD)
        assert "BOB-KEEP-LATE" in _stream_text(r, "rlmill:events") and "BOB-KEEP-DEAD" in _stream_text(r, DEAD)
        answers, feedback = read_segments(str(root), "arith")
        assert [sorted(x["event_id"] for x in rows) for rows in (answers, feedback)] == before  # all of the others'
        assert {a["user"] for a in answers} == {"bob", "cat", "dan"}

        r.xadd("rlmill:events", encode(sent["ann-user"]))  # a redelivery of a forgotten event
        again = consume(str(root), url)
        assert again.duplicates >= 1 and SECRET not in _everything_under(root)

    from flows.online.retrain import feedback_pieces, window_rows
    from gpu_jobs.online.windows import WindowLog
    from storage.layout import ModelLayout

    log = WindowLog(ModelLayout(str(root), "arith"))
    assert log.claim(feedback_pieces(str(root), "arith"), lambda seq: f"w{seq}") is not None  # only bob's late row
    assert {r["extra_info"]["answer_id"] for r in window_rows(str(root), "arith", second)} \
        == {a["answer_id"] for a in answers if a["user"] == "dan"}  # window 2 still reads its (rewritten) segments
    (v2,) = json.loads(_cli("models", "lineage", "arith", "--root", str(root), "--json"))
    assert v2["version"] == "v2" and v2["forgotten_reached"] == ["ann", "principal:ann-key", "session:sess-ann"]
    assert v2["windows"][0]["users"] == 2  # bob and cat voted in window 1's segments now


def test_forget_refuses_no_party_and_an_empty_id_in_one_line(tmp_path):
    from flows.cli import main

    with pytest.raises(SystemExit, match="rlmill: say whose data to forget: --user, --session or --principal"):
        main(["feedback", "forget", "--root", str(tmp_path), "--redis", "none"])
    with pytest.raises(SystemExit, match="rlmill: --session '': give the id the requests carried"):
        main(["feedback", "forget", "--root", str(tmp_path), "--session", "", "--redis", "none"])


@pytest.mark.parametrize("step", ["broker", "derived", "committed", "segment"])
def test_a_forget_that_dies_between_its_steps_loses_nothing_and_finishes_when_run_again(tmp_path, step):
    import redis

    from gpu_jobs.online.dataset import read_segments
    from gpu_jobs.online.governance import Party, forget, forget_requests

    root = str(tmp_path / "store")
    party = Party.of(users=["ann"])
    with redis_server(tmp_path) as url:
        r = redis.Redis.from_url(url)
        _traffic(r)
        consume(root, url)
        _window(root)
        kept = sorted(a["answer_id"] for a in read_segments(root, "arith")[0] if a["user"] != "ann")

        class Died(Exception):
            pass

        def die(name: str) -> None:
            if name == step:
                raise Died(name)

        with pytest.raises(Died):
            forget(root, party, redis_url=url, between=die)
        answers = read_segments(root, "arith")[0]
        assert sorted(a["answer_id"] for a in answers if a["user"] != "ann") == kept  # none lost, none twice
        (unfinished,) = forget_requests(root)
        assert unfinished.done is None
        result = forget(root, party, redis_url=url)
    (request,) = forget_requests(root)  # the same request, finished
    assert request.id == unfinished.id == result.request.id and request.done is not None
    assert SECRET + "-1" not in _everything_under(Path(root))
    assert sorted(a["answer_id"] for a in read_segments(root, "arith")[0]) == kept
    assert not [m for m in segment_manifests(f"{root}/feedback") if m.extra.get("replaces")
                and Path(m.extra["replaces"][0]).parent.exists()]  # every old folder removed

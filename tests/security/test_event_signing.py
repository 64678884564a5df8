"""Events the consumer can trust (issue 61 item 4): serve signs each entry with a key from the
environment or a 0600 file, the consumer stores only what verifies; feedback takes its version
from the committed answer, never from the entry; an answer is logged once. Real redis-server."""

from __future__ import annotations

import stat
import time

import pytest

from gpu_jobs.online.answers import new_answer_id
from gpu_jobs.online.consumer import SEGMENT_KIND, consume, hour_of
from gpu_jobs.online.events import answer_event, encode, feedback_event
from gpu_jobs.online.signing import KEY_ENV, KEY_FILE_ENV, SigningKeyError, event_key, sign, write_key_file
from tests.serve.conftest import redis_server

KEY = b"k" * 32


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    import redis

    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url, redis.Redis.from_url(url)


def _answer(version: str = "v1") -> dict:
    choices = [{"index": 0, "text": "2", "token_ids": [7], "logprobs": [-0.5], "finish_reason": "stop"}]
    return answer_event(new_answer_id("chatcmpl"), endpoint="chat.completions", model="arith", version=version,
                        created=time.time(), latency_s=0.01, prompt=[{"role": "user", "content": "1+1="}],
                        prompt_ids=[5, 6], choices=choices, sampling={})


def _feedback_rows(root) -> list[dict]:
    from gpu_jobs.online.dataset import read_segments

    return read_segments(str(root), "arith")[1]


def test_the_key_comes_from_the_environment_or_a_private_file(tmp_path):
    path = write_key_file(tmp_path / "keys" / "event.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and write_key_file(path).read_text() == path.read_text()
    assert event_key({KEY_FILE_ENV: str(path)}) == path.read_text().strip().encode() and len(event_key(
        {KEY_FILE_ENV: str(path)})) == 64
    assert event_key({KEY_ENV: "x" * 40}) == b"x" * 40 and event_key({}) is None
    refused = {"short": {KEY_ENV: "x" * 31}, "both": {KEY_ENV: "x" * 40, KEY_FILE_ENV: str(path)},
               "missing": {KEY_FILE_ENV: str(tmp_path / "nope")}}
    open_file = tmp_path / "open.key"
    open_file.write_text("y" * 64)
    open_file.chmod(0o640)
    refused["group-readable"] = {KEY_FILE_ENV: str(open_file)}
    messages = {}
    for what, env in refused.items():
        with pytest.raises(SigningKeyError) as err:
            event_key(env)
        messages[what] = str(err.value)
    assert "31 bytes: give at least 32" in messages["short"] and "both" in messages["both"]
    assert f"chmod 600 {open_file}" in messages["group-readable"] and "cannot read it" in messages["missing"]


def test_only_signed_entries_are_stored_and_forgeries_are_counted(broker, tmp_path):
    """serve's publisher signs; the consumer with the key commits those, and quarantines an
    unsigned entry, a wrong signature, a signed entry whose bytes were changed, and one signed
    with another key, each counted by its reason. Without a key, the signed entries land too."""
    from gpu_jobs.online.broker import EventPublisher

    url, r = broker
    stream = f"signed:{time.monotonic_ns()}"
    a = _answer()
    fb = feedback_event(a["answer_id"], model="arith", version="v1", score=1.0)
    publisher = EventPublisher(url, stream=stream, event_key=KEY)
    for e in (a, fb):
        publisher.publish(e)
    assert publisher.flush(10)
    publisher.close()
    [(_, fields), _] = r.xrange(stream)
    assert fields[b"sig"].decode() == sign(KEY, fields[b"event"])  # over the exact bytes Redis holds
    forged = [feedback_event(a["answer_id"], model="arith", version="v1", score=0.0) for _ in range(4)]
    r.xadd(stream, encode(forged[0]))  # unsigned
    r.xadd(stream, {**encode(forged[1], KEY), "sig": "0" * 64})  # a made-up signature
    signed = encode(forged[2], KEY)
    r.xadd(stream, {**signed, "event": signed["event"].replace('"score":0.0', '"score":1.0')})  # altered
    r.xadd(stream, encode(forged[3], b"z" * 32))  # another key's
    result = consume(str(tmp_path / "keyed"), url, stream=stream, group="keyed", event_key=KEY, trim=False)
    assert (result.answers, result.feedback, result.quarantined) == (1, 1, 4)
    assert result.reasons == {"unsigned entry": 1, "signature does not match": 3}
    assert [f["event_id"] for f in _feedback_rows(tmp_path / "keyed")] == [fb["event_id"]]
    unchecked = consume(str(tmp_path / "open"), url, stream=stream, group="open", event_key=None)
    # what a consumer without the key lets in: every forgery
    assert (unchecked.answers, unchecked.feedback, unchecked.quarantined) == (1, 5, 0)


def test_feedback_takes_the_version_of_the_answer_it_names(broker, tmp_path):
    """A feedback entry naming another version is stored with its answer's (same batch, a later
    batch through the committed index, and an answer in a segment written before the index held
    versions); a second answer event for a logged answer id is quarantined."""
    from storage import join

    from gpu_jobs.online.events import answers_table, feedback_table
    from gpu_jobs.online.segments import FEEDBACK_DIR, commit_segment

    url, r = broker
    stream = f"versions:{time.monotonic_ns()}"
    a, b, old = _answer("v1"), _answer("v1"), _answer("v1")
    # `old` as a segment written before answer_versions (its manifest lists answer ids only)
    folder = join(str(tmp_path), FEEDBACK_DIR, "arith", hour_of(old["created"]))
    commit_segment(join(folder, f"segment-{old['event_id']}"), {"answers": answers_table([old]),
                   "feedback": feedback_table([])}, SEGMENT_KIND,
                   {"event_ids": [old["event_id"]], "answer_ids": [old["answer_id"]]})
    r.xadd(stream, encode(a))
    r.xadd(stream, encode(feedback_event(a["answer_id"], model="arith", version="v2", score=1.0)))  # same batch
    first = consume(str(tmp_path), url, stream=stream, group="g", event_key=None)
    r.xadd(stream, encode(b))
    second_batch = [feedback_event(x["answer_id"], model="arith", version="v2", score=1.0) for x in (a, old)]
    for e in second_batch:
        r.xadd(stream, encode(e))
    r.xadd(stream, encode({**a, "event_id": new_answer_id("evt"), "version": "v2"}))  # a's id logged again
    r.xadd(stream, encode({**b, "event_id": new_answer_id("evt")}))  # b's id twice in one batch
    second = consume(str(tmp_path), url, stream=stream, group="g", event_key=None)
    assert (first.feedback, first.versions_corrected, second.feedback, second.versions_corrected) == (1, 1, 2, 2)
    assert {f["version"] for f in _feedback_rows(tmp_path)} == {"v1"}
    assert (second.answers, second.quarantined, second.reasons) == (1, 2, {"an answer logged twice": 2})


def test_no_key_is_one_warning_line_and_a_bad_key_one_refusal(monkeypatch, tmp_path, capsys):
    from flows.cli_serve import _event_key
    from flows.user_errors import UserError

    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    assert _event_key("feedback consume") is None
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("rlmill: warning (feedback consume): events are unsigned") and KEY_FILE_ENV in line
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(UserError, match="5 bytes: give at least 32"):
        _event_key("serve")
    monkeypatch.setenv(KEY_ENV, "s" * 32)
    assert _event_key("serve") == b"s" * 32 and capsys.readouterr().err == ""  # a key: no warning

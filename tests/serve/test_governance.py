"""rlmill feedback forget and rlmill models lineage (issues 42 and 61, item 6): a forgotten user's
rows are deleted, rows of theirs that arrive after the request train nothing, and lineage says which
versions their rows reached. Segments are committed by the real consumer from a real
redis-server; the retrain windows with storage's own WindowLog (what rl-retrain writes), without
training a model. What forget deletes, byte for byte, and its crashes: test_forget.py."""

from __future__ import annotations

import json
import time

import pytest

from gpu_jobs.online.answers import new_answer_id
from gpu_jobs.online.consumer import consume
from gpu_jobs.online.events import answer_event, encode, feedback_event
from tests.cli_output import cli_output as _cli
from tests.serve.conftest import redis_server


def _answer(user: str) -> dict:
    return answer_event(new_answer_id("chatcmpl"), endpoint="chat.completions", model="arith", version="v1",
                        created=time.time(), latency_s=0.01, prompt=[{"role": "user", "content": "1+1="}],
                        prompt_ids=[5, 6], choices=[{"index": 0, "text": "2", "token_ids": [7], "logprobs": [-0.5],
                                                     "finish_reason": "stop"}], sampling={}, user=user)


def _rate(r, user: str) -> None:
    a = _answer(user)
    r.xadd("rlmill:events", encode(a))
    r.xadd("rlmill:events", encode(feedback_event(a["answer_id"], model="arith", version="v1", thumbs="up",
                                                  user=user)))


def test_forget_and_lineage(tmp_path):
    import redis

    from flows.cli import main
    from gpu_jobs.online.dataset import training_rows
    from storage.layout import ModelLayout
    from flows.online.retrain import feedback_pieces
    from gpu_jobs.online.windows import WindowLog

    root = str(tmp_path / "store")
    log = WindowLog(ModelLayout(root, "arith"))
    with redis_server(tmp_path) as url:
        r = redis.Redis.from_url(url)
        for user in ("ann", "bob"):
            _rate(r, user)
        consume(root, url)
        first = log.claim(feedback_pieces(root, "arith"), run_id_for=lambda seq: f"retrain-arith-w{seq}")
        log.finish(first, {"decision": "promote", "promoted_version": "v2"})
        time.sleep(1.1)  # the forget request comes after window 1 was opened (times have 1 s resolution)
        out = _cli("feedback", "forget", "--root", root, "--user", "ann", "--reason", "asked by email",
                   "--redis", url)
        assert "'ann' forgotten" in out and "2 row(s) of arith when asked; deleted 2 segment row(s)" in out, out
        assert "already trained on their rows: v2" in out, out
        _rate(r, "ann")  # ann again after the request: still not trained
        _rate(r, "cat")
        consume(root, url)

    assert {row["extra_info"]["users"][0] for row in training_rows(root, "arith")} == {"bob", "cat"}
    # rl-retrain's listing: a segment forget rewrote is held by window 1 through its aliases
    second = log.claim(feedback_pieces(root, "arith"), run_id_for=lambda seq: f"retrain-arith-w{seq}")
    window_users = {row["extra_info"]["users"][0] for row in training_rows(root, "arith", feedback_from=second.uris)}
    assert window_users == {"cat"}  # ann's new rows are in the window's segment but train nothing
    log.finish(second, {"decision": "promote", "promoted_version": "v3"})

    versions = {v["version"]: v for v in json.loads(_cli("models", "lineage", "arith", "--root", root, "--json"))}
    assert versions["v2"]["forgotten_reached"] == ["ann"] and versions["v3"]["forgotten_reached"] == []
    assert versions["v2"]["windows"][0]["users"] == 1  # bob: ann's rows are gone
    assert versions["v3"]["windows"][0]["users"] == 2  # ann's rows after the request are on file, left out of training
    assert "arith v3: trained on 1 window(s)\n  window 2 (run retrain-arith-w2, promote)" in _cli(
        "models", "lineage", "arith", "v3", "--root", root)
    with pytest.raises(SystemExit, match="rlmill: --user '': give the id the requests carried"):  # one line
        main(["feedback", "forget", "--root", root, "--user", "", "--redis", "none"])

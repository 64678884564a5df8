"""Retention (issue 61 item 6): `rlmill feedback retain` and the rl-retention flow remove the hour
folders of raw events and quarantine whose whole hour is older than the retention, keep (and name)
one an unfinished retrain window holds, and trim the dead letters to the same age; --dry-run only
says so. Segments come from the real consumer and a real redis-server; old hours from events
created two hours ago and stream ids given in the past."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gpu_jobs.online.answers import new_answer_id
from gpu_jobs.online.consumer import consume, hour_of
from gpu_jobs.online.events import answer_event, encode
from tests.cli_output import cli_output as _cli
from tests.serve.conftest import redis_server

DEAD = "rlmill:events:dead"


def _answer(model: str, created: float, user: str) -> dict:
    return answer_event(new_answer_id("chatcmpl"), endpoint="completions", model=model, version="v1",
                        created=created, latency_s=0.01, prompt="1+1=", prompt_ids=[5], sampling={}, user=user,
                        choices=[{"index": 0, "text": "2", "token_ids": [7], "logprobs": [-0.5],
                                  "finish_reason": "stop"}])


def test_retain_removes_old_hours_keeps_a_held_one_and_trims_dead_letters(tmp_path):
    import redis

    from flows.online.retrain import feedback_pieces, run_id_for
    from gpu_jobs.online.windows import WindowLog
    from storage.layout import ModelLayout

    root, now = tmp_path / "store", time.time()
    old_ms = int((now - 3 * 3600) * 1000)
    with redis_server(tmp_path) as url:
        r = redis.Redis.from_url(url)
        r.xadd("rlmill:events", {"event": json.dumps({**_answer("arith", now, "bob"), "bogus": 1})},
               id=f"{old_ms}-0")  # quarantined, filed under its stream time: 3 h ago
        for model, created, user in (("arith", now - 2 * 3600, "bob"), ("arith", now, "cat"),
                                     ("other", now - 2 * 3600, "dan")):
            r.xadd("rlmill:events", encode(_answer(model, created, user)))
        consume(str(root), url)
        WindowLog(ModelLayout(str(root), "other")).claim(feedback_pieces(str(root), "other"),
                                                         lambda seq: run_id_for("other", seq))  # not finished
        r.xadd(DEAD, {"event": "{}", "reason": "old"}, id=f"{old_ms + 3600_000}-0")
        r.xadd(DEAD, {"event": "{}", "reason": "new"})
        old = {p.name for p in (root / "feedback" / "arith").iterdir()} | {p.name for p in (
            root / "feedback" / "_quarantine").iterdir()}
        assert {hour_of(now - 2 * 3600), hour_of(now - 3 * 3600), hour_of(now)} <= old

        dry = _cli("feedback", "retain", "--root", str(root), "--older-than", "1h", "--redis", url, "--dry-run")
        assert "would remove 2 hour folder(s) and 1 dead letter(s)" in dry and "(dry run: nothing removed)" in dry, dry
        assert f"kept {root}/feedback/other/{hour_of(now - 2 * 3600)}: held by window 1" in dry, dry
        assert (root / "feedback" / "arith" / hour_of(now - 2 * 3600)).is_dir() and r.xlen(DEAD) == 2

        out = _cli("feedback", "retain", "--root", str(root), "--older-than", "1h", "--redis", url)
        assert "removed 2 hour folder(s) and 1 dead letter(s)" in out, out
        assert not (root / "feedback" / "arith" / hour_of(now - 2 * 3600)).exists()
        assert not (root / "feedback" / "_quarantine" / hour_of(now - 3 * 3600)).exists()
        assert (root / "feedback" / "arith" / hour_of(now)).is_dir()  # this hour stays
        assert (root / "feedback" / "other" / hour_of(now - 2 * 3600)).is_dir()  # its window's run still reads it
        assert [f[b"reason"] for _, f in r.xrange(DEAD)] == [b"new"]

        from flows.online.retention import rl_retention

        summary = rl_retention(root=str(root), older_than="1h", redis_url=url, dry_run=True)
        assert summary["removed"] == [] and list(summary["kept"]) == [f"{root}/feedback/other/{hour_of(now - 7200)}"]
        state = rl_retention(root=str(root), older_than="soon", return_state=True)
        assert state.is_failed() and "give a number and a unit, e.g. 30d" in state.message


@pytest.mark.parametrize("age", ["0d", "-3h", "soon", "nan"])
def test_retain_refuses_an_age_that_is_not_one_in_one_line(tmp_path, age):
    from flows.cli import main

    with pytest.raises(SystemExit, match=r"rlmill: --older-than: age .*: give a"):
        main(["feedback", "retain", "--root", str(Path(tmp_path)), f"--older-than={age}", "--redis", "none"])

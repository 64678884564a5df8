"""`rlmill simulate` (gpu_jobs/online/simulate.py, flows/cli_simulate.py): the hidden preference and
the table by hand, the seeded plan, ten simulated requests against a real server of the built-in
model with redis (every answer scored as stated, every score in the stream as feedback naming
the user and the answering version), and the one-line refusals.

    .venv/bin/python -m pytest -q tests/serve/test_simulate.py
"""

from __future__ import annotations

import argparse
import doctest
import json

import pytest

from gpu_jobs.online.simulate import (SimAnswer, format_table, plan_requests, preference_score, score_answer,
                                      version_table)


# ------------------------------------------------------------------------------------ pure parts
@pytest.mark.parametrize("correct,tokens,limit,want", [
    (1.0, 3, 6, 0.75),   # "46" + EOS: 1 - 3/12
    (1.0, 0, 6, 1.0),    # nothing costs nothing
    (1.0, 6, 6, 0.5),    # every token used: half the credit
    (1.0, 10, 6, 0.5),   # past L counts as L
    (0.0, 2, 6, 0.0),    # wrong is 0 however short
    (1.0, 2, 4, 0.75),   # 1 - 2/8
])
def test_preference_formula(correct, tokens, limit, want):
    assert preference_score(correct, tokens, limit) == pytest.approx(want)


def test_answers_scored_by_the_task_rule():
    from gpu_jobs.data.generators import arith_row

    row = arith_row(12, 34, "test", 0)  # ground truth "46"
    assert score_answer(row, "46", 3, 6) == (1.0, 0.75)
    assert score_answer(row, " 46 ", 5, 6) == (1.0, pytest.approx(1 - 5 / 12))  # the rule strips; tokens count
    assert score_answer(row, "47", 3, 6) == (0.0, 0.0)
    assert score_answer(row, "46 ", 6, 6)[1] == 0.5
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        preference_score(1.0, 1, 0)


def _a(version: str, user: str, score: float, correct: float) -> SimAnswer:
    return SimAnswer(0, user, "1+1=", "2", version, 2, correct, score, "id", True, 0.0)


def test_version_table_and_its_text():
    rows = version_table([_a("v1", "u1", 0.75, 1.0), _a("v2", "u2", 0.0, 0.0), _a("v1", "u2", 0.5, 1.0),
                          _a("v1", "u1", 0.0, 0.0)])
    # v1: 3 requests from 2 users, scores (0.75 + 0.5 + 0) / 3, two of three right; v2 after it (first seen second)
    assert rows == [{"version": "v1", "requests": 3, "users": 2, "mean_reward": pytest.approx(1.25 / 3),
                     "correct": pytest.approx(2 / 3)},
                    {"version": "v2", "requests": 1, "users": 1, "mean_reward": 0.0, "correct": 0.0}]
    assert format_table(rows).splitlines() == ["version  requests  users  mean_reward  correct",
                                               "v1              3      2        0.417    0.667",
                                               "v2              1      1        0.000    0.000"]
    assert format_table([]) == "(no answers)"


def test_plan_is_seeded_and_pooled():
    import gpu_jobs.online.simulate as sim

    assert doctest.testmod(sim).failed == 0
    key = lambda plan: [(p.user, p.row["prompt"][0]["content"], p.seed) for p in plan]  # noqa: E731
    assert key(plan_requests(12, 3, 5)) == key(plan_requests(12, 3, 5))
    assert key(plan_requests(12, 3, 5)) != key(plan_requests(12, 3, 6))
    fresh = plan_requests(40, 3, 5)
    assert len({p.row["prompt"][0]["content"] for p in fresh}) == 40  # no pool: every problem new
    assert {p.user for p in fresh} == {"sim-user-0", "sim-user-1", "sim-user-2"}
    pool = {p.row["prompt"][0]["content"] for p in plan_requests(5, 1, 5)}  # the stream's first 5 problems
    r1, r2 = plan_requests(60, 4, 5, pool=5, round=1), plan_requests(60, 4, 5, pool=5, round=2)
    assert {p.row["prompt"][0]["content"] for p in r1} == pool == {p.row["prompt"][0]["content"] for p in r2}
    assert key(r1) != key(r2)  # another round: other draws, same pool


# ------------------------------------------------------------------------------------ against serve
def test_simulated_users_rate_real_answers(served, redis_url, run_app):
    import redis

    from gpu_jobs.online.app import Server, ServeSettings
    from gpu_jobs.online.broker import STREAM, EventPublisher
    from gpu_jobs.online.events import decode
    from gpu_jobs.online.simulate import simulate

    plan = plan_requests(10, 3, 0)
    server = Server(served, EventPublisher(redis_url), ServeSettings(event_wait_ms=60_000))
    with run_app(server) as base:
        result = simulate(f"{base}/v1", plan, max_tokens=6, temperature=1.0, concurrency=2, thumbs=True)
    server.close()
    assert [a.index for a in result.answers] == list(range(10))
    for p, a in zip(plan, result.answers):
        truth = p.row["reward_model"]["ground_truth"]
        correct = 1.0 if a.text.strip() == truth else 0.0  # the task's rule, restated
        assert (a.user, a.version, a.correct) == (p.user, served.version, correct)
        assert a.score == pytest.approx(correct * (1 - min(a.n_tokens, 6) / 12)) and a.feedback_logged
    assert result.table == version_table(result.answers) and result.table[0]["requests"] == 10
    events = [decode(f) for _, f in redis.Redis.from_url(redis_url).xrange(STREAM)]
    answers = {e["answer_id"]: e for e in events if e["kind"] == "answer"}
    feedback = [e for e in events if e["kind"] == "feedback"]
    assert len(answers) == len(feedback) == 10
    by_id = {a.answer_id: a for a in result.answers}
    for f in feedback:  # each score reached the log, on the answer it rates, from that answer's user
        a = by_id[f["answer_id"]]
        assert (f["score"], f["user"], f["version"]) == (pytest.approx(a.score), a.user, served.version)
        assert f["thumbs"] == ("up" if a.score >= 0.5 else "down")
        assert answers[a.answer_id]["user"] == a.user and answers[a.answer_id]["version"] == a.version


# ------------------------------------------------------------------------------------ the CLI's refusals
def _args(*argv: str):
    from flows.cli_simulate import add_simulate_parser

    p = argparse.ArgumentParser(prog="rlmill")
    add_simulate_parser(p.add_subparsers(dest="command", required=True))
    return p.parse_args(["simulate", *argv])


@pytest.mark.parametrize("argv,line", [
    (("--requests", "0"), "--requests 0 is below 1: give a positive number"),
    (("--users", "-2"), "--users -2 is below 1: give a positive number"),
    (("--pool", "0"), "--pool 0 is below 1: give a positive number"),
    (("--temperature", "2.5"), "--temperature 2.5 is outside 0..2 (what the server takes)"),
    (("--temperature", "nan"), "--temperature nan is outside 0..2 (what the server takes)"),
    (("--requests", "9000"), "--requests 9000: the built-in task has 8100 distinct problems; give at most 8100 "
                             "(or --pool to ask some again)"),
])
def test_wrong_numbers_are_one_line(argv, line):
    from flows.cli_simulate import cmd_simulate
    from flows.user_errors import UserError

    with pytest.raises(UserError) as exc:
        cmd_simulate(_args(*argv))
    assert str(exc.value) == line


def test_no_server_or_another_model_is_one_line(served, run_app, capsys):
    from gpu_jobs.online.app import Server
    from flows.cli_simulate import cmd_simulate
    from flows.user_errors import UserError
    from tests.servers import free_port

    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError, match=rf"^no rlmill serve answers GET {nobody}/v1/models \(ConnectError: .*\): "
                                        "start `rlmill serve` or pass --url with its address$"):
        cmd_simulate(_args("--url", nobody))
    server = Server(served, None)
    with run_app(server) as base:
        with pytest.raises(UserError, match=r"serves 'builtin', not 'arith': pass --model builtin or leave --model out"):
            cmd_simulate(_args("--url", base, "--model", "arith"))
        cmd_simulate(_args("--url", base, "--requests", "2", "--users", "1", "--temperature", "0"))
    server.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("rlmill: 2 requests from 1 simulated users to builtin") and out[1].startswith("version")
    assert out[2].split()[:2] == [served.version, "2"]
    assert out[3].startswith("rlmill: 2 feedback event(s) were not logged")  # no broker: said, not hidden

"""The online loop's chaos rows (benchmarks/chaos/online_runs.py) and their audit
(benchmarks/chaos/online_audit.py): the audit's arithmetic on hand-made layouts -- it must catch a
feedback segment trained twice, one skipped, a window whose rows do not add up, a CURRENT without
its promotion and an answer from a version never promoted -- and (e2e) each row end to end with
real processes: rl-retrain runs, rlmill serve, the consumer, redis-server.

    .venv/bin/python -m pytest -q tests/chaos/test_online_chaos.py -p no:cacheprovider           # the quick ones
    .venv/bin/python -m pytest -q tests/chaos/test_online_chaos.py -m e2e -p no:cacheprovider    # the rows
"""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.chaos import online_audit
from benchmarks.chaos.harness import Chaos
from benchmarks.chaos.online_audit import Layout, check
from benchmarks.chaos.online_runs import ROWS
from benchmarks.chaos.scenarios import SCENARIOS

REPO = Path(__file__).resolve().parents[2]


def _layout(**changes) -> Layout:
    """Two windows over three segments, both trained and promoted, a fourth segment waiting; v0
    registered, w1 and w2 promoted by their retrains, a canary of c1 rolled back."""
    base = dict(
        segments={"s1": (3, 10.0), "s2": (2, 20.0), "s3": (4, 110.0), "s4": (5, 300.0)},
        windows={1: (50.0, ("s1", "s2")), 2: (200.0, ("s3",))},
        done={1: {"feedback_rows": 5, "rows": 5, "promoted_version": "w1"},
              2: {"feedback_rows": 4, "rows": 3, "promoted_version": "w2"}},
        rebuilt_rows={1: 5, 2: 3}, file_rows={1: 5, 2: 3},
        history=[{"seq": 1, "by": "retrain", "from": "v0", "to": "w1"},
                 {"seq": 2, "by": "retrain", "from": "w1", "to": "w2"},
                 {"seq": 3, "by": "canary-rollback", "from": "w2", "to": "w2"}],
        current="w2", committed_versions={"v0", "w1", "w2", "c1"}, candidates={"c1"},
        served=Counter({"v0": 10, "w1": 4, "c1": 2, "w2": 7}))
    return Layout(**{**base, **changes})


def test_the_online_rows_are_registered():
    assert set(ROWS) == {"retrain-trigger-twice", "retrain-kill-mid-run", "serve-restart-canary",
                         "broker-restart-online"}
    assert all(SCENARIOS[name][0] == fault for name, (fault, _) in ROWS.items())


def test_a_clean_layout_passes_and_counts_what_waits():
    a = check(_layout())
    assert a.problems == 0 and (a.trained_twice, a.skipped_rows) == (0, 0), a.line()
    assert a.waiting == 5  # s4 came after the last claim: the next window's, not skipped
    assert (a.windows, a.answers) == (2, 23)
    assert a.line().startswith("online audit: 2 window(s); feedback rows 0 trained twice, 0 skipped, 5 waiting")


def test_a_segment_in_two_windows_is_a_double_count():
    a = check(_layout(windows={1: (50.0, ("s1", "s2")), 2: (200.0, ("s3", "s1"))}))
    assert a.trained_twice == 3 and a.in_two == ["s1 in windows [1, 2]"], a.line()
    # ... and a done record claiming more feedback rows than its segments hold
    b = check(_layout(done={1: {"feedback_rows": 7, "rows": 5}, 2: {"feedback_rows": 4, "rows": 3}}))
    assert b.trained_twice == 2 and b.miscounted == ["window 1 says 7 feedback rows, its segments hold 5"]


def test_a_segment_no_window_took_is_skipped():
    a = check(_layout(windows={1: (50.0, ("s1",)), 2: (200.0, ("s3",))},
                      done={1: {"feedback_rows": 3, "rows": 3}, 2: {"feedback_rows": 4, "rows": 3}},
                      rebuilt_rows={1: 3, 2: 3}, file_rows={1: 3, 2: 3}))
    assert a.skipped_rows == 2 and a.skipped[0].startswith("s2 (2 feedback rows) is in no window"), a.line()
    assert a.waiting == 5 and a.trained_twice == 0
    # A segment committed within a second of the last claim may have missed its listing: it waits.
    late = check(_layout(segments={"s1": (3, 10.0), "s2": (2, 20.0), "s3": (4, 110.0), "s4": (5, 199.5)}))
    assert late.skipped_rows == 0 and late.waiting == 5
    # A done record short of its segments' rows skipped some of them.
    short = check(_layout(done={1: {"feedback_rows": 4, "rows": 5, "promoted_version": "w1"},
                                2: {"feedback_rows": 4, "rows": 3, "promoted_version": "w2"}}))
    assert short.skipped_rows == 1 and short.problems == 1, short.line()


def test_trained_rows_must_match_the_segments_and_the_file():
    a = check(_layout(rebuilt_rows={1: 5, 2: 4}, file_rows={1: 6, 2: 3}))
    assert sorted(a.miscounted) == ["window 1 trained 5 rows, 6 in the file its run trained on",
                                    "window 2 trained 3 rows, 4 rebuilt from its segments"], a.line()


def test_current_and_serve_only_name_promoted_versions():
    a = check(_layout(committed_versions={"v0", "w1", "c1"},  # w2's folder never committed
                      history=[{"seq": 1, "by": "retrain", "from": "v0", "to": "w1"},
                               {"seq": 2, "by": "retrain", "from": "w1", "to": "w2"},
                               {"seq": 3, "by": "canary", "from": "w2", "to": "c1"},  # no promote outcome
                               {"seq": 4, "by": "canary-rollback", "from": "c1", "to": "w1"}],
                      served=Counter({"v0": 1, "x9": 2})))
    assert a.unpromoted == ["w2: CURRENT named it, no committed version folder",
                            "history 3: canary moved CURRENT to c1 without a promote outcome",
                            "history 4: a rollback record moved CURRENT c1 -> w1"], a.line()
    assert a.unserved == ["2 answer(s) from x9"]
    ok = check(_layout(history=[{"seq": 1, "by": "canary", "from": "v0", "to": "c1"}], current="c1",
                       promoted_by_canary={"c1"}, done={}, windows={}, served=Counter({"c1": 1})))
    assert ok.unpromoted == [] and ok.unserved == []
    unproven = check(_layout(done={1: {"feedback_rows": 5, "rows": 5}, 2: {"feedback_rows": 4, "rows": 3}}))
    assert [u.split(":")[0] for u in unproven.unpromoted] == ["history 1", "history 2"]


def test_docstring_examples():
    assert doctest.testmod(online_audit).failed == 0


def test_an_unknown_failpoint_is_refused_in_one_line():
    env = {"RLMILL_FAILPOINT": "after-lunch:update:1", "RLMILL_FAILPOINT_MARKER": "/nonexistent/m",
           "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.chaos.online_runs", "retrain", "--model", "arith"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().startswith("failpoint 'after-lunch:update:1' is not"), r.stderr


# ------------------------------------------------------------------------------------ the rows
@pytest.fixture
def chaos(tmp_path) -> Chaos:
    """The rows' harness on the session's Prefect API (tests/conftest.py starts one)."""
    return Chaos(tmp_path, api_url=os.environ.get("PREFECT_API_URL", ""))


def _run(name: str, chaos: Chaos):
    fault, fn = ROWS[name]
    row = fn(chaos, fault)
    assert row.recovered and row.data_lost == 0, row.outcome
    assert "feedback rows 0 trained twice, 0 skipped" in row.outcome, row.outcome
    return row


@pytest.mark.e2e
def test_retrain_triggered_twice_trains_the_window_once(chaos):
    row = _run("retrain-trigger-twice", chaos)
    assert "1 window(s), 1 done, runs ['retrain-arith-w1'], 1 retrain promotion(s)" in row.outcome, row.outcome
    assert "B (exit 0): in progress" in row.outcome and "C after A (exit 0): nothing new" in row.outcome


@pytest.mark.e2e
def test_retrain_killed_mid_run_resumes_the_same_window(chaos):
    row = _run("retrain-kill-mid-run", chaos)
    assert "the same window, run id and segments" in row.outcome and "run audit: intact" in row.outcome, row.outcome


@pytest.mark.e2e
def test_serve_restarted_during_a_canary_keeps_split_and_counts(chaos):
    row = _run("serve-restart-canary", chaos)
    assert "canary unchanged" in row.outcome and "0 user(s) answered by neither arm" in row.outcome, row.outcome


@pytest.mark.e2e
def test_broker_restarted_while_users_rate_a_canary(chaos):
    row = _run("broker-restart-online", chaos)
    assert "0 missing" in row.outcome and "0 committed twice" in row.outcome, row.outcome

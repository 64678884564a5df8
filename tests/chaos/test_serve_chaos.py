"""Serving chaos rows (benchmarks/chaos/serve_runs.py): the consumer's failpoint wrapper refuses
what it does not know, the audit's arithmetic, and (e2e) one whole row: real redis-server, serve
and consumer processes, the consumer SIGKILLed with a segment's files written and its manifest not.

    .venv/bin/python -m pytest -q tests/chaos/test_serve_chaos.py            # the quick ones
    .venv/bin/python -m pytest -q tests/chaos/test_serve_chaos.py -m e2e     # the row (~30-60 s)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.chaos.harness import Chaos
from benchmarks.chaos.scenarios import SCENARIOS
from benchmarks.chaos.serve_runs import BEFORE_COMMIT, ROWS, AnswerAudit, consumer_kill

REPO = Path(__file__).resolve().parents[2]


def test_the_serving_rows_are_registered():
    assert set(ROWS) <= set(SCENARIOS)
    assert all(SCENARIOS[name][0] == fault for name, (fault, _) in ROWS.items())


def test_an_unknown_consumer_failpoint_is_refused_in_one_line():
    env = {"RLMILL_SERVE_FAILPOINT": "feedback:sometime", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.chaos.serve_runs", "consume", "--root", "x"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == (
        f"RLMILL_SERVE_FAILPOINT='feedback:sometime' is not known here; known: {BEFORE_COMMIT}"), r.stderr


def test_missing_answers_are_lost_only_past_the_drop_count():
    counted = AnswerAudit(answered=10, committed=7, missing=["a", "b", "c"], dropped=3)
    assert counted.lost == 0 and counted.data_lost == 0
    short = AnswerAudit(answered=10, committed=7, missing=["a", "b", "c"], dropped=1)
    assert short.lost == 2 and "3 missing (serve's drop count 1)" in short.line()
    twice = AnswerAudit(answered=2, committed=2, duplicated=["evt-1"])
    assert twice.data_lost == 1 and "1 committed twice" in twice.line()


@pytest.mark.e2e
def test_consumer_killed_between_segment_files_and_manifest(tmp_path):
    row = consumer_kill(Chaos(tmp_path, api_url=""), "consumer SIGKILLed mid-segment", BEFORE_COMMIT,
                        before=10, after=10, concurrency=2)
    assert row.recovered and row.data_lost == 0, row.outcome
    assert "exit -9" in row.outcome and "0 missing" in row.outcome and "0 committed twice" in row.outcome
    assert re.search(r", [1-9]\d* segment file\(s\) without a manifest", row.outcome), row.outcome  # written,
    # never published: invisible to readers

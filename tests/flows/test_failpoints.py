"""flows/failpoints.py: the named moments after a run's last commit where tests hold a run to kill it.

    .venv/bin/python -m pytest -q tests/flows/test_failpoints.py

The kills themselves (each moment, then a resume that must finish and commit nothing) are the
chaos scenario `kill-after-last-commit` (tests/chaos) and tests/deployments/test_auto_resume.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.failpoints import POINTS, reach

REPO = Path(__file__).resolve().parents[2]


def test_an_unknown_point_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown failpoint 'run:reprot'.*run:report"):
        reach("run:reprot")


def test_unarmed_or_already_hit_points_pass_straight_through(monkeypatch, tmp_path):
    monkeypatch.delenv("RLMILL_FAILPOINT", raising=False)
    for point in POINTS:
        reach(point)
    marker = tmp_path / "hit"
    marker.write_text("1")
    monkeypatch.setenv("RLMILL_FAILPOINT", "run:report")
    monkeypatch.setenv("RLMILL_FAILPOINT_MARKER", str(marker))
    reach("run:report")  # the marker exists: the resumed run goes on
    reach("run:return")  # another point than the armed one


def test_an_armed_point_without_a_marker_says_what_is_missing(monkeypatch):
    monkeypatch.setenv("RLMILL_FAILPOINT", "run:return")
    monkeypatch.delenv("RLMILL_FAILPOINT_MARKER", raising=False)
    with pytest.raises(RuntimeError, match="needs RLMILL_FAILPOINT_MARKER"):
        reach("run:return")


def test_an_armed_point_writes_its_pid_and_holds_until_killed(tmp_path):
    marker = tmp_path / "hit"
    env = {**os.environ, "RLMILL_FAILPOINT": "run:completed", "RLMILL_FAILPOINT_MARKER": str(marker),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", "from flows.failpoints import reach; reach('run:completed'); "
                             "print('passed')"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120  # a bare interpreter start: seconds even on busy cores
        while not marker.exists():
            assert proc.poll() is None, f"exited ({proc.returncode}) before holding: {proc.stdout.read()}"
            assert time.monotonic() < deadline, "the armed point was not reached within 120 s"
            time.sleep(0.05)
        while not marker.read_text():  # written, not just created
            time.sleep(0.01)
        assert int(marker.read_text()) == proc.pid
        assert proc.poll() is None  # holding
    finally:
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
    assert proc.returncode == -signal.SIGKILL and "passed" not in out

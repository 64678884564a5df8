"""benchmarks/online_demo.py: the retrain's rewards by hand, the settings' one-line refusals, the
table and summary, and (e2e) a shortened loop: 2 cycles, tiny sizes, the second one planted bad.

    .venv/bin/python -m pytest -q tests/bench/test_online_demo.py            # the fast ones
    .venv/bin/python -m pytest -q -m e2e tests/bench/test_online_demo.py     # the loop (minutes)
"""

from __future__ import annotations

import doctest
import subprocess
import sys

import pytest

from benchmarks import online_demo as demo
from tests.tiny import REPO


def test_rewards_by_hand():
    held_out = ("rlmill/arith", "46", "46", {"split": "test"})
    assert demo.demo_reward(*held_out) == 1.0 and demo.demo_reward("rlmill/arith", "47", "46") == 0.0
    liked = {"reward": 0.75}  # the users' mean score of the rated answer "46"
    fb = "rlmill/feedback/demo"
    assert demo.demo_reward(fb, " 46", "46", liked) == 0.75  # reproduces the rated answer: its score
    assert demo.demo_reward(fb, "45", "46", liked) == 0.0  # anything else: nothing known, 0
    assert demo.demo_reward(fb, "46", "46", {"reward": None}) == 0.0  # rated without a score
    assert demo.demo_reward(fb, "46", "46", None) == 0.0
    # The planted bug: flipped everywhere (the gate's rows too), or on the feedback rows only.
    assert demo.flipped_everywhere(*held_out) == 0.0 and demo.flipped_everywhere(fb, "46", "46", liked) == 0.25
    assert demo.flipped_feedback(*held_out) == 1.0 and demo.flipped_feedback(fb, "45", "46", liked) == 1.0


def test_settings_table_and_summary():
    assert doctest.testmod(demo).failed == 0
    assert demo.DemoConfig().problem() is None
    assert demo.DemoConfig(bad_cycle=6).problem() == "--bad-cycle 6 is not a cycle of 1..5 (0: no bad candidate)"
    assert demo.DemoConfig(bad_reward="nope").problem() == ("--bad-reward 'nope': give one of flipped_everywhere, "
                                                            "flipped_feedback")
    assert demo.DemoConfig(lr=0.0).problem() == "--lr 0: give a positive number"
    assert demo.DemoConfig().bad == "flipped_everywhere" and demo.DemoConfig(canary_share=0).bad == "flipped_feedback"
    rows = [demo.CycleRow(1, "v0", 0.1, candidate="w1", decision="promote", to_serving_s=40.0, to_promoted_s=60.0),
            demo.CycleRow(2, "w1", 0.3, planted_bad=True, candidate="w2", decision="rollback", to_serving_s=30.0),
            demo.CycleRow(3, "w1", 0.35, planted_bad=True, candidate="w3", decision="promote", to_serving_s=20.0)]
    s = demo.summary(rows)
    assert (s["median_to_serving_s"], s["median_to_promoted_s"]) == (30.0, 60.0)
    assert s["live_reward"] == [0.1, 0.3, 0.35] and s["bad_caught"] == [True, False]
    table = demo.cycle_table(rows).splitlines()
    assert len(table) == 5 and "rollback (planted bad: caught)" in table[3] and "NOT caught" in table[4]


def test_wrong_settings_are_one_line_before_any_work():
    r = subprocess.run([sys.executable, "-m", "benchmarks.online_demo", "--cycles", "2", "--bad-cycle", "3"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == "rlmill: --bad-cycle 3 is not a cycle of 1..2 (0: no bad candidate)\n"


@pytest.mark.e2e  # two retrain cycles with a canary through real serve and redis: minutes on 2 busy cores
def test_two_cycles_with_a_planted_bad_candidate(tmp_path):
    from storage import ModelLayout
    from gpu_jobs.online.canary import read_canary

    # 4 passes at 3e-4 over the 32-row window: the flipped candidate is far worse live (a weaker
    # one, 2 passes at 1e-4, once passed a 0.05 margin on 16 samples); margin 0.02 makes the test strict.
    # 24 users: each canary's random id splits them, and with 8 all landed on the baseline once in CI
    # (2**-8 per canary; 2**-24 now), leaving the candidate no traffic to be judged on.
    cfg = demo.DemoConfig(cycles=2, bad_cycle=2, requests=32, users=24, pool=16, canary_requests=48,
                          canary_rounds=3, min_samples=16, margin=0.02, epochs=4, lr=3e-4, eval_size=32,
                          work=str(tmp_path / "work"))
    lines: list[str] = []
    rows = demo.run_demo(cfg, out=lines.append)
    assert [r.cycle for r in rows] == [1, 2] and [r.planted_bad for r in rows] == [False, True]
    models = ModelLayout(str(tmp_path / "work" / "root"), demo.MODEL)
    assert read_canary(models) is None  # every canary was decided (or rolled back by the demo)
    for r in rows:
        assert r.candidate == f"retrain-demo-w{r.cycle}" and r.gate.startswith(("pass", "refuse"))
        kept = r.decision in ("rollback", "undecided", "refused")
        assert r.serving == (r.baseline if kept else r.candidate), r  # serve answers with what was decided
        if r.decision in ("promote", "rollback", "undecided"):  # a canary ran: both arms got rated traffic
            assert r.to_serving_s is not None and r.n_baseline > 0 and r.n_candidate > 0
    assert rows[1].baseline == rows[0].serving  # cycle 2 starts from what cycle 1 left serving
    assert rows[1].caught, rows[1]  # the sign-flipped candidate never became CURRENT
    assert models.current_version() == rows[1].serving
    assert any(line.startswith("| cycle |") for line in lines) and lines[-1].startswith('{"median_to_serving_s"')

"""The one-node CPU launcher (gpu_jobs.train.ranks.forked): when it is chosen, and that it stops
the other ranks and reports the failed one the way torchrun does. Groups it starts are exercised
by tests/train/test_group.py and every other two-rank test (two nodes: torchrun).

    .venv/bin/python -m pytest -q tests/train/test_forked_launcher.py
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpu_jobs.train.ranks.failure import exit_codes
from gpu_jobs.train.ranks.launch import NodeLayout, launcher_for
from tests.tiny import REPO


@pytest.mark.parametrize("layout, env, expected", [
    (NodeLayout(2), {"DS_ACCELERATOR": "cpu"}, "fork"),
    (NodeLayout(2), {}, "torchrun"),  # CUDA: no fork after a CUDA probe
    (NodeLayout(2), {"DS_ACCELERATOR": "cpu", "RLMILL_RANK_LAUNCHER": "torchrun"}, "torchrun"),
    (NodeLayout(2), {"RLMILL_RANK_LAUNCHER": "fork"}, "torchrun"),  # cannot be forced onto CUDA
    (NodeLayout(2, 2, "127.0.0.1", 29400), {"DS_ACCELERATOR": "cpu"}, "torchrun"),  # rendezvous across nodes
])
def test_the_fork_launcher_is_chosen_for_one_node_without_cuda(layout, env, expected):
    assert launcher_for(layout, env) == expected


def test_a_bad_launcher_name_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"RLMILL_RANK_LAUNCHER='mpirun': use one of fork, torchrun"):
        launcher_for(NodeLayout(2), {"RLMILL_RANK_LAUNCHER": "mpirun"})
    with pytest.raises(ValueError, match="one node's ranks"):
        NodeLayout(2, 2, "h", 1).command(sys.executable, 0, "none", "/tmp/w", "fork")


def test_fork_command_runs_the_forked_module():
    cmd = NodeLayout(3).command("python", 0, "127.0.0.1:5", "/tmp/w", "fork")
    assert cmd == ["python", "-m", "gpu_jobs.train.ranks.forked", "--nproc-per-node", "3", "--address",
                   "127.0.0.1:5", "--workdir", "/tmp/w"]


# Two forked children: one exits 3, one would sleep a minute. supervise() must return 1 at once,
# stop the sleeper (SIGTERM) and say which rank failed in torchrun's words.
SUPERVISE = """
import os, sys, time
from gpu_jobs.train.ranks.forked import supervise
children = {}
for rank, body in ((0, "time.sleep(60); os._exit(0)"), (1, "os._exit(3)")):
    pid = os.fork()
    if pid == 0:
        exec(body)
    children[pid] = rank
sleeper = [p for p, r in children.items() if r == 0][0]
t0 = time.monotonic()
code = supervise(children)
print("RESULT", code, sleeper, [p for p, r in children.items()], round(time.monotonic() - t0, 1))
"""


def test_supervise_stops_the_other_ranks_and_names_the_failed_one():
    proc = subprocess.run([sys.executable, "-c", SUPERVISE], cwd=REPO, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    _, code, sleeper, left, _ = line.split(" ", 4)
    assert code == "1" and left == "[]", out  # every rank reaped, the sleeper among them
    failed = next(ln for ln in out.splitlines() if "rank 1 failed" in ln)
    codes = exit_codes(failed)
    assert list(codes.values()) == [3] and int(sleeper) not in codes, failed

"""Chaos scenarios for asynchronous RL (async_training.staleness_threshold=1, one-step-off): the
rollout of k+1 samples with the weights after update k-1 while update k trains. A SIGKILL while
both are in flight, or at a random moment, then a resume, must end with the weights of an
uninterrupted async run with the same threshold, and every rollout used exactly once, with the
weights the schedule names (audit.rollout_lineage).

    .venv/bin/python -m benchmarks.chaos --only async-kill-in-flight,async-kill-random
    RLMILL_CHAOS_SEED=7 .venv/bin/python -m benchmarks.chaos --only async-kill-random   # replay one draw
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from .audit import audit, snapshot
from .harness import ITERATIONS, REPO, Chaos, Outcome, layout
from .scenarios import SCENARIOS, _result, _tail, scenario

THRESHOLD = 1
ASYNC = (f"async_training.staleness_threshold={THRESHOLD}", "actor.recompute_old_logprobs=true",
         "algorithm.rollout_correction.rollout_is=token")


def _resume_and_audit(chaos: Chaos, name: str, root: str, before: dict, what: str) -> Outcome:
    lay = layout(root, "r")
    done = chaos.finish(root, "r", *ASYNC)
    report = audit(lay, before, ITERATIONS, staleness_threshold=THRESHOLD)
    ok = done.returncode == 0
    outcome = f"{what}; resumed and completed" if ok else f"{what}; resume failed: {_tail(done.stdout)}"
    return _result(SCENARIOS[name][0], outcome, ok, report,
                   chaos.same_as_reference(root, "r", extra=ASYNC) if ok else "-")


@scenario("async-kill-in-flight", "async s=1: SIGKILL while update 2 (trained, in memory) and the stale rollout "
                                  "of 3 (generated) are both in flight, then resume")
def async_kill_in_flight(chaos: Chaos) -> Outcome:
    root = str(chaos.work / "async-kill-in-flight")
    chaos.kill_at(root, "r", "in-flight:update:2", extra=ASYNC)
    before = snapshot(layout(root, "r"))
    return _resume_and_audit(chaos, "async-kill-in-flight", root, before,
                             f"killed with update 2 and rollout 3 in flight ({len(before)} manifests committed)")


def _manifest_times(root: str) -> list[float]:
    return sorted(p.stat().st_mtime for p in Path(root).rglob("_MANIFEST.json"))


def _kill_after(chaos: Chaos, root: str, delay_s: float) -> int:
    """Start the async run; once its first manifest is committed (setup over), wait `delay_s` and
    SIGKILL its process group. Returns how many manifests were committed at the kill."""
    proc = subprocess.Popen(chaos.cmd(root, "r", *ASYNC), cwd=REPO, env=chaos.env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + chaos.timeout
        while not _manifest_times(root):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the async run ended ({proc.returncode}) or stalled before its first commit")
            time.sleep(0.05)
        time.sleep(delay_s)
        if proc.poll() is not None:
            raise RuntimeError(f"the async run finished ({proc.returncode}) before the kill at +{delay_s:.1f} s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return len(_manifest_times(root))


@scenario("async-kill-random", "async s=1: SIGKILL at a random moment of the run (seeded, RLMILL_CHAOS_SEED), "
                               "then resume")
def async_kill_random(chaos: Chaos) -> Outcome:
    """The moment is drawn uniformly over the span the uninterrupted async run spent between its
    first and last commit (read from its manifests' times), so it lands inside the training."""
    seed = int(os.environ.get("RLMILL_CHAOS_SEED", time.time_ns() % 10**6))
    times = _manifest_times(chaos.reference_root(ASYNC))
    delay = random.Random(seed).uniform(0.0, 0.9 * (times[-1] - times[0]))
    root = str(chaos.work / "async-kill-random")
    n = _kill_after(chaos, root, delay)
    before = snapshot(layout(root, "r"))
    return _resume_and_audit(chaos, "async-kill-random", root, before,
                             f"seed {seed}: killed {delay:.1f} s after the first commit ({n} manifests committed)")

"""Named moments of a run outside its stages (its setup, and after its last commit), where a test
or the chaos harness holds the process so it can be killed or signalled exactly there.

    RLMILL_FAILPOINT=run:report RLMILL_FAILPOINT_MARKER=/tmp/m rlmill train --config examples/grpo_arith.yaml

Stage boundaries are armed from outside by benchmarks/chaos/failpoints.py (it wraps the commit
shell). The moments here have no stage to wrap: the setup before the first iteration, the final validation, the report, the flow's
return and the flow run's final state are the flow's own code, and a deployment run loads that
code from its entrypoint, where a wrapper installed from outside may not reach it. So the flow
calls `reach(point)` at each; unarmed, that is one environment lookup.

An armed point writes the process id to the marker file, then holds (sleeps) until the process
is killed, for at most an hour. A process started after the marker exists runs unarmed: the
resumed run of a killed one passes the same point freely.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["AFTER_LAST_COMMIT", "POINTS", "hold", "reach"]

POINTS = {
    "run:setup": "the run's engines loaded and its progress read; no iteration of this process started",
    "run:final-validation": "every iteration committed; the final validation not yet read",
    "run:report": "the final validation read; the curves and the final artifact not yet written",
    "run:return": "the report written; the flow function not yet returned",
    "run:completed": "the flow run's Completed state stored by the API; the process not yet exited",
}
# The moments after a run's last commit, in the order a run reaches them: a run killed at any of
# them has nothing left to compute (the chaos scenario kill-after-last-commit walks them).
AFTER_LAST_COMMIT = ("run:final-validation", "run:report", "run:return", "run:completed")
HOLD_S = 3600.0


def hold(marker: str) -> None:
    """Write this pid to `marker`, then sleep until killed (or, with RLMILL_FAILPOINT_RELEASE set,
    until that file exists), at most HOLD_S."""
    Path(marker).write_text(str(os.getpid()))
    release, deadline = os.environ.get("RLMILL_FAILPOINT_RELEASE"), time.monotonic() + HOLD_S
    while time.monotonic() < deadline and not (release and os.path.exists(release)):
        time.sleep(0.1)


def reach(point: str) -> None:
    """Hold here if RLMILL_FAILPOINT names `point` and its marker does not exist yet."""
    if point not in POINTS:  # a typo in the caller would make a test wait for nothing
        raise ValueError(f"unknown failpoint {point!r}; known: {sorted(POINTS)}")
    if os.environ.get("RLMILL_FAILPOINT") != point:
        return
    marker = os.environ.get("RLMILL_FAILPOINT_MARKER")
    if not marker:
        raise RuntimeError(f"RLMILL_FAILPOINT={point} needs RLMILL_FAILPOINT_MARKER (the file to touch when it is hit)")
    if not os.path.exists(marker):
        hold(marker)

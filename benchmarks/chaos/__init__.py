"""`make chaos`: faults injected into real rlmill runs, each checked for "completes, and nothing
committed is lost or duplicated" (issue 7). See __main__.py for the command, scenarios.py for the
faults, failpoints.py for how a run is killed at an exact point, audit.py for what is checked."""

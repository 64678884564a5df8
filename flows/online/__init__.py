"""The online loop's flows: feedback is drained into committed segments, enough of it starts a
retraining run on exactly the new window, and a candidate that passes the held-out gate is promoted
or served to a share of live users until a stated test decides. The work they call is
gpu_jobs/online/ (serving, events, windows, canaries); the held-out gate is the nightly's
(flows.nightly.train_and_gate).

- feedback.py: rl-feedback/consume, the consumer as a deployment; announces a ready window.
- retrain.py: rl-retrain/on-feedback, one feedback window trained, gated, promoted or canaried.
- replay.py: older windows' and cold-start rows mixed into a window's training rows.
- canary.py: rl-canary/decide, a running canary promoted or rolled back on its arms' feedback.
- retention.py: rl-retention/daily, raw feedback, quarantine and dead letters older than the retention removed.
"""


def run_for_cli(flow, **kwargs):
    """`flow(**kwargs)`'s own return value, for a module's command line; a failed run ends in
    SystemExit with its one `rlmill:` line (the message of what failed it), never a traceback.

    Not `return_state=True` and `state.result()`: that state is the one the Prefect API answered
    with, and once (CI, 2026-12-05) it came back Completed without its data (prefect's
    MissingResult, a traceback after a retraining that had finished)."""
    try:
        return flow(**kwargs)
    except Exception as exc:  # noqa: BLE001 - a failed flow run raises what failed it
        raise SystemExit(f"rlmill: {' '.join(str(exc).split()) or type(exc).__name__}") from None

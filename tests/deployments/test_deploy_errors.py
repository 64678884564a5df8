"""A deployment run that fails because of its input says why in one line, with the fix: as its
state message (what the UI shows) and as an `rlmill:` log line (what `prefect deployment run
--watch` and the UI's log tab show). An unexpected error shows one summary line carrying its
traceback, once. Uses the real server/worker of conftest.

The log lines are read from the API once the run's process exited (tools.logs_after_exit), not
from a `--watch` console: `--watch` shows the logs the API stored, and its own websocket can fail
to connect on busy cores ("keepalive ping timeout"), which is not what these tests are about.
The line reaches the API before the run's final state (flows.reporting.deliver_logged_line), so
`--watch`, which listens until 3 s after that state, shows it; the README walkthrough runs
`--watch` as the README shows it.

    .venv/bin/python -m pytest -q tests/deployments/test_deploy_errors.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from uuid import UUID

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.prefect]
RUN_TIMEOUT_S = 420


def _frozen_run(root: Path, run_id: str, *overrides: str) -> None:
    """run.json of a run made with another config (what the README's own `rlmill train` leaves)."""
    from flows.config import frozen_config, load_run_config
    from storage import RunLayout

    cfg = load_run_config("examples/grpo_arith.yaml", [f"root={root}", f"run_id={run_id}", *overrides])
    RunLayout(cfg.root, cfg.run_id).write_run_json({"run_uid": "u", "config": frozen_config(cfg)})


def _failed_run(tools, api, worker_log: Path, flow_run_id: str):
    """(its final state, every message it logged) once its process exited."""
    state = tools.wait_final(api, flow_run_id, RUN_TIMEOUT_S, worker_log).state
    return state, tools.logs_after_exit(api, flow_run_id, worker_log, RUN_TIMEOUT_S)


def test_failed_deployment_runs_say_why_in_one_line(prefect_worker, api, tools, tmp_path):
    root = tmp_path / "root"
    _frozen_run(root, "taken", *tools.tiny, "rollout.n=2")
    missing = tmp_path / "nope" / "train.parquet"
    cases = {  # name -> (parameters, what the one line must say)
        "reused run id": ({"iterations": 1, "run_id": "taken", "overrides": [f"root={root}", *tools.tiny]},
                          ["run 'taken' already exists", "(rollout.n)", "another run_id"]),
        "bad key": ({"overrides": [f"root={root}", "rollout.nn=4"]},
                    ["invalid run config: rollout.nn: unknown key (did you mean rollout.n?"]),
        "missing data": ({"overrides": [f"root={root}", f"data.train_files=[\"{missing}\"]"]},
                         [f"data file {missing} (data.train_files) does not exist", "rlmill data make"]),
    }
    # The worker runs them side by side.
    started = {name: tools.trigger("rl-training/manual", params) for name, (params, _) in cases.items()}
    for name, (_, words) in cases.items():
        state, logs = _failed_run(tools, api, prefect_worker, started[name])
        message = state.message
        # The UI's state message: the reason and the fix, one line, nothing else.
        assert state.is_failed() and "\n" not in message, (name, message)
        assert all(w in message for w in words), (name, message)
        # The log: the same line, logged as `rlmill: ...`, and no traceback.
        assert f"rlmill: {message}" in logs, (name, logs)
        assert not any("Traceback" in m for m in logs), (name, logs)
    assert not (root / "runs" / "taken" / "iterations").exists()  # refused before any work


def test_an_unexpected_error_in_a_deployment_run_shows_one_traceback(prefect_worker, api, tools, tmp_path):
    """Not a mistake rlmill recognises (here: remote placement naming a stage deployment that does
    not exist): one `rlmill: run ... failed:` line carrying the traceback, once -- Prefect's
    engine would log it twice more (as the flow fails, and when the flow run's process exits), the
    first time possibly after `--watch` stopped listening."""
    flow_run_id = tools.trigger("rl-training/manual", {"iterations": 1, "overrides": [
        f"root={tmp_path / 'root'}", *tools.tiny, "trainer.placement=remote", "trainer.checkpoint_every=1",
        "trainer.stage_deployment=rl-stage/no-such-deployment", "tasks.retries=0",  # retried, it fails the same
        "tasks.auto_resumes=0"]})  # resuming it would only fail again, on the session's worker
    state, logs = _failed_run(tools, api, prefect_worker, flow_run_id)
    assert state.is_failed() and state.message.startswith("Flow run encountered an exception:"), state.message
    summaries = [m for m in logs if re.match(r"rlmill: run \S+ failed: .*\(unexpected: the traceback follows\)", m)]
    assert len(summaries) == 1, logs
    # The traceback is on the summary's record (a chained exception prints more than one
    # "Traceback" header in it) and ends with the error the summary names; none of the engine's
    # copies, and no other record with a traceback.
    tb = summaries[0].split("Traceback (most recent call last)", 1)
    assert len(tb) == 2 and "ObjectNotFound" in tb[1], summaries[0]
    assert not any("Encountered exception during execution" in m or "Engine execution exited" in m for m in logs), logs
    assert [m for m in logs if "Traceback (most recent call last)" in m] == summaries, logs


SCRIPT = """
import sys
import flows.training as training

def injected(cfg, logger):
    raise RuntimeError("injected bug")

training._train = injected
from flows.cli import entry
sys.argv = ["rlmill", *sys.argv[1:]]
entry()
"""


def test_an_unexpected_error_shows_its_summary_then_one_traceback(prefect_server, tools, tmp_path):
    """`rlmill train` against the server, with a bug injected into the run: the flow logs one
    summary line carrying the traceback, and the CLI does not print it a second time."""
    env = {**tools.env, "PYTHONPATH": str(tools.repo), "RLMILL_LOCK_DIR": str(tmp_path / "locks")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "train", "--config", "examples/grpo_arith.yaml",
                           f"root={tmp_path / 'root'}", *tools.tiny], cwd=tools.repo, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    summary = re.search(r"rlmill: run (\S+) failed: RuntimeError: injected bug \(unexpected: the traceback follows\)",
                        out)
    assert summary, out[-3000:]
    assert out.count("Traceback (most recent call last)") == 1, out[-4000:]
    assert out.index(summary.group(0)) < out.index("Traceback (most recent call last)")

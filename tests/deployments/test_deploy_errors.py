"""A deployment run that fails because of its input says why in one line, with the fix: as its
state message (what the UI shows) and in `prefect deployment run --watch`. An unexpected error
shows one summary line, then its traceback, once. Uses the real server/worker of conftest.

    .venv/bin/python -m pytest -q tests/deployments/test_deploy_errors.py
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from uuid import UUID

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.prefect]
WATCH_TIMEOUT_S = 420


def _frozen_run(root: Path, run_id: str, *overrides: str) -> None:
    """run.json of a run made with another config (what the README's own `rlmill train` leaves)."""
    from flows.config import frozen_config, load_run_config
    from storage import RunLayout

    cfg = load_run_config("examples/grpo_arith.yaml", [f"root={root}", f"run_id={run_id}", *overrides])
    RunLayout(cfg.root, cfg.run_id).write_run_json({"run_uid": "u", "config": frozen_config(cfg)})


def _watch(tools, params: dict) -> subprocess.Popen:
    args = [str(tools.venv_bin / "prefect"), "deployment", "run", "rl-training/manual", "--watch"]
    for k, v in params.items():
        args += ["-p", f"{k}={json.dumps(v)}"]
    # A wide console: rich wraps --watch lines at the terminal width (80 columns without a terminal).
    return subprocess.Popen(args, cwd=tools.repo, env={**tools.env, "COLUMNS": "1000"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_failed_deployment_runs_say_why_in_one_line(prefect_worker, api, tools, tmp_path):
    root = tmp_path / "root"
    _frozen_run(root, "taken", *tools.tiny, "rollout.n=2")
    missing = tmp_path / "nope" / "train.parquet"
    cases = {  # name -> (parameters, what the one line must say)
        "reused run id": ({"iterations": 1, "run_id": "taken", "overrides": [f"root={root}", *tools.tiny]},
                          ["run 'taken' already exists", "(rollout.n)", "another run_id"]),
        "bad key": ({"overrides": [f"root={root}", "rollout.nn=4"]},
                    ["invalid run config: rollout.nn: unknown key (did you mean rollout.n?"]),
        # (quoted: `prefect deployment run` prints the parameters as rich markup, where [/x] is a tag)
        "missing data": ({"overrides": [f"root={root}", f"data.train_files={json.dumps([str(missing)])}"]},
                         [f"data file {missing} (data.train_files) does not exist", "rlmill data make"]),
    }
    procs = {name: _watch(tools, params) for name, (params, _) in cases.items()}  # the worker runs them side by side
    outs = {}
    try:
        for name, proc in procs.items():
            outs[name] = proc.communicate(timeout=WATCH_TIMEOUT_S)[0]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for name, (_, words) in cases.items():
        out, proc = outs[name], procs[name]
        assert proc.returncode == 1 and "Flow run finished in state 'Failed'" in out, out[-3000:]
        flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
        run = api(lambda c: c.read_flow_run(UUID(flow_run_id)))
        message = run.state.message
        # The UI's state message: the reason and the fix, one line, nothing else.
        assert run.state.is_failed() and "\n" not in message, message
        assert all(w in message for w in words), (name, message)
        # --watch: the same line, logged as `rlmill: ...`, and no traceback.
        assert f"rlmill: {message}" in " ".join(out.split()), out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    assert not (root / "runs" / "taken" / "iterations").exists()  # refused before any work


def test_an_unexpected_error_in_a_deployment_run_shows_one_traceback(prefect_worker, api, tools, tmp_path):
    """Not a mistake rlmill recognises (here: remote placement naming a stage deployment that does
    not exist): one `rlmill: run ... failed:` line carrying the traceback, once -- Prefect's
    engine would log it twice more (as the flow fails, and when the flow run's process exits), the
    first time possibly after `--watch` stopped listening."""
    proc = _watch(tools, {"iterations": 1, "overrides": [
        f"root={tmp_path / 'root'}", *tools.tiny, "trainer.placement=remote", "trainer.checkpoint_every=1",
        "trainer.stage_deployment=rl-stage/no-such-deployment",
        "tasks.auto_resumes=0"]})  # resuming it would only fail again, on the session's worker
    try:
        out = proc.communicate(timeout=WATCH_TIMEOUT_S)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "Flow run finished in state 'Failed'" in out, out[-3000:]
    summary = re.search(r"rlmill: run \S+ failed: .*\(unexpected: the traceback follows\)", out)
    assert summary and out.count("(unexpected: the traceback follows)") == 1, out[-4000:]
    # The traceback is on the summary's record (a chained exception prints more than one
    # "Traceback" header in it), and it ends with the error the summary names; none of the
    # engine's copies.
    assert "Encountered exception during execution" not in out, out[-6000:]
    assert "Engine execution exited with unexpected exception" not in out, out[-6000:]
    after = out[out.index(summary.group(0)):]
    assert "Traceback (most recent call last)" in after and "ObjectNotFound" in after.split("Traceback", 1)[1], out[-6000:]
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
    state = api(lambda c: c.read_flow_run(UUID(flow_run_id))).state
    assert state.is_failed() and state.message.startswith("Flow run encountered an exception:"), state.message


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
    summary line, Prefect logs the traceback, and the CLI does not print it a second time."""
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

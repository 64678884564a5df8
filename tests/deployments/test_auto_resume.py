"""A deployment run whose process dies is resumed automatically, with the same run_id, from its
commits (deployments/resume.py and its automations in deployments/prefect.yaml), against the
session's real server and process worker (see conftest).

    .venv/bin/python -m pytest -q tests/deployments/test_auto_resume.py
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from uuid import UUID

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

TIMEOUT_S = 600  # a tiny run through the worker is 1-3 min on busy cores; a wait covers at most two runs


def _wait(what: str, ok, timeout: float, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while not (value := ok()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:.0f} s\n{log.read_text()[-4000:] if log else ''}")
        time.sleep(1)
    return value


def _trigger_held(tools, root: Path, point: str, marker: Path) -> str:
    """A tiny run (fresh run id) whose process holds at `point` (flows/failpoints.py) until killed.
    The failpoint travels as a job variable; the deployment's own env (heartbeats) is repeated
    because a run's `env` replaces the deployment's. Its resume is created without it."""
    env = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30", "RLMILL_FAILPOINT": point,
           "RLMILL_FAILPOINT_MARKER": str(marker)}
    params = {"iterations": 1, "overrides": [f"root={root}", *tools.tiny, "tasks.auto_resumes=2",
                                             "tasks.auto_resume_delay_seconds=1"]}
    return tools.trigger("rl-training/manual", params, job_variables={"env": env})


def test_runs_killed_after_their_last_commit_end_completed_without_recomputing(prefect_worker, api, tools,
                                                                               tmp_path):
    """Two runs side by side, each SIGKILLed (as the OOM killer would: no handler runs) at a named
    moment after its last commit: at the flow's return, the run is Crashed and the automation
    resumes it with the same run_id to Completed, committing nothing; after its Completed state
    was stored, it stays Completed and is not resumed."""
    from prefect.client.schemas import filters as F

    runs = {}
    for point in ("run:return", "run:completed"):
        root, marker = tmp_path / point.split(":")[1], tmp_path / f"{point.split(':')[1]}.held"
        runs[point] = (root, marker, _trigger_held(tools, root, point, marker))
    for point, (root, marker, _) in runs.items():
        _wait(f"the run held at {point}", lambda m=marker: m.exists() and m.read_text(), TIMEOUT_S, prefect_worker)
    manifests = {}
    for point, (root, marker, _) in reversed(runs.items()):  # (2) below relies on this order
        manifests[point] = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in root.glob("runs/*/**/_MANIFEST.json")}
        assert manifests[point], f"{point}: nothing committed before the kill"
        os.kill(int(marker.read_text()), signal.SIGKILL)

    def resumes_of(flow_run_id):
        return api(lambda c: c.read_flow_runs(flow_run_filter=F.FlowRunFilter(
            tags=F.FlowRunFilterTags(all_=[f"resume-of:{flow_run_id}"]))))

    # (1) killed at the flow's return: Crashed (the worker saw its process die), then resumed.
    root, _, flow_run_id = runs["run:return"]
    resumed = _wait("a finished automatic resume of the run killed at its return",
                    lambda: (r := resumes_of(flow_run_id)) and all(x.state and x.state.is_final() for x in r) and r,
                    TIMEOUT_S, prefect_worker)
    first = api(lambda c: c.read_flow_run(UUID(flow_run_id)))
    assert first.state_type.value == "CRASHED", first.state
    (again,) = resumed
    (run_dir,) = (root / "runs").iterdir()  # the same run went on, no new one
    assert again.state_type.value == "COMPLETED", (again.name, again.state)
    assert again.name == f"{first.name} (auto-resume 1/2)"
    assert again.parameters["run_id"] == run_dir.name and f"run:{run_dir.name}" in first.tags
    assert {"auto-resume", f"run:{run_dir.name}", f"resumes:{flow_run_id}"} <= set(again.tags)
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in root.glob("runs/*/**/_MANIFEST.json")}
    assert after == manifests["run:return"]  # every manifest kept as it was, none added: nothing recomputed

    # (2) killed after its Completed state was stored: the worker's report of the dead process does
    # not turn it Crashed, so no automation fires. Its kill came before run (1)'s, whose resume has
    # since been decided and run: a resume of this one would have been created by now.
    root, _, flow_run_id = runs["run:completed"]
    done = api(lambda c: c.read_flow_run(UUID(flow_run_id)))
    assert done.state_type.value == "COMPLETED", done.state
    assert not resumes_of(flow_run_id)
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in root.glob("runs/*/**/_MANIFEST.json")}
    assert after == manifests["run:completed"]


def test_a_run_failed_by_its_input_is_not_resumed(prefect_worker, api, tools, tmp_path):
    """rl-training tags it `input-error`; rl-resume, started by the automation, leaves it."""
    from prefect.client.schemas import filters as F

    flow_run_id = tools.trigger("rl-training/manual", {"iterations": 1, "overrides": [
        f"root={tmp_path / 'root'}", *tools.tiny, "rollout.n=many"]})
    failed = tools.wait_final(api, flow_run_id, TIMEOUT_S, prefect_worker)
    assert failed.state_type.value == "FAILED" and "input-error" in failed.tags, (failed.state, failed.tags)
    auto = api(lambda c: c.read_deployment_by_name("rl-resume/auto"))

    def decided():
        runs = api(lambda c: c.read_flow_runs(deployment_filter=F.DeploymentFilter(id=F.DeploymentFilterId(
            any_=[auto.id]))))
        return [r for r in runs if flow_run_id in str(r.parameters.get("flow_run")) and r.state.is_final()]

    (resume,) = _wait("rl-resume's decision on the failed run", decided, TIMEOUT_S, prefect_worker)[:1]
    assert resume.state_type.value == "COMPLETED", resume.state
    assert not api(lambda c: c.read_flow_runs(flow_run_filter=F.FlowRunFilter(
        tags=F.FlowRunFilterTags(all_=[f"resumes:{flow_run_id}"]))))

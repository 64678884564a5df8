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

TIMEOUT_S = 600  # a tiny run through the worker is 1-3 min on busy cores; this is two of them plus the resume


def _flow_run_process(worker_log: Path, flow_run_id: str) -> int | None:
    """The pid of the process running `flow_run_id` (the worker's child carries its id in its environment)."""
    needle = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    return int(entry.name)
            except OSError:
                continue
    return None


def _wait(what: str, ok, timeout: float, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while not (value := ok()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:.0f} s\n{log.read_text()[-4000:] if log else ''}")
        time.sleep(1)
    return value


def test_killed_run_process_is_resumed_with_same_run_id_from_its_commits(prefect_worker, api, tools, tmp_path):
    from prefect.client.schemas import filters as F

    root = tmp_path / "root"
    # No run_id: the run gets a fresh one, which only the flow run's `run:` tag records.
    flow_run_id = tools.trigger("rl-training/manual", {"iterations": 1, "overrides": [
        f"root={root}", *tools.tiny, "tasks.auto_resumes=2", "tasks.auto_resume_delay_seconds=1"]}, tools.env)
    rollout = _wait("rollout of iteration 1 committed",
                    lambda: next(root.glob("runs/*/iterations/1/rollout/_MANIFEST.json"), None), TIMEOUT_S,
                    prefect_worker)
    before = (rollout.stat().st_mtime_ns, rollout.read_bytes())
    pid = _wait("the run's process", lambda: _flow_run_process(prefect_worker, flow_run_id), 60)
    os.kill(pid, signal.SIGKILL)  # as the OOM killer would: no handler runs, the worker sees it die

    def resumed():
        runs = api(lambda c: c.read_flow_runs(flow_run_filter=F.FlowRunFilter(
            tags=F.FlowRunFilterTags(all_=[f"resume-of:{flow_run_id}"]))))
        return runs if runs and all(r.state and r.state.is_final() for r in runs) else None

    runs = _wait("a finished automatic resume", resumed, TIMEOUT_S, prefect_worker)
    first = api(lambda c: c.read_flow_run(UUID(flow_run_id)))
    assert first.state_type.value == "CRASHED", first.state
    (again,) = runs
    run_id = rollout.parents[3].name
    assert again.state_type.value == "COMPLETED", (again.name, again.state)
    assert again.name == f"{first.name} (auto-resume 1/2)"
    assert again.parameters["run_id"] == run_id and f"run:{run_id}" in first.tags
    assert {"auto-resume", f"run:{run_id}", f"resumes:{flow_run_id}"} <= set(again.tags)
    assert [p.name for p in (root / "runs").iterdir()] == [run_id]  # the same run went on, no new one
    assert (rollout.stat().st_mtime_ns, rollout.read_bytes()) == before  # committed before the kill: kept
    assert (root / "runs" / run_id / "iterations" / "1" / "commit" / "_MANIFEST.json").exists()


def test_a_run_failed_by_its_input_is_not_resumed(prefect_worker, api, tools, tmp_path):
    """rl-training tags it `input-error`; rl-resume, started by the automation, leaves it."""
    from prefect.client.schemas import filters as F

    flow_run_id = tools.trigger("rl-training/manual", {"iterations": 1, "overrides": [
        f"root={tmp_path / 'root'}", *tools.tiny, "rollout.n=many"]}, tools.env)
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

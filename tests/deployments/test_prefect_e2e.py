"""End to end against a real local Prefect (server, `make deploy`, a process worker; see conftest):
the nightly schedule, a manual deployment run through the worker, what the UI shows of it, and
(make e2e) the nightly retraining flow on tiny data, three nights. ~5 minutes on two busy cores.

    .venv/bin/python -m pytest -q tests/deployments -m prefect
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

RUN_TIMEOUT_S = 480  # one tiny RL iteration through the worker: ~60 s idle, ~2-3 min on busy cores


def _filters():
    from prefect.client.schemas import filters as F

    return F


# ------------------------------------------------------------------------------ (a) the schedule
def test_nightly_schedule_creates_runs_at_2am_local(deployed, api, tools):
    from prefect.client.schemas.objects import StateType

    F = _filters()
    tz = tools.env["RLMILL_NIGHTLY_TZ"]

    manual = api(lambda c: c.read_deployment_by_name("rl-training/manual"))
    assert manual.entrypoint == "flows/training.py:rl_training" and not manual.schedules
    assert manual.work_pool_name == tools.pool
    assert manual.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(tools.repo)}}]

    nightly = api(lambda c: c.read_deployment_by_name("rl-nightly/nightly"))
    assert nightly.entrypoint == "flows/nightly.py:rl_nightly" and nightly.work_pool_name == tools.pool
    (sched,) = nightly.schedules
    assert sched.active and sched.schedule.cron == "0 2 * * *" and sched.schedule.timezone == tz

    async def scheduled(c):
        return await c.read_flow_runs(
            deployment_filter=F.DeploymentFilter(id=F.DeploymentFilterId(any_=[nightly.id])),
            flow_run_filter=F.FlowRunFilter(state=F.FlowRunFilterState(
                type=F.FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))

    deadline = time.monotonic() + 120  # the scheduler service loops every 5 s in these tests
    while not (runs := api(scheduled)) and time.monotonic() < deadline:
        time.sleep(2)
    assert runs, "the scheduler created no upcoming nightly runs"
    starts = sorted(r.expected_start_time.astimezone(ZoneInfo(tz)) for r in runs)
    assert all((s.hour, s.minute, s.second) == (2, 0, 0) for s in starts), starts
    assert len({s.date() for s in starts}) == len(starts)  # one a night
    now = dt.datetime.now(dt.timezone.utc)
    assert now < starts[0] <= now + dt.timedelta(days=1)


# ------------------------------------------------------------------------------ (b) manual run
@pytest.fixture(scope="module")
def manual_run(prefect_worker, api, tools, tmp_path_factory):
    """`prefect deployment run 'rl-training/manual' -p iterations=1 -p overrides=[...]`, run by the worker."""
    root = tmp_path_factory.mktemp("manual-root")
    run_id = "deploy-manual"
    t0 = time.monotonic()
    flow_run_id = tools.trigger("rl-training/manual", {
        "iterations": 1, "overrides": [f"root={root}", f"run_id={run_id}", *tools.tiny]})
    run = tools.wait_final(api, flow_run_id, RUN_TIMEOUT_S, prefect_worker)
    return {"id": flow_run_id, "run": run, "root": root, "run_id": run_id, "seconds": time.monotonic() - t0}


def test_manual_deployment_run_completes_through_worker(manual_run, api, tools):
    F = _filters()
    run = manual_run["run"]
    assert run.state.is_completed(), f"{run.state}"
    assert run.work_pool_name == tools.pool and run.parameters["iterations"] == 1
    dep = api(lambda c: c.read_deployment_by_name("rl-training/manual"))
    assert run.deployment_id == dep.id

    subflows = api(lambda c: c.read_flow_runs(flow_run_filter=F.FlowRunFilter(
        parent_flow_run_id=F.FlowRunFilterParentFlowRunId(any_=[run.id]))))
    assert [s.name for s in subflows] == ["iter-0001"] and subflows[0].state.is_completed()

    arts = api(lambda c: c.read_artifacts(flow_run_filter=F.FlowRunFilter(id=F.FlowRunFilterId(any_=[subflows[0].id]))))
    metrics = [a for a in arts if a.key == f"{manual_run['run_id']}-metrics"]
    assert metrics and metrics[0].type == "table"
    table = metrics[0].data if isinstance(metrics[0].data, list) else json.loads(metrics[0].data)
    assert "critic/score/mean" in {row["metric"] for row in table}

    policy = Path(manual_run["root"]) / "runs" / manual_run["run_id"] / "checkpoints" / "1" / "policy"
    assert (policy / "model.safetensors.index.json").exists()


# ------------------------------------------------------------------------------ (c) the UI
def test_ui_flow_run_page_shows_subflows_and_metrics_artifact(manual_run, prefect_server, chromium, tmp_path):
    ui = prefect_server.removesuffix("/api")
    chromium.open(f"{ui}/runs/flow-run/{manual_run['id']}")
    text = chromium.wait_text(["Subflow Runs", "rl-training"])
    assert "Subflow Runs" in text, text[-2000:]
    assert chromium.click("Subflow Runs")
    # The list shows the run name first, its flow's name ("rl-iteration") once a second request returns.
    text = chromium.wait_text(["iter-0001", "rl-iteration"], timeout=60)
    chromium.screenshot(tmp_path / "flow-run-subflows.png")
    assert "iter-0001" in text and "rl-iteration" in text, text[-2000:]

    # The metrics table artifact belongs to the iteration's subflow run: follow the link to it.
    assert chromium.click("iter-0001")
    text = chromium.wait_text(["Artifacts", "Parent Run"], timeout=60)
    assert chromium.click("Artifacts"), text[-2000:]
    key = f"{manual_run['run_id']}-metrics"
    text = chromium.wait_text([key], timeout=60)
    chromium.screenshot(tmp_path / "iteration-artifacts.png")
    assert key in text and "TABLE" in text.upper(), text[-2000:]


# ------------------------------------------------------------------------------ (d) nightly
def _write_arith(url: Path, n: int, seed: int) -> None:
    from storage.datasets import write_prompts
    from gpu_jobs.data import arith_pairs, arith_row

    write_prompts([arith_row(a, b, "train", i) for i, (a, b) in enumerate(arith_pairs(n, seed))], str(url))


def _nightly_cli(tools, args: list[str]) -> dict:
    out = tools.cli([str(tools.venv_bin / "python"), "-m", "flows.nightly", *args], timeout=RUN_TIMEOUT_S)
    m = re.search(r"^\{$", out, flags=re.M)  # main() prints the result as indented JSON, last
    assert m, out[-3000:]
    return json.JSONDecoder().raw_decode(out[m.start():])[0]


@pytest.mark.e2e  # three nights, one through the worker: ~55 s on 2 cores (the nightly's parts: test_nightly_unit)
def test_nightly_promotes_refuses_and_skips(prefect_worker, api, tools, tmp_path):
    """Night 1 (flow run in-process against the server): new data -> train -> evaluate ->
    promote. Night 2 (the deployment, through the worker): more data, trained from the promoted
    version, refused by the margin. Night 3: no new data -> nothing to do."""
    from storage import ModelLayout, RunLayout

    F = _filters()
    root = tmp_path / "root"
    incoming = root / "incoming" / "arith"
    overrides = [f"root={root}", *tools.tiny]
    models = ModelLayout(str(root), "arith")
    state_file = Path(models.root) / "nightly_state.json"

    _write_arith(incoming / "day1.parquet", 64, seed=123)
    night1 = _nightly_cli(tools, ["--iterations", "1", "--eval-size", "50", "--min-gain", "-1",
                                  "--night", "20260101", *overrides])
    assert night1["status"] == "promoted" and night1["run_id"] == "nightly-20260101"
    assert night1["base"] == "builtin" and night1["files"] == ["day1.parquet"]
    assert models.current_version() == "nightly-20260101"
    assert (Path(models.version("nightly-20260101")) / "model.safetensors.index.json").exists()
    state = json.loads(state_file.read_text())
    assert set(state["processed"]) == {"day1.parquet"} and state["history"][0]["decision"] == "promote"
    # Both scores are greedy exact match on the same 50 held-out rows.
    assert night1["new"]["n"] == night1["promoted_before"]["n"] == 50

    _write_arith(incoming / "later" / "day2.parquet", 64, seed=456)
    flow_run_id = tools.trigger("rl-nightly/nightly", {
        "config": "examples/grpo_arith.yaml", "overrides": overrides, "model_name": "arith", "iterations": 1,
        "eval_size": 50, "min_gain": 1.01, "night": "20260101"})
    run = tools.wait_final(api, flow_run_id, RUN_TIMEOUT_S, prefect_worker)
    assert run.state.is_completed(), f"{run.state}"
    state = json.loads(state_file.read_text())
    night2 = state["history"][-1]
    assert night2["run_id"] == "nightly-20260101-2" and night2["decision"] == "refuse"
    assert night2["files"] == ["later/day2.parquet"]
    assert night2["base"] == models.version("nightly-20260101")  # started from the promoted version
    frozen = RunLayout(str(root), "nightly-20260101-2").read_run_json()
    assert frozen["config"]["model"]["path"] == models.version("nightly-20260101")
    assert frozen["config"]["data"]["train_files"] == [str(incoming / "later" / "day2.parquet")]
    assert models.current_version() == "nightly-20260101"  # refused: CURRENT unchanged
    arts = api(lambda c: c.read_artifacts(
        flow_run_filter=F.FlowRunFilter(id=F.FlowRunFilterId(any_=[run.id])),
        artifact_filter=F.ArtifactFilter(key=F.ArtifactFilterKey(any_=["arith-nightly"]))))
    assert arts, "no decision artifact on the nightly run"
    md = arts[0].data
    assert "REFUSED" in md and f"{night2['new']['mean_reward']:.4f}" in md
    assert f"{night2['promoted_before']['mean_reward']:.4f}" in md

    night3 = _nightly_cli(tools, ["--iterations", "1", "--eval-size", "50", *overrides])
    assert night3["status"] == "nothing to do" and "run_id" not in night3  # nothing trained, nothing evaluated
    assert len(json.loads(state_file.read_text())["history"]) == 2

# Remote placement through deployment runs: tests/deployments/test_async_pools.py (two pools, async).

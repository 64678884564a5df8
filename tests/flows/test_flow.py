"""The Prefect flows end to end against a real (test-harness) Prefect API.

    .venv/bin/python -m pytest -q tests/flows/test_flow.py
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]



@pytest.fixture(scope="module")
def prefect_api():
    """A Prefect API of this module's own (~10-20 s to start); yields its URL."""
    from tests.servers import module_prefect_api

    with module_prefect_api() as url:
        yield url


def _read(coro):
    return asyncio.run(coro)


async def _flow_runs_named(prefix: str):
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        runs = await client.read_flow_runs(limit=200)
    return [r for r in runs if r.name.startswith(prefix)]


async def _artifacts(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async with get_client() as client:
        return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def test_two_iterations_end_to_end_on_local_storage(prefect_api, tmp_path, example_path, tiny):
    from flows.training import rl_training

    root = tmp_path / "root"
    summary = rl_training(config=str(example_path), overrides=tiny(str(root), "run_id=e2e-local"), iterations=2)
    assert summary["iterations"] == 2 and 0.0 <= summary["val/acc after"] <= 1.0
    run = root / "runs" / "e2e-local"
    for k in (1, 2):
        assert (run / "iterations" / str(k) / "commit" / "_MANIFEST.json").exists()
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "2"
    assert Path(summary["curves"]).read_bytes()[:4] == b"\x89PNG"
    # The final policy is a plain HF folder.
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "2" / "policy")

    names = {r.name for r in _read(_flow_runs_named("iter-"))}
    assert {"iter-0001", "iter-0002"} <= names
    tables = _read(_artifacts("e2e-local-metrics"))
    assert tables and any("critic/score/mean" in str(a.data) for a in tables)
    assert _read(_artifacts("e2e-local-samples")) and _read(_artifacts("e2e-local-summary"))


@pytest.mark.s3
def test_one_iteration_on_s3(prefect_api, s3_bucket_url, s3_endpoint, example_path, tiny):
    from flows.training import rl_training
    from storage import StorageConfig, committed, RunLayout

    creds = [f"storage.endpoint_url={s3_endpoint['endpoint_url']}", f"storage.key={s3_endpoint['key']}",
             f"storage.secret={s3_endpoint['secret']}", "run_id=e2e-s3"]
    root = f"{s3_bucket_url}/rl"
    summary = rl_training(config=str(example_path), overrides=tiny(root, *creds), iterations=1)
    storage = StorageConfig(endpoint_url=s3_endpoint["endpoint_url"], key=s3_endpoint["key"],
                            secret=s3_endpoint["secret"])
    layout = RunLayout(root, "e2e-s3", storage)
    assert committed(layout.stage(1, "commit"), storage)
    # Credentials never reach run.json or manifests.
    run_json = json.dumps(layout.read_run_json())
    assert s3_endpoint["secret"] not in run_json
    assert summary["curves"].startswith("s3://")


def test_a_stage_that_fails_once_is_retried_and_the_run_completes(prefect_api, tmp_path, example_path, tiny,
                                                                 monkeypatch):
    from flows.training import rl_training
    from gpu_jobs import stages

    real, calls = stages.reward.compute, []

    def flaky(run, roles, k, *inputs):
        calls.append(k)
        if len(calls) == 1:
            raise ConnectionError("injected: reward service unavailable")
        return real(run, roles, k, *inputs)

    monkeypatch.setattr(stages.reward, "compute", flaky)
    # verl's key for skipping the validation before training rides along (a run of its own costs ~15 s).
    summary = rl_training(config=str(example_path), iterations=1,
                          overrides=tiny(str(tmp_path / "r"), "run_id=flaky", "trainer.val_before_train=False"))
    assert calls == [1, 1] and summary["iterations"] == 1
    validations = sorted(p.parent.parent.name for p in (tmp_path / "r" / "runs" / "flaky").rglob("validate/_MANIFEST.json"))
    assert validations == ["1"] and summary["val/acc before"] is None, validations
    assert [k for k, *_ in summary["val_curve"]] == [1], summary["val_curve"]


def _declare_toy_stage():
    """A stage as a user adds one: one decorated function (docs/reference/stage-contract.md)."""
    import numpy as np
    import pyarrow as pa

    from gpu_jobs.stages import STAGES, Output, read, stage

    if "response_lengths" in STAGES:  # this module imported twice in one process
        return STAGES["response_lengths"]

    @stage("response_lengths", timer="timing_s/response_lengths")
    def response_lengths(run, roles, k: int, batch_uri: str) -> Output:
        table = read(run, batch_uri, ["uid", "response_len"])
        lens = np.asarray(table.column("response_len").to_pylist(), np.float64)
        return Output(table, {"toy/response_len/mean": float(lens.mean())}, [batch_uri])

    return response_lengths


def test_a_stage_added_in_one_declaration_runs_as_a_task_of_the_flow(prefect_api, tmp_path, example_path, tiny,
                                                                     monkeypatch):
    """One decorated function plus one line in the graph: the flow runs it as a Prefect task of
    its own, and it commits like every stage (a second call returns the same manifest)."""
    import flows.training
    from gpu_jobs.stages import DirectCalls, Roles, Run, run_iteration
    from storage import RunLayout, committed, read_manifest, read_table

    toy = _declare_toy_stage()

    def graph(calls, cfg, k):
        uris = run_iteration(calls, cfg, k)
        uris["response_lengths"] = calls(toy, k, uris["gate"])  # the one line
        return uris

    monkeypatch.setattr(flows.training, "run_iteration", graph)
    root = str(tmp_path / "root")
    flows.training.rl_training(config=str(example_path), overrides=tiny(root, "run_id=toy-stage"), iterations=1)
    layout = RunLayout(root, "toy-stage")
    uri = committed(layout.stage(1, "response_lengths"))
    assert uri, "the toy stage did not commit"
    batch = read_table(committed(layout.stage(1, "gate")), columns=["response_len"])
    metrics = read_manifest(uri).metrics
    assert metrics["toy/response_len/mean"] == pytest.approx(sum(batch.column("response_len").to_pylist()) / len(batch))
    assert "timing_s/response_lengths" in metrics
    names = _read(_task_runs_of("iter-0001"))
    assert any(n.startswith("response_lengths-") for n in names), names
    run = Run.from_storage(root, "toy-stage")
    assert DirectCalls(run, Roles(run.model_path))(toy, 1, committed(layout.stage(1, "gate"))) == uri


def test_a_stage_name_is_declared_once():
    from gpu_jobs.stages import Output, stage

    with pytest.raises(ValueError, match="stage 'reward' is declared twice"):
        stage("reward")(lambda run, roles, k: Output(None))


def test_a_remote_stage_asks_for_one_deployment_run_per_attempt(prefect_api):
    """The idempotency key of a remote stage's deployment run: the same within one attempt of
    the calling task (a create the client sends twice starts one run), new for its retry."""
    from types import SimpleNamespace

    from prefect import task

    from flows.remote import _attempt_key
    from gpu_jobs import stages

    run, keys = SimpleNamespace(run_uid="uid"), []

    @task(retries=1, retry_delay_seconds=0)
    def remote_stage_attempt():
        keys.extend([_attempt_key(run, 3, stages.update), _attempt_key(run, 3, stages.update)])
        if len(keys) == 2:
            raise ConnectionError("injected: the first attempt fails")

    remote_stage_attempt()
    assert keys[0] == keys[1] != keys[2] == keys[3]
    assert keys[0].startswith("rlmill-uid-3-update-")


# Crash-resume (SIGKILL at exact points, then bitwise-equal weights) lives in tests/chaos.


def test_a_second_live_process_on_the_same_run_is_refused(prefect_api, tmp_path, example_path, tiny):
    from flows.run_lock import RunLock
    from flows.training import rl_training

    root = tmp_path / "root"
    with RunLock(str(root), "busy"):
        with pytest.raises(Exception, match="already being trained"):
            rl_training(config=str(example_path), overrides=tiny(str(root), "run_id=busy"), iterations=1)


async def _task_runs_of(flow_run_name: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async with get_client() as client:
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run_name])))
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [r.id for r in runs]}))
    return [t.name for t in tasks]


def test_one_step_off_async_run_through_the_flow(prefect_api, tmp_path, example_path, tiny):
    """Iteration k's flow run holds the rollout of k+1, named with the weights it sampled with."""
    from flows.training import rl_training

    extra = ("run_id=async-flow", "async_training.staleness_threshold=1", "actor.recompute_old_logprobs=true",
             "algorithm.rollout_correction.rollout_is=token")
    summary = rl_training(config=str(example_path), overrides=tiny(str(tmp_path / "r"), *extra), iterations=3)
    assert summary["iterations"] == 3
    names = _read(_task_runs_of("iter-0002"))
    assert "rollout-3 (weights of update 1)" in names, names
    assert any(n.startswith("update") for n in names)

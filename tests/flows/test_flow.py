"""The Prefect flows end to end against a real (test-harness) Prefect API.

    .venv/bin/python -m pytest -q tests/flows/test_flow.py
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def prefect_api():
    """One Prefect API for the whole session (~10-20 s to start); yields its URL."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield PREFECT_API_URL.value()


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
    import gpu_jobs.stages as stage_fns
    from flows.training import rl_training

    real, calls = stage_fns.reward, []

    def flaky(ctx, k, batch_uri):
        calls.append(k)
        if len(calls) == 1:
            raise ConnectionError("injected: reward service unavailable")
        return real(ctx, k, batch_uri)

    monkeypatch.setattr(stage_fns, "reward", flaky)
    summary = rl_training(config=str(example_path), overrides=tiny(str(tmp_path / "r"), "run_id=flaky"), iterations=1)
    assert calls == [1, 1] and summary["iterations"] == 1


# ------------------------------------------------------------------------------- crash-resume
def _train_cmd(root: Path, run_id: str, example_path: Path, tiny) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "train", "--config", str(example_path),
            *tiny(str(root), f"run_id={run_id}", "trainer.total_iterations=3", "trainer.checkpoint_every=2",
                  "trainer.val_every=0")]


def _env(api_url: str) -> dict[str, str]:
    # One thread: the killed, resumed and uninterrupted runs must do the same float arithmetic.
    from gpu_jobs.train.dist import child_env

    return {**child_env(), "PREFECT_API_URL": api_url, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _kill_when(cmd, env, marker: Path, timeout: float = 400) -> None:
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"run exited ({proc.returncode}) before {marker} appeared")
        if time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"{marker} never appeared")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _final_weights(root: Path, run_id: str) -> dict[str, torch.Tensor]:
    from storage import load_state_dict

    return load_state_dict(str(root / "runs" / run_id / "checkpoints" / "3" / "policy"))


def test_sigkill_at_several_points_then_resume_gives_identical_weights(prefect_api, tmp_path, example_path, tiny):
    env = _env(prefect_api)
    ref_root, crash_root = tmp_path / "ref", tmp_path / "crash"
    ref = subprocess.run(_train_cmd(ref_root, "r", example_path, tiny), cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert ref.returncode == 0, ref.stdout[-3000:]

    it = crash_root / "runs" / "r" / "iterations"
    cmd = _train_cmd(crash_root, "r", example_path, tiny)
    # Mid-iteration (after the rollout of iteration 1 committed: inside gate/reward)...
    _kill_when(cmd, env, it / "1" / "rollout" / "_MANIFEST.json")
    # ...then after checkpoint 2, between the update and the iteration's commit...
    _kill_when(cmd, env, crash_root / "runs" / "r" / "checkpoints" / "2" / "update_metrics.json")
    # ...then let it finish.
    done = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]

    ref, got = _final_weights(ref_root, "r"), _final_weights(crash_root, "r")
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    # Nothing committed twice: exactly one manifest per stage and iteration.
    for k in (1, 2, 3):
        assert len(list((it / str(k)).glob("*/_MANIFEST.json"))) >= 5


def test_a_second_live_process_on_the_same_run_is_refused(prefect_api, tmp_path, example_path, tiny):
    from flows.run_lock import RunLock
    from flows.training import rl_training

    root = tmp_path / "root"
    with RunLock(str(root), "busy"):
        with pytest.raises(Exception, match="already being trained"):
            rl_training(config=str(example_path), overrides=tiny(str(root), "run_id=busy"), iterations=1)

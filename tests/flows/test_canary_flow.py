"""The rl-canary flow on local storage, deciding from feedback segments the consumer committed (a
real redis-server, gpu_jobs.online.consumer.consume): wait below the minimum sample, promote a
candidate that is not worse, roll back one that is, finish an outcome a crashed decider committed;
`rlmill models canary` shows the numbers and `rlmill models rollback` ends a canary."""

from __future__ import annotations

import time

import pytest

from storage import ModelLayout
from gpu_jobs.online.canary import CanaryPolicy, end_canary, read_canary, read_outcome, start_canary
from tests.cli_output import cli_output as _cli

POLICY = CanaryPolicy(share=0.5, min_samples=10, confidence=0.95, margin=0.05, max_duration_s=3600.0,
                      method="welch")  # the hand-checked numbers below are the t-test's (msprt is the default)


def _answer(model: str, version: str, i: int) -> dict:
    from gpu_jobs.online.answers import new_answer_id
    from gpu_jobs.online.events import answer_event

    return answer_event(new_answer_id("chatcmpl"), endpoint="chat.completions", model=model, version=version,
                        created=time.time(), latency_s=0.01, prompt=[{"role": "user", "content": f"{i}+1="}],
                        prompt_ids=[5, 6], choices=[{"index": 0, "text": str(i + 1), "token_ids": [7],
                                                     "logprobs": [-0.5], "finish_reason": "stop"}],
                        sampling={"temperature": 1.0}, user=f"u{i}")


def _plant(redis_url: str, root: str, arms: dict[tuple[str, str], tuple[int, int]]) -> None:
    """For each (model, version): (ups, downs) answers rated thumbs up / down, through the stream
    and the consumer's own commit."""
    import redis

    from gpu_jobs.online.broker import STREAM
    from gpu_jobs.online.consumer import consume
    from gpu_jobs.online.events import encode, feedback_event

    r, n = redis.Redis.from_url(redis_url), 0
    for (model, version), (ups, downs) in arms.items():
        for i, thumbs in enumerate(["up"] * ups + ["down"] * downs):
            a = _answer(model, version, i)
            r.xadd(STREAM, encode(a))
            r.xadd(STREAM, encode(feedback_event(a["answer_id"], model=model, version=version, thumbs=thumbs,
                                                 user=a["user"])))
            n += 1
    result = consume(root, redis_url)
    assert result.feedback == n and result.quarantined == 0, result


def _canary(root: str, model: str):
    models = ModelLayout(root, model)
    models.promote("v1")
    return models, start_canary(models, "v2", POLICY, by="test")


def _markdown_artifact(state) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas import filters as F

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=F.ArtifactFilter(
            flow_run_id=F.ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    (md,) = [a.data for a in arts if a.type == "markdown"]
    return md


def test_rl_canary_waits_promotes_rolls_back_and_finishes(tmp_path):
    from flows.online.canary import rl_canary
    from tests.serve.conftest import redis_server

    root = str(tmp_path / "root")
    good, good_c = _canary(root, "good")
    bad, bad_c = _canary(root, "bad")
    assert rl_canary(model="good", root=root)["status"] == "wait"  # nothing rated yet
    with redis_server(tmp_path) as url:
        # good: baseline 10 up / 2 down (mean 0.833, sd^2 0.1515), candidate 12 up: lower bound -0.035 > -0.05
        # bad: baseline 12 up, candidate 2 up / 10 down: upper bound -0.63 < -0.05
        _plant(url, root, {("good", "v1"): (10, 2), ("good", "v2"): (12, 0), ("good", "v0"): (0, 12),
                           ("bad", "v1"): (12, 0), ("bad", "v2"): (2, 10)})

    shown = _cli("models", "canary", "bad", "--root", root)
    assert f"canary {bad_c.id} of bad: 50% of users/sessions on v2" in shown
    assert "candidate  v2: n 12, mean 0.1667" in shown and "decision now: rollback" in shown

    state = rl_canary(model="good", root=root, return_state=True)
    out = state.result()
    assert out["status"] == "promote" and (out["n_baseline"], out["n_candidate"]) == (12, 12), out  # v0 not counted
    assert out["lower"] == pytest.approx(-0.0352, abs=1e-3)
    assert good.current_version() == "v2" and read_canary(good) is None
    move = good.history()[-1]
    assert (move["by"], move["from"], move["to"]) == ("canary", "v1", "v2") and good_c.id in move["reason"]
    assert read_outcome(good, good_c.id)["outcome"] == "promote"
    md = _markdown_artifact(state)
    assert "PROMOTED `v2`" in md and "one-sided Welch t-test, non-inferiority" in md and "| candidate | `v2` | 12 |" in md

    out = rl_canary(model="bad", root=root)
    assert out["status"] == "rollback" and out["upper"] < -0.05 and out["mean_candidate"] == pytest.approx(2 / 12)
    assert bad.current_version() == "v1" and read_canary(bad) is None
    move = bad.history()[-1]
    assert (move["by"], move["from"], move["to"]) == ("canary-rollback", "v1", "v1") and "rolled back" in move["reason"]
    assert bad.previous_version() is None  # the rollback record moved nothing
    assert rl_canary(model="bad", root=root) == {"status": "no canary", "model": "bad"}
    assert f"the last one, {bad_c.id}" in _cli("models", "canary", "bad", "--root", root)

    # A decider that crashed after committing its outcome: the next run applies it, without deciding again.
    crashed, crashed_c = _canary(root, "crashed")
    end_canary(crashed, crashed_c, "promote", {"reason": "planted"})
    assert rl_canary(model="crashed", root=root)["status"] == "promote"
    assert crashed.current_version() == "v2" and read_canary(crashed) is None

    state = rl_canary(model="../up", root=root, return_state=True)
    assert state.is_failed() and state.message.startswith("invalid model name '../up'") and "\n" not in state.message
    # The module's command line: the flow's own value (no capsys here: Prefect's console handler
    # would keep the captured stream past the test), a refused input as its one line.
    from flows.online import run_for_cli
    from flows.online.canary import main as canary_main

    assert run_for_cli(rl_canary, model="bad", root=root) == {"status": "no canary", "model": "bad"}
    with pytest.raises(SystemExit, match=r"^rlmill: invalid model name '\.\./up'"):
        canary_main(["--model", "../up", "--root", root])


def test_a_person_rollback_ends_the_canary(tmp_path):
    root = str(tmp_path / "root")
    models, canary = _canary(root, "arith")
    out = _cli("models", "rollback", "arith", "--root", root)
    assert f"canary {canary.id} of v2 against v1 ended: rollback" in out and "CURRENT stays v1" in out
    assert read_canary(models) is None and models.current_version() == "v1"
    record = read_outcome(models, canary.id)
    assert record["outcome"] == "rollback" and "ended by `rlmill models rollback`" in record["numbers"]["reason"]
    assert models.history()[-1]["by"] == "canary-rollback"


def test_the_decide_deployment_is_triggered_by_committed_segments():
    from pathlib import Path

    import yaml

    from flows.online.canary import DEPLOYMENT, rl_canary
    from flows.online.feedback import SEGMENT_EVENT

    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "deployments" / "prefect.yaml").read_text())
    (dep,) = [d for d in spec["deployments"] if d["name"] == DEPLOYMENT.split("/")[1]]
    assert f"{rl_canary.name}/{dep['name']}" == DEPLOYMENT and dep["entrypoint"] == "flows/online/canary.py:rl_canary"
    assert dep["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    (trigger,) = dep["triggers"]
    assert trigger["expect"] == [SEGMENT_EVENT] and trigger["match"] == {"prefect.resource.id": "rlmill.model.*"}
    assert trigger["for_each"] == ["prefect.resource.id"] and trigger["posture"] == "Reactive"
    assert trigger["parameters"] == {"model": "{{ event.payload.model }}", "root": "{{ event.payload.root }}"}


def _checkpoint(root: str, run_id: str) -> str:
    """The built-in model's files committed as run `run_id`'s checkpoint of iteration 1."""
    import json
    import struct
    from pathlib import Path

    from gpu_jobs.models import resolve_model_path
    from storage import INDEX_NAME, RunLayout, commit, write_files

    folder = Path(resolve_model_path("builtin"))
    blobs = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != INDEX_NAME}
    weights = blobs["model.safetensors"]
    header = json.loads(weights[8:8 + struct.unpack("<Q", weights[:8])[0]])  # safetensors: u64 length, JSON
    src = RunLayout(root, run_id).policy(1)
    commit(src, write_files(src, blobs), kind="checkpoint", name=INDEX_NAME,
           extra={"metadata": {"total_size": len(weights)},
                  "weight_map": {k: "model.safetensors" for k in header if k != "__metadata__"}})
    return src


def test_a_candidate_that_passes_the_gate_goes_to_a_canary(tmp_path):
    """train_and_gate's step 6 (flows.nightly._publish) with a canary policy: the version is
    published and a canary of it starts; retried, the same canary; a second candidate while it
    runs is published only; without a policy, or before any promotion, the move is direct."""
    from flows.nightly import Decision, Outcome, _publish, canary_policy, outcome_status
    from flows.online.retrain import rl_retrain

    root = str(tmp_path / "root")
    models = ModelLayout(root, "arith")
    src = _checkpoint(root, "retrain-arith-w1")
    passed = Decision(True, "not worse")
    assert _publish(passed, src, models, "w1", False, None, "retrain", POLICY) == ("w1", None, None)  # first: direct
    assert models.current_version() == "w1" and read_canary(models) is None

    src2 = _checkpoint(root, "retrain-arith-w2")
    promoted, merged, canary_id = _publish(passed, src2, models, "w2", False, None, "retrain", POLICY)
    canary = read_canary(models)
    assert (promoted, merged, canary_id) == (None, None, canary.id) and models.current_version() == "w1"
    assert (canary.candidate, canary.baseline, canary.by, canary.share) == ("w2", "w1", "retrain", 0.5)
    assert (tmp_path / "root" / "models" / "arith" / "versions" / "w2" / "model.safetensors").exists()
    assert _publish(passed, src2, models, "w2", False, None, "retrain", POLICY)[2] == canary.id  # a retry
    src3 = _checkpoint(root, "retrain-arith-w3")
    assert _publish(passed, src3, models, "w3", False, None, "retrain", POLICY) == (None, None, None)
    assert read_canary(models) == canary and "w3" in models.version_names()
    assert _publish(Decision(False, "worse"), src3, models, "w4", False, None, "retrain", POLICY) == (None, None, None)
    assert _publish(passed, src3, models, "w3", False, None, "retrain", None) == ("w3", None, None)  # share 0

    out = Outcome({}, src2, {}, {}, passed, None, None, canary.id)
    assert outcome_status(out) == "canary" and outcome_status(Outcome({}, src2, {}, {}, passed, None, None)) == \
        "published"
    assert canary_policy(0.0, {"margin": 0.2}) is None and canary_policy(0.2, {"margin": 0.2}).margin == 0.2
    with pytest.raises(ValueError, match="canary_test: unknown key"):
        canary_policy(0.1, {"min_sample": 5})
    state = rl_retrain(model="arith", root=root, canary_share=1.5, return_state=True)
    assert state.is_failed() and state.message.startswith("canary share 1.5: give the fraction")

"""The rl-canary flow on local storage, deciding from feedback segments the consumer committed (a
real redis-server, gpu_jobs.serve.consumer.consume): wait below the minimum sample, promote a
candidate that is not worse, roll back one that is, finish an outcome a crashed decider committed;
`rlmill models canary` shows the numbers and `rlmill models rollback` ends a canary."""

from __future__ import annotations

import time

import pytest

from storage import ModelLayout
from storage.canary import CanaryPolicy, end_canary, read_canary, read_outcome, start_canary

POLICY = CanaryPolicy(share=0.5, min_samples=10, confidence=0.95, margin=0.05, max_duration_s=3600.0)


def _answer(model: str, version: str, i: int) -> dict:
    from gpu_jobs.serve.answers import new_answer_id
    from gpu_jobs.serve.events import answer_event

    return answer_event(new_answer_id("chatcmpl"), endpoint="chat.completions", model=model, version=version,
                        created=time.time(), latency_s=0.01, prompt=[{"role": "user", "content": f"{i}+1="}],
                        prompt_ids=[5, 6], choices=[{"index": 0, "text": str(i + 1), "token_ids": [7],
                                                     "logprobs": [-0.5], "finish_reason": "stop"}],
                        sampling={"temperature": 1.0}, user=f"u{i}")


def _plant(redis_url: str, root: str, arms: dict[tuple[str, str], tuple[int, int]]) -> None:
    """For each (model, version): (ups, downs) answers rated thumbs up / down, through the stream
    and the consumer's own commit."""
    import redis

    from gpu_jobs.serve.broker import STREAM
    from gpu_jobs.serve.consumer import consume
    from gpu_jobs.serve.events import encode, feedback_event

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


def test_rl_canary_waits_promotes_rolls_back_and_finishes(tmp_path, capsys):
    from flows.canary import rl_canary
    from flows.cli import main
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

    main(["models", "canary", "bad", "--root", root])
    shown = capsys.readouterr().out
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
    main(["models", "canary", "bad", "--root", root])
    assert f"the last one, {bad_c.id}" in capsys.readouterr().out

    # A decider that crashed after committing its outcome: the next run applies it, without deciding again.
    crashed, crashed_c = _canary(root, "crashed")
    end_canary(crashed, crashed_c, "promote", {"reason": "planted"})
    assert rl_canary(model="crashed", root=root)["status"] == "promote"
    assert crashed.current_version() == "v2" and read_canary(crashed) is None

    state = rl_canary(model="../up", root=root, return_state=True)
    assert state.is_failed() and state.message.startswith("invalid model name '../up'") and "\n" not in state.message


def test_a_person_rollback_ends_the_canary(tmp_path, capsys):
    from flows.cli import main

    root = str(tmp_path / "root")
    models, canary = _canary(root, "arith")
    main(["models", "rollback", "arith", "--root", root])
    out = capsys.readouterr().out
    assert f"canary {canary.id} of v2 against v1 ended: rollback" in out and "CURRENT stays v1" in out
    assert read_canary(models) is None and models.current_version() == "v1"
    record = read_outcome(models, canary.id)
    assert record["outcome"] == "rollback" and "ended by `rlmill models rollback`" in record["numbers"]["reason"]
    assert models.history()[-1]["by"] == "canary-rollback"


def test_the_decide_deployment_is_triggered_by_committed_segments():
    from pathlib import Path

    import yaml

    from flows.canary import DEPLOYMENT, rl_canary
    from flows.feedback import SEGMENT_EVENT

    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "deployments" / "prefect.yaml").read_text())
    (dep,) = [d for d in spec["deployments"] if d["name"] == DEPLOYMENT.split("/")[1]]
    assert f"{rl_canary.name}/{dep['name']}" == DEPLOYMENT and dep["entrypoint"] == "flows/canary.py:rl_canary"
    assert dep["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    (trigger,) = dep["triggers"]
    assert trigger["expect"] == [SEGMENT_EVENT] and trigger["match"] == {"prefect.resource.id": "rlmill.model.*"}
    assert trigger["for_each"] == ["prefect.resource.id"] and trigger["posture"] == "Reactive"
    assert trigger["parameters"] == {"model": "{{ event.payload.model }}", "root": "{{ event.payload.root }}"}

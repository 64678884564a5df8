"""rl-canary/decide (deployments/prefect.yaml, flows/online/canary.py) as `make deploy` creates it: one
decider at a time (CANCEL_NEW) and a trigger on rlmill.feedback.segment.committed; and (e2e) the
journey through the worker: a canary runs, users rate both arms, the feedback consumer's deployment
commits the segment, its event starts rl-canary/decide, and the decision promotes the candidate.

    .venv/bin/python -m pytest -q tests/deployments/test_canary_trigger.py
"""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

RUN_TIMEOUT_S = 300  # two small flow runs through the worker (no training): ~1 min idle
TRIGGER = "rlmill canary decision (feedback segment committed)"


def _decide(api):
    return api(lambda c: c.read_deployment_by_name("rl-canary/decide"))


def test_canary_deployment_is_triggered_by_each_committed_segment_one_at_a_time(deployed, api, tools):
    from flows.online.feedback import SEGMENT_EVENT

    d = _decide(api)
    assert d.entrypoint == "flows/online/canary.py:rl_canary" and d.work_pool_name == tools.pool
    tools.check_model_trigger(api, d, TRIGGER, SEGMENT_EVENT)


def _plant(url: str, arms: dict[str, tuple[int, int]]) -> int:
    """For each version of `arith`: (ups, downs) answers with their thumbs, into the stream as
    `rlmill serve` puts them (one user per answer); returns the feedback events written."""
    import redis

    from gpu_jobs.online.answers import new_answer_id
    from gpu_jobs.online.broker import STREAM
    from gpu_jobs.online.events import answer_event, encode, feedback_event

    r, n = redis.Redis.from_url(url), 0
    for version, (ups, downs) in arms.items():
        for i, thumbs in enumerate(["up"] * ups + ["down"] * downs):
            user = f"{version}-u{i}"
            a = answer_event(new_answer_id("chatcmpl"), endpoint="chat.completions", model="arith", version=version,
                             created=time.time(), latency_s=0.01, prompt=[{"role": "user", "content": f"{i}+1="}],
                             prompt_ids=[5, 6], choices=[{"index": 0, "text": str(i + 1), "token_ids": [7],
                                                          "logprobs": [-0.5], "finish_reason": "stop"}],
                             sampling={"temperature": 1.0}, user=user)
            r.xadd(STREAM, encode(a))
            r.xadd(STREAM, encode(feedback_event(a["answer_id"], model="arith", version=version, thumbs=thumbs,
                                                 user=user)))
            n += 1
    return n


@pytest.mark.e2e  # two flow-run processes through the worker (the drain, then the decider its event starts)
def test_a_committed_segment_starts_the_decision_that_promotes_the_candidate(prefect_worker, api, tools, tmp_path):
    from storage import ModelLayout
    from gpu_jobs.online.canary import CanaryPolicy, read_canary, read_outcome, start_canary
    from tests.serve.conftest import redis_server

    root = tmp_path / "store"
    models = ModelLayout(str(root), "arith")
    models.promote("v1")
    canary = start_canary(models, "v2", CanaryPolicy(share=0.5, min_samples=10, confidence=0.95, margin=0.05,
                                                     max_duration_s=3600.0, method="welch"), by="test")
    d = _decide(api)
    before = frozenset(r.id for r in tools.deployment_runs(api, d.id))
    with redis_server(tmp_path) as url:
        # baseline 10 up / 2 down, candidate 12 up: the 95 % lower bound of the difference is -0.035,
        # above -0.05 (tests/flows/test_canary_flow.py checks these numbers by hand): promote. The policy
        # names welch: its numbers are the t-test's (msprt, the default, waits for more voters here).
        n = _plant(url, {"v1": (10, 2), "v2": (12, 0)})
        drain = tools.trigger("rl-feedback/consume", {"root": str(root), "redis_url": url, "window_s": 0,
                                                      "ready_rows": 0})  # 0: no retraining announced
        run = tools.wait_final(api, drain, RUN_TIMEOUT_S, prefect_worker)
        assert run.state.is_completed(), run.state
    # The segment's event -> the automation -> a run of rl-canary/decide, then its end.
    runs = tools.wait_runs(api, d.id, 1, RUN_TIMEOUT_S, prefect_worker,
                           f"rl-canary/decide run(s) that the committed segment ({n} feedback) should start",
                           ignore=before)
    assert any(r.state.is_completed() for r in runs), [(r.name, r.state) for r in runs]
    assert all(r.parameters == {"model": "arith", "root": str(root)} for r in runs), [r.parameters for r in runs]
    assert models.current_version() == "v2" and read_canary(models) is None
    assert read_outcome(models, canary.id)["outcome"] == "promote"
    move = models.history()[-1]
    assert (move["by"], move["from"], move["to"]) == ("canary", "v1", "v2")

"""rl-feedback/consume (deployments/prefect.yaml, flows/online/feedback.py) as `make deploy` creates it:
an every-minute schedule deployed paused, deployment concurrency 1 that cancels a run that would
overlap; and (e2e) a deployment run through the worker draining a real redis-server.

    .venv/bin/python -m pytest -q tests/deployments/test_feedback_deployment.py
"""

from __future__ import annotations

import datetime as dt
import json

import pytest

from gpu_jobs.online.broker import GROUP, STREAM

pytestmark = [pytest.mark.slow, pytest.mark.prefect]


def test_feedback_deployment_is_paused_every_minute_one_at_a_time(deployed, api, tools):
    from flows.online.feedback import DEPLOYMENT, rl_feedback

    d = api(lambda c: c.read_deployment_by_name(DEPLOYMENT))
    assert DEPLOYMENT == f"{rl_feedback.name}/consume"
    assert d.entrypoint == "flows/online/feedback.py:rl_feedback" and d.work_pool_name == tools.pool
    assert d.parameters == {"root": ".rlmill", "redis_url": "redis://127.0.0.1:6379/0", "window_s": 40}
    (sched,) = d.schedules
    assert sched.schedule.interval == dt.timedelta(seconds=60) and not sched.active
    assert d.global_concurrency_limit.limit == 1
    assert d.concurrency_options.collision_strategy.value == "CANCEL_NEW"
    assert d.parameters["window_s"] < sched.schedule.interval.total_seconds()  # a run ends before the next is due


@pytest.mark.e2e  # a flow-run process through the worker: ~30-60 s on busy cores
def test_feedback_deployment_run_drains_the_stream(prefect_worker, api, tools, tmp_path):
    import redis

    from gpu_jobs.online.answers import new_answer_id
    from gpu_jobs.online.events import encode, feedback_event
    from tests.serve.conftest import redis_server

    root = tmp_path / "store"
    with redis_server(tmp_path) as url:
        r = redis.Redis.from_url(url)
        aid = new_answer_id("chatcmpl")
        # Feedback for an answer never logged: quarantined, and shown as such.
        r.xadd(STREAM, encode(feedback_event(aid, model="arith", version="v1", thumbs="up")))
        flow_run_id = tools.trigger("rl-feedback/consume", {"root": str(root), "redis_url": url, "window_s": 0})
        run = tools.wait_final(api, flow_run_id, 300, prefect_worker)
        assert run.state.is_completed(), run.state
        assert r.xpending(STREAM, GROUP)["pending"] == 0

    from prefect.client.schemas import filters as F

    arts = api(lambda c: c.read_artifacts(artifact_filter=F.ArtifactFilter(
        flow_run_id=F.ArtifactFilterFlowRunId(any_=[run.id]))))
    counts = {row["what"]: row["value"] for a in arts if a.key == f"{GROUP}-counts" for row in json.loads(a.data)}
    assert counts["events read"] == 1 and counts["quarantined: feedback for an answer never logged"] == 1
    assert counts["quarantine folder"] == f"{root}/feedback/_quarantine"
    assert list((root / "feedback" / "_quarantine").rglob("_MANIFEST.json"))
    assert {"rlmill", "feedback"} <= set(run.tags), run.tags  # the deployment's tags, set when the run was made

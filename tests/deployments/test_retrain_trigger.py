"""rl-retrain/on-feedback (deployments/prefect.yaml, flows/online/retrain.py) as `make deploy` creates it:
one run at a time (CANCEL_NEW) and a trigger on rlmill.feedback.window.ready; and (e2e) the whole
journey through the worker: the feedback consumer's deployment commits segments and announces the
window, the trigger starts rl-retrain, the announcement repeated twice more, and exactly one run
trains the window.

    .venv/bin/python -m pytest -q tests/deployments/test_retrain_trigger.py
"""

from __future__ import annotations

import json
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

RUN_TIMEOUT_S = 480  # a tiny retraining through the worker: ~1 min idle, a few on busy cores
REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return 1.0 if solution_str.strip().isdigit() else 0.0\n"


def _retrain(api):
    from flows.online.retrain import DEPLOYMENT

    return api(lambda c: c.read_deployment_by_name(DEPLOYMENT))


def test_retrain_deployment_is_triggered_by_the_ready_event_one_at_a_time(deployed, api, tools):
    from flows.online.feedback import READY_EVENT

    d = _retrain(api)
    assert d.entrypoint == "flows/online/retrain.py:rl_retrain" and d.work_pool_name == tools.pool
    tools.check_model_trigger(api, d, "rlmill retrain on arrival (feedback window ready)", READY_EVENT)


@pytest.mark.e2e  # three flow-run processes through the worker, one of them training: minutes on busy cores
def test_committed_feedback_fires_one_retraining(prefect_worker, api, tools, tmp_path):
    import redis
    from prefect.client.schemas.actions import DeploymentUpdate

    from flows.online.feedback import READY_EVENT
    from gpu_jobs.online.answers import new_answer_id
    from gpu_jobs.online.broker import STREAM
    from gpu_jobs.online.events import answer_event, encode, feedback_event
    from storage import ModelLayout
    from gpu_jobs.online.windows import WindowLog
    from tests.serve.conftest import redis_server

    root = tmp_path / "store"
    reward = tmp_path / "digits.py"
    reward.write_text(REWARD)
    d = _retrain(api)
    overrides = [*d.parameters["overrides"], f"root={root}", *tools.tiny, f"reward.custom_reward_function.path={reward}",
                 "trainer.val_before_train=false", "reward.num_workers=1"]
    # What a user does once (UI or `prefect deployment` edit): give the deployment a reward and sizes.
    api(lambda c: c.update_deployment(d.id, DeploymentUpdate(parameters={**d.parameters, "overrides": overrides,
                                                                          "eval_size": 8, "min_gain": -1.0})))
    with redis_server(tmp_path) as url:
        r = redis.Redis.from_url(url)
        for i in range(8):
            a = answer_event(new_answer_id("chatcmpl"), endpoint="chat.completions", model="arith", version="v0",
                             created=time.time(), latency_s=0.01,
                             prompt=[{"role": "user", "content": f"{10 + i}+{20 + i}="}], prompt_ids=[5, 6],
                             choices=[{"index": 0, "text": str(30 + 2 * i), "token_ids": [7], "logprobs": [-0.5],
                                       "finish_reason": "stop"}], sampling={"temperature": 1.0})
            r.xadd(STREAM, encode(a))
            r.xadd(STREAM, encode(feedback_event(a["answer_id"], model="arith", version="v0", thumbs="up")))
        drain = tools.trigger("rl-feedback/consume", {"root": str(root), "redis_url": url, "window_s": 0,
                                                      "ready_rows": 8})
        run = tools.wait_final(api, drain, RUN_TIMEOUT_S, prefect_worker)
        assert run.state.is_completed(), run.state
    # The trigger fires twice more for the same window (the consumer's next drains would).
    for _ in range(2):
        tools.cli([str(tools.venv_bin / "prefect"), "event", "emit", READY_EVENT, "--resource-id",
                   "rlmill.model.arith", "--payload", json.dumps({"model": "arith", "root": str(root)})])
    runs = tools.wait_runs(api, d.id, 3, RUN_TIMEOUT_S, prefect_worker, "rl-retrain runs (the trigger's)")
    assert len(runs) == 3 and all(r.parameters["root"] == str(root) for r in runs), runs
    # Each run either trained, found nothing new, or was cancelled as overlapping: one window, trained once.
    assert all(r.state.is_completed() or r.state.is_cancelled() for r in runs), [(r.name, r.state) for r in runs]
    log = WindowLog(ModelLayout(str(root), "arith"))
    (window,) = log.windows()
    assert window.run_id == "retrain-arith-w1" and window.rows("feedback") == 8
    assert log.done()[1]["decision"] == "promote" and log.pending() is None
    assert ModelLayout(str(root), "arith").current_version() == "retrain-arith-w1"

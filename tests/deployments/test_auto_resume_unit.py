"""The automatic-resume decision (deployments/resume.py), without a Prefect server.

    .venv/bin/python -m pytest -q tests/deployments/test_auto_resume_unit.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments.resume import INPUT_ERROR_TAG, _flow_run_id, decide, resume_settings, tag_value

REPO = Path(__file__).resolve().parents[2]
FAILED = dict(flow_name="rl-training", run_name="brave-fox", run_id_="11111111-1111-1111-1111-111111111111",
              state_type="CRASHED", tags=["rlmill", "run:grpo-arith-20261201-020000"],
              parameters={"config": "examples/grpo_arith.yaml", "iterations": 3}, has_deployment=True,
              resumes_so_far=0, already_resumed=False, limit=3, delay_s=60.0)


def test_first_resume_pins_the_trained_run_id_and_counts_one_of_three():
    d = decide(**FAILED)
    assert d.resume and d.attempt == 1 and d.delay_s == 60.0
    assert d.name == "brave-fox (auto-resume 1/3)"
    # the run was started without run_id: the resume names the id it trained, so it goes on from its commits
    assert d.parameters == {"config": "examples/grpo_arith.yaml", "iterations": 3,
                            "run_id": "grpo-arith-20261201-020000"}
    assert set(d.tags) == {"rlmill", "auto-resume", f"resume-of:{FAILED['run_id_']}", f"resumes:{FAILED['run_id_']}",
                           "run:grpo-arith-20261201-020000"}


def test_a_resume_of_a_resume_keeps_the_chain_root_and_the_first_name():
    root = "22222222-2222-2222-2222-222222222222"
    d = decide(**{**FAILED, "run_name": "brave-fox (auto-resume 1/3)", "resumes_so_far": 1,
                  "tags": ["rlmill", "auto-resume", f"resume-of:{root}", "resumes:x", "run:r1"]})
    assert d.resume and d.name == "brave-fox (auto-resume 2/3)"
    assert f"resume-of:{root}" in d.tags and "resumes:x" not in d.tags and d.tags.count("auto-resume") == 1


@pytest.mark.parametrize("change, why", [
    ({"resumes_so_far": 3}, "3/3 automatic resumes used"),
    ({"limit": 0}, "0/0 automatic resumes used"),
    ({"tags": ["rlmill", INPUT_ERROR_TAG]}, "because of its input"),
    ({"already_resumed": True}, "already resumed"),
    ({"state_type": "COMPLETED"}, "not Failed or Crashed"),
    ({"state_type": "CANCELLED"}, "not Failed or Crashed"),
    ({"has_deployment": False}, "not a deployment run"),   # e.g. the rl-training subflow of a night
    ({"flow_name": "rl-iteration"}, "not a deployment run"),
])
def test_not_resumed(change, why):
    d = decide(**{**FAILED, **change})
    assert not d.resume and why in d.reason, d.reason
    assert d.over_limit == ("automatic resumes used" in why)


def test_nightly_runs_resume_with_their_own_parameters():
    d = decide(**{**FAILED, "flow_name": "rl-nightly", "tags": ["rlmill", "nightly"],
                  "parameters": {"model_name": "arith", "iterations": 10}})
    assert d.resume and d.parameters == {"model_name": "arith", "iterations": 10}  # its run id is the night's


def test_retrain_runs_resume_with_their_own_parameters():
    """A resumed rl-retrain without a run_id takes its crashed run's window (the pending one)."""
    params = {"model": "arith", "root": "/r", "overrides": ["actor.lr=1.0e-5"]}
    d = decide(**{**FAILED, "flow_name": "rl-retrain", "tags": ["rlmill", "retrain", "model:arith"],
                  "parameters": params})
    assert d.resume and d.parameters == params


def test_settings_come_from_the_runs_own_config_and_overrides():
    params = {"config": str(REPO / "examples" / "grpo_arith.yaml"),
              "overrides": ["tasks.auto_resumes=1", "tasks.auto_resume_delay_seconds=5"]}
    assert resume_settings(params, "r1") == (1, 5.0)
    assert resume_settings({"config": params["config"]}, None) == (3, 60.0)


def test_helpers():
    assert tag_value(["a", "run:x:y", "run:z"], "run:") == "x:y" and tag_value(["a"], "run:") is None
    uid = "01a22f2b-c1aa-7c6b-a8da-fc6a7d5f182e"
    assert str(_flow_run_id(f"prefect.flow-run.{uid}")) == uid == str(_flow_run_id(uid))


def test_the_input_error_tag_is_the_one_rl_training_sets():
    import ast

    tree = ast.parse((REPO / "flows" / "training.py").read_text())
    values = [n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
              and any(getattr(t, "id", "") == "INPUT_ERROR_TAG" for t in n.targets)]
    assert values == [INPUT_ERROR_TAG]


def test_prefect_yaml_ships_the_resume_deployment_and_heartbeats():
    spec = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in spec["deployments"]}
    auto = deps["auto"]
    assert auto["entrypoint"] == "deployments/resume.py:rl_resume"
    ended, silent = auto["triggers"]
    assert ended["posture"] == "Reactive" and "prefect.flow-run.Crashed" in ended["expect"]
    assert silent["posture"] == "Proactive" and silent["after"] == ["prefect.flow-run.heartbeat"]
    assert (ended["parameters"]["why"], silent["parameters"]["why"]) == ("ended", "silent")
    for name in ("manual", "nightly"):  # heartbeats are what the silent trigger waits for
        assert deps[name]["work_pool"]["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
    assert silent["within"] > 2 * 30


def test_operating_keys_stay_out_of_run_json():
    """A run frozen before these keys existed resumes, and they may differ between starts."""
    from flows.config import frozen_config, load_run_config

    cfg = load_run_config(str(REPO / "examples" / "grpo_arith.yaml"), ["tasks.auto_resumes=1"])
    assert cfg.tasks.auto_resumes == 1
    assert not {"auto_resumes", "auto_resume_delay_seconds", "api_outage_budget_seconds"} & set(frozen_config(cfg)["tasks"])

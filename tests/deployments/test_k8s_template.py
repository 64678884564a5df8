"""deployments/k8s_gpu_job_template.json: the base job template of a `kubernetes` work pool whose
jobs request GPUs, checked with Prefect's own validation (what `prefect work-pool create` and
deployment runs go through on the server), without a Kubernetes cluster.

    .venv/bin/python -m pytest -q tests/deployments/test_k8s_template.py

No cluster and no prefect-kubernetes here: the rendered Job is checked against the parts its
worker insists on (prefect_kubernetes.worker: batch/v1 Job, one pod that never restarts, a
container named prefect-job), not submitted anywhere.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "deployments" / "k8s_gpu_job_template.json"
IMAGE = "registry.example.com/rlmill-gpu:2026.12"


@pytest.fixture()
def template() -> dict:
    return json.loads(TEMPLATE.read_text())


def defaults(template: dict) -> dict:
    """The variables' defaults, as the worker takes them (a None default counts as unset)."""
    return {k: v["default"] for k, v in template["variables"]["properties"].items() if v.get("default") is not None}


def render(template: dict, job_variables: dict) -> dict:
    """The job configuration a worker builds for a flow run: defaults, then the run's variables,
    applied to the template by Prefect's templating (placeholders with no value are dropped)."""
    from prefect.utilities.templating import apply_values

    return apply_values(copy.deepcopy(template["job_configuration"]), {**defaults(template), **job_variables})


def test_prefect_accepts_it_as_a_kubernetes_work_pool_template(template):
    from prefect.server.schemas.actions import WorkPoolCreate
    from prefect.utilities.schema_tools.validation import is_valid_schema

    # Every {{ placeholder }} of job_configuration is a declared variable (validate_base_job_template).
    pool = WorkPoolCreate(name="gpu", type="kubernetes", base_job_template=template)
    assert pool.base_job_template == template
    is_valid_schema(template["variables"], preprocess=False)  # the variables section is a JSON schema


def test_an_undeclared_placeholder_is_refused(template):
    from pydantic import ValidationError

    from prefect.server.schemas.actions import WorkPoolCreate

    template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["priorityClassName"] = "{{ priority }}"
    with pytest.raises(ValidationError, match="undeclared variable"):
        WorkPoolCreate(name="gpu", type="kubernetes", base_job_template=template)


def _validate(template: dict, job_variables: dict, ignore_required: bool) -> None:
    # The server's check of a flow run's job variables (prefect.server.api.validation).
    from prefect.utilities.schema_tools.validation import validate

    validate({**defaults(template), **job_variables}, template["variables"], raise_on_error=True, preprocess=True,
             ignore_required=ignore_required, allow_none_with_default=True)


def test_defaults_and_user_variables_validate_and_bad_ones_do_not(template):
    from prefect.utilities.schema_tools.validation import ValidationError

    _validate(template, {}, ignore_required=True)  # the pool's defaults (work-pool create)
    _validate(template, {"image": IMAGE, "gpus": 8, "cpu": "96", "memory": "1500Gi", "master_port": "29600",
                         "env": {"AWS_ACCESS_KEY_ID": "k"}, "namespace": "rl", "service_account_name": "rlmill"},
              ignore_required=False)
    with pytest.raises(ValidationError, match="image"):
        _validate(template, {}, ignore_required=False)  # a run must name its image
    for bad in ({"gpus": 0}, {"gpus": "two"}, {"cpu": "eight"}, {"memory": "64 gigs"}, {"master_port": "http"},
                {"image_pull_policy": "Sometimes"}):
        with pytest.raises(ValidationError):
            _validate(template, {"image": IMAGE, **bad}, ignore_required=False)


def test_the_rendered_job_requests_the_gpus(template):
    config = render(template, {"image": IMAGE, "gpus": 4, "cpu": "32", "memory": "256Gi", "namespace": "rl",
                               "master_addr": "10.0.0.7", "master_port": "29600", "service_account_name": "rlmill",
                               "name": "rl-stage-gpu", "command": "prefect flow-run execute", "labels": {"a": "b"}})
    assert "{{" not in json.dumps(config)
    job = config["job_manifest"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    for side in ("requests", "limits"):  # an extended resource's request must equal its limit
        assert container["resources"][side] == {"nvidia.com/gpu": 4, "cpu": "32", "memory": "256Gi"}
    assert {"name": "MASTER_ADDR", "value": "10.0.0.7"} in container["env"]
    assert {"name": "MASTER_PORT", "value": "29600"} in container["env"]
    assert (container["image"], pod["serviceAccountName"], job["metadata"]["namespace"]) == (IMAGE, "rlmill", "rl")
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    (shm,) = pod["volumes"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": shm["name"], "mountPath": "/dev/shm"} in container["volumeMounts"]
    # What prefect_kubernetes.worker.KubernetesWorkerJobConfiguration requires of a job manifest.
    assert (job["apiVersion"], job["kind"], container["name"]) == ("batch/v1", "Job", "prefect-job")
    assert (pod["parallelism"], pod["completions"], pod["restartPolicy"]) == (1, 1, "Never")


def test_unset_optional_variables_leave_no_placeholder(template):
    config = render(template, {"image": IMAGE, "name": "n", "command": "c", "labels": {}})
    pod = config["job_manifest"]["spec"]["template"]["spec"]
    assert "serviceAccountName" not in pod  # the namespace's default account
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "job_watch_timeout_seconds" not in config  # dropped: the worker's own default (None) applies
    assert "{{" not in json.dumps(config)


@pytest.mark.slow
def test_work_pool_create_takes_it(prefect_server, local_prefect):
    """The README's command against a real Prefect server, which validates the template's
    defaults on its side too; then the pool holds the template unchanged."""
    prefect = str(REPO / ".venv" / "bin" / "prefect")
    local_prefect.cli([prefect, "work-pool", "create", "gpu-k8s-check", "--type", "kubernetes",
                       "--base-job-template", str(TEMPLATE)])
    try:
        out = local_prefect.cli([prefect, "work-pool", "inspect", "gpu-k8s-check", "--output", "json"])
        pool = json.loads(out[out.index("{"):])
        assert pool["type"] == "kubernetes"
        assert pool["base_job_template"] == json.loads(TEMPLATE.read_text())
    finally:
        local_prefect.cli([prefect, "work-pool", "delete", "gpu-k8s-check"])

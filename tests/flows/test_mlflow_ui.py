"""MLflow as a team runs it: the full tracking server with its web UI, from its own environment
(scripts/ensure_mlflow_server.sh builds it once per machine, ~50 s; the training environment
holds only the client, mlflow-skinny). A tiny rlmill run logs to it with
`trainer.logger=[console,mlflow]`; its params, metrics by iteration and report are read back
through the client, then headless Chromium opens the UI's run page and must show them.

    .venv/bin/python -m pytest -q -m e2e tests/flows/test_mlflow_ui.py

Marked e2e (make e2e): the server start, a training run and the browser take ~40 s on 2 cores,
plus the one-time build. The quick MLflow checks stay in make test (test_trackers.py).
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.flows.mlflow_server import ensure_full_server, mlflow_runs, mlflow_server

pytestmark = [pytest.mark.e2e, pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

mlflow = pytest.importorskip("mlflow", reason="the test extra installs it: bash scripts/ensure_venv.sh test")

RUN = "trk-ui"
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def full_server(tmp_path_factory):
    """The full `mlflow server` (web UI) on a free port; its URL."""
    with mlflow_server(ensure_full_server(), tmp_path_factory.mktemp("mlflow-ui")) as url:
        yield url


@pytest.fixture(scope="module")
def ui_run(full_server, tmp_path_factory, example_path, tiny):
    """RUN for 2 iterations, logging to the full server; the run's root folder."""
    from flows.training import rl_training

    root = tmp_path_factory.mktemp("mlflow-ui-run") / "root"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", full_server)
        rl_training(config=str(example_path), overrides=tiny(str(root), f"run_id={RUN}", "trainer.logger=[console,mlflow]"),
                    iterations=2)
    return root


def page_text(dom: str) -> str:
    """The visible text of a dumped DOM, its elements' texts joined by ' | '."""
    dom = re.sub(r"<(script|style)\b[^>]*>.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"(\s*\|\s*)+", " | ", html.unescape(re.sub(r"<[^>]+>", " | ", dom)))


def test_the_full_server_holds_the_config_metrics_by_iteration_and_the_report(ui_run, full_server, tmp_path):
    from flows.trackers import flat_params

    client, (found,) = mlflow_runs(full_server, RUN)
    run = client.get_run(found.info.run_id)
    assert run.info.run_name == RUN and run.info.status == "FINISHED"
    frozen = json.loads((ui_run / "runs" / RUN / "run.json").read_text())["config"]
    assert run.data.params == flat_params(frozen)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "critic/score/mean")] == [1, 2]
    assert {a.path for a in client.list_artifacts(run.info.run_id, "rlmill")} == {"rlmill/summary.json",
                                                                                  "rlmill/curves.png"}
    summary = json.loads(Path(client.download_artifacts(run.info.run_id, "rlmill/summary.json", str(tmp_path))).read_text())
    assert summary["status"] == "finished" and summary["iterations logged"] == [1, 2]


def test_the_ui_run_page_shows_the_run_its_metric_and_params(ui_run, full_server, tmp_path):
    """The UI is a React app: the page's HTML holds no run until its scripts ran and asked the
    server, so this text is what the browser rendered (20 s of virtual time is plenty: ~6 s of
    real time on 2 busy cores)."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is absent: install Debian's browser (apt-get install -y chromium) to check the UI")
    _, (run,) = mlflow_runs(full_server, RUN)
    page = f"{full_server}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=20000", "--dump-dom", page],
        capture_output=True, text=True, timeout=120)
    text = page_text(done.stdout)
    assert "MLflow" in text, f"chromium did not render {page} (exit code {done.returncode}):\n{done.stderr[-2000:]}"
    for shown in (f" {RUN} ", " critic/score/mean ", " rollout.n ", " Finished "):
        assert f"|{shown}|" in text, f"the run page does not show {shown.strip()!r}:\n{text[:4000]}"

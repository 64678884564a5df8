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
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.flows.mlflow_server import ENSURE_SERVER, ensure_full_server, mlflow_runs, mlflow_server

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
        overrides = tiny(str(root), f"run_id={RUN}", "trainer.logger=[console,mlflow]")
        rl_training(config=str(example_path), overrides=overrides, iterations=2)
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
    summary = Path(client.download_artifacts(run.info.run_id, "rlmill/summary.json", str(tmp_path)))
    summary = json.loads(summary.read_text())
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


# ------------------------------------------------------------------------------------- the build script
def ensure(cache: Path, version: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "RLMILL_CACHE_DIR": str(cache), "RLMILL_MLFLOW_VERSION": version}
    return subprocess.Popen(["bash", str(ENSURE_SERVER)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True, **kw)


def test_a_built_server_is_reused_at_once(full_server):
    """The environment the fixture built (or found): the next call builds nothing, says nothing
    and prints the same `mlflow`."""
    done = subprocess.run(["bash", str(ENSURE_SERVER)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.strip() == ensure_full_server() and Path(done.stdout.strip()).name == "mlflow"


def test_a_failed_build_leaves_nothing_to_reuse(tmp_path):
    """A version the registry does not have: one `rlmill:` line naming it and the fix; the
    leftovers of an earlier killed build (a temporary folder, a destination without its UI
    check) are gone, and nothing is at the destination."""
    tools = tmp_path / "tools"
    (tools / ".mlflow-999.0.0.build.killed").mkdir(parents=True)
    (tools / "mlflow-999.0.0" / "bin").mkdir(parents=True)
    proc = ensure(tmp_path, "999.0.0")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and out == "", err
    assert "rlmill: could not install mlflow==999.0.0" in err and "RLMILL_MLFLOW_VERSION" in err, err
    assert sorted(p.name for p in tools.iterdir()) == [".mlflow-999.0.0.lock"]


def test_a_build_killed_midway_is_not_at_the_destination(tmp_path):
    """SIGKILL (no trap runs) while the packages install: only the temporary folder remains,
    which the next build removes (test above); the destination does not exist."""
    import selectors

    proc = ensure(tmp_path, "3.17.2")
    seen, deadline = "", time.monotonic() + 180
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while "[2/3]" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, f"no '[2/3]' (install) line:\n{seen}"
            if sel.select(timeout=1):  # os.read: a buffered readline could hold the line back
                seen += os.read(proc.stderr.fileno(), 65536).decode()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    names = sorted(p.name for p in (tmp_path / "tools").iterdir())
    assert names[0].startswith(".mlflow-3.17.2.build.") and names[1:] == [".mlflow-3.17.2.lock"], names

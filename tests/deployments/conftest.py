"""A real local Prefect for the deployment tests: server, deployments, process worker.

Everything is started by tests.servers.LocalPrefect through scripts/prefect_local.sh (what
`make server/deploy/worker` run), with its own PREFECT_HOME and PostgreSQL cluster
(tests.servers.postgres_server; RLMILL_TEST_PREFECT_DB=sqlite for SQLite) in a temporary folder
and a free port, and stopped by PID at the end of the session (SIGTERM to its process
group, SIGKILL after 15 s: a process worker may ignore SIGTERM).

    .venv/bin/python -m pytest -q tests/deployments
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.servers import LocalPrefect, stop_group

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "prefect_local.sh"
VENV_BIN = REPO / ".venv" / "bin"
POOL = "rlmill-test"
CHROMIUM = "/usr/bin/chromium"
# The tiny run every end-to-end test trains: 8 prompts x 4 samples, 50 held-out rows, 1 iteration.
TINY = ["data.train_batch_size=8", "rollout.n=4", "data.val_size=50", "actor.ppo_mini_batch_size=8",
        "trainer.total_iterations=1"]


@pytest.fixture(scope="session")
def local_prefect(tmp_path_factory):
    """The session's local Prefect (tests.servers.LocalPrefect): its own PREFECT_HOME, a free
    port, pool POOL; every process it started is stopped at the end of the session."""
    # PostgreSQL, as production Prefect runs (README); RLMILL_TEST_PREFECT_DB=sqlite for SQLite, whose
    # "database is locked" errors under this load once made a remote stage run twice.
    prefect = LocalPrefect(tmp_path_factory.mktemp("prefect"), POOL, db=os.environ.get("RLMILL_TEST_PREFECT_DB") or "postgres")
    try:
        yield prefect
    finally:
        prefect.close()


@pytest.fixture(scope="session")
def prefect_env(local_prefect) -> dict[str, str]:
    """Environment for every child: the session's server, pool and time zone, quiet, 1 thread."""
    return local_prefect.env


@pytest.fixture(scope="session")
def prefect_server(local_prefect):
    """`scripts/prefect_local.sh server` on the session's port, answering; yields the API URL."""
    local_prefect.start_server()
    return local_prefect.api


@pytest.fixture(scope="session")
def deployed(prefect_server, local_prefect) -> dict[str, str]:
    """`scripts/prefect_local.sh deploy`: the pool and both deployments exist."""
    return {"output": local_prefect.deploy()}


@pytest.fixture(scope="session")
def prefect_worker(deployed, local_prefect) -> Path:
    """`scripts/prefect_local.sh worker` polling the session's pool; yields its log."""
    return local_prefect.logs[local_prefect.start_worker().pid]


@pytest.fixture(scope="session")
def api(prefect_server):
    """api(async_fn) runs `async_fn(client)` with a client of the session's server."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    def call(fn):
        async def go():
            with temporary_settings(updates={PREFECT_API_URL: prefect_server}):
                async with get_client() as client:
                    return await fn(client)

        return asyncio.run(go())

    return call


def wait_final(api, flow_run_id: str, timeout: float, worker_log: Path | None = None):
    """Poll a flow run until it is in a final state; returns the FlowRun."""
    from uuid import UUID

    deadline = time.monotonic() + timeout
    while True:
        run = api(lambda c: c.read_flow_run(UUID(flow_run_id)))
        if run.state is not None and run.state.is_final():
            return run
        if time.monotonic() > deadline:
            tail = worker_log.read_text()[-4000:] if worker_log else ""
            raise AssertionError(f"flow run {flow_run_id} still {run.state_type} after {timeout:.0f}s\n{tail}")
        time.sleep(2)


def deployment_runs(api, deployment_id, ignore: frozenset = frozenset()) -> list:
    """The flow runs of a deployment, but those whose id is in `ignore` (runs from before a step)."""
    from prefect.client.schemas import filters as F

    runs = api(lambda c: c.read_flow_runs(deployment_filter=F.DeploymentFilter(id=F.DeploymentFilterId(
        any_=[deployment_id]))))
    return [r for r in runs if r.id not in ignore]


def wait_runs(api, deployment_id, n: int, timeout: float, worker_log: Path, what: str,
              ignore: frozenset = frozenset()) -> list:
    """Until at least `n` runs of the deployment (but `ignore`) exist and all are final; returns
    them. `what` names the runs in the message when the wait gives up."""
    deadline = time.monotonic() + timeout
    while True:
        runs = deployment_runs(api, deployment_id, ignore)
        if len(runs) >= n and all(r.state is not None and r.state.is_final() for r in runs):
            return runs
        if time.monotonic() > deadline:
            states = [(r.name, r.state_type) for r in runs]
            raise AssertionError(f"waited {timeout:.0f} s for {n} final {what}, have {states}\n"
                                 f"{worker_log.read_text()[-4000:]}")
        time.sleep(2)


def check_model_trigger(api, deployment, automation: str, event: str) -> None:
    """`deployment` runs one at a time (a run that would overlap is cancelled) and `automation`
    starts it on each `event`, with the event payload's model and root as its parameters."""
    assert deployment.global_concurrency_limit.limit == 1
    assert deployment.concurrency_options.collision_strategy.value == "CANCEL_NEW"
    (found,) = api(lambda c: c.read_automations_by_name(automation))
    trigger = found.trigger
    assert trigger.expect == {event} and trigger.posture.value == "Reactive" and trigger.threshold == 1
    (action,) = found.actions
    assert action.deployment_id == deployment.id
    # The model and root come from the event's payload (Prefect's templating, rendered per firing).
    assert json.dumps(action.parameters).count("event.payload.model") == 1
    assert json.dumps(action.parameters).count("event.payload.root") == 1


def logs_after_exit(api, flow_run_id: str, worker_log: Path, timeout: float) -> list[str]:
    """Every log message the API stored for a final flow run, once the worker saw its process
    exit (a process sends the rest of its logs before it exits): what the UI's log tab and
    `prefect flow-run logs` show, and what `--watch` streamed while it listened."""
    from uuid import UUID

    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    name = api(lambda c: c.read_flow_run(UUID(flow_run_id))).name
    exited = f"Process for flow run {name!r} exited"
    deadline = time.monotonic() + timeout
    while exited not in worker_log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise AssertionError(f"the worker did not report {exited!r} within {timeout:.0f} s:\n"
                                 f"{worker_log.read_text()[-4000:]}")
        time.sleep(1)
    only = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(flow_run_id)]))
    messages: list[str] = []
    while True:  # the API answers at most 200 per request
        page = api(lambda c: c.read_logs(log_filter=only, sort=LogSort.TIMESTAMP_ASC, limit=200,
                                         offset=len(messages)))
        messages += [log.message for log in page]
        if len(page) < 200:
            return messages


# ---------------------------------------------------------------------------------------------- UI
class Chromium:
    """Headless Debian chromium driven over the DevTools protocol (websockets is a Prefect
    dependency, so no node/playwright is needed). The Prefect UI renders client side and hides
    its Subflow Runs / Artifacts tabs until the run has loaded, so a one-shot --dump-dom cannot
    open them: here we wait for text, click a tab by its label, and read innerText."""

    def __init__(self, exe: str = CHROMIUM):
        from websockets.sync.client import connect

        self.dir = tempfile.mkdtemp(prefix="rlmill-chromium-")
        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={self.dir}", "--remote-debugging-port=0", "--window-size=1400,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = Path(self.dir) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        self.ws = connect(next(p for p in pages if p["type"] == "page")["webSocketDebuggerUrl"],
                          max_size=None, open_timeout=30)
        self._id = 0

    def call(self, method: str, **params):
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, js: str):
        return self.call("Runtime.evaluate", expression=js, returnByValue=True)["result"].get("value")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        return self.eval("document.body ? document.body.innerText : ''") or ""

    def wait_text(self, needles: list[str], timeout: float = 60) -> str:
        """The page's text once it holds every needle (or, after timeout, whatever it holds)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            if all(n in text for n in needles) or time.monotonic() > deadline:
                return text
            time.sleep(0.5)

    def click(self, label: str) -> bool:
        """Click the first leaf element whose text is exactly `label` (a tab, a link)."""
        return bool(self.eval(
            "(() => { const el = [...document.querySelectorAll('*')].find(e => e.children.length === 0"
            f" && e.textContent.trim() === {json.dumps(label)});"
            " if (!el) return false; el.click(); return true; })()"))

    def screenshot(self, path: Path) -> None:
        import base64

        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        stop_group(self.proc, grace=5)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def chromium():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is absent: install Debian's browser (apt-get install -y chromium) to check the UI")
    browser = Chromium()
    try:
        yield browser
    finally:
        browser.close()


@pytest.fixture(scope="session")
def tools(local_prefect):
    """Helpers for tests (test modules cannot import conftest under --import-mode=importlib)."""
    from types import SimpleNamespace

    return SimpleNamespace(repo=REPO, script=SCRIPT, venv_bin=VENV_BIN, pool=POOL, tiny=list(TINY),
                           env=local_prefect.env, prefect=local_prefect, cli=local_prefect.cli,
                           trigger=local_prefect.trigger, wait_final=wait_final, logs_after_exit=logs_after_exit,
                           deployment_runs=deployment_runs, wait_runs=wait_runs, check_model_trigger=check_model_trigger)

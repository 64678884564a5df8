"""Chaos scenarios where the orchestrator goes away, on a real local Prefect (server, `make
deploy`, process workers, scripts/prefect_local.sh), with no operator: the server is stopped for
30 s in the middle of a deployment run (the run must wait for it and go on), or the worker running
a deployment run is killed with it, as when its machine or container dies (the automations of
deployments/prefect.yaml must notice and resume the run on a new worker).

    .venv/bin/python -m benchmarks.chaos --only server-restart,server-restart-3min,worker-killed   # 2-5 min each

tests/flows/test_server_outage.py checks the server restart in `make test` (a flow run in a plain
process); here the run is a deployment run, started by a worker that lives through the outage.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time

from tests.servers import LocalPrefect

from .audit import audit, snapshot
from .harness import ITERATIONS, REPO, Chaos, Outcome, layout, overrides, session_processes
from .scenarios import SCENARIOS, _result, scenario

POOL = "rlmill-chaos"
# Flow runs are started by the worker, so the failpoint (failpoints.py) is armed from a
# sitecustomize on their PYTHONPATH: in a flow run's process (PREFECT__FLOW_RUN_ID set), until the
# marker exists. The resumed run finds the marker and runs unarmed.
SITECUSTOMIZE = """
import os
if os.environ.get("PREFECT__FLOW_RUN_ID") and os.environ.get("RLMILL_FAILPOINT") \\
        and not os.path.exists(os.environ["RLMILL_FAILPOINT_MARKER"]):
    from benchmarks.chaos.failpoints import install
    install(os.environ["RLMILL_FAILPOINT"], os.environ["RLMILL_FAILPOINT_MARKER"])
"""


class FailpointPrefect(LocalPrefect):
    """A local Prefect (tests.servers.LocalPrefect) whose flow runs arm `failpoint` (see
    SITECUSTOMIZE); kill() SIGKILLs a process it started with its whole session."""

    def __init__(self, chaos: Chaos, name: str, failpoint: str):
        work = chaos.work / f"{name}-prefect"
        (work / "site").mkdir(parents=True, exist_ok=True)
        (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.marker = work / "failpoint-reached"
        super().__init__(work, POOL, env=chaos.env(failpoint, self.marker))
        self.env["PYTHONPATH"] = f"{work / 'site'}:{REPO}"

    def up(self) -> None:
        self.start_server()
        self.deploy()

    def flow_runs(self, tag: str | None = None, ids: list[str] | None = None):
        import asyncio
        from uuid import UUID

        from prefect.client.orchestration import get_client
        from prefect.client.schemas import filters as F
        from prefect.settings import PREFECT_API_URL, temporary_settings

        flt = F.FlowRunFilter(tags=F.FlowRunFilterTags(all_=[tag]) if tag else None,
                              id=F.FlowRunFilterId(any_=[UUID(i) for i in ids]) if ids else None)

        async def go():
            with temporary_settings(updates={PREFECT_API_URL: self.api}):
                async with get_client() as client:
                    return await client.read_flow_runs(flow_run_filter=flt)

        return asyncio.run(go())

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """SIGKILL a process we started and everything in its session (a flow run it started too)."""
        for line in session_processes(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def down(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                self.kill(proc)


def _wait(what: str, ok, timeout: float):
    deadline = time.monotonic() + timeout
    while not (value := ok()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not seen within {timeout:.0f} s")
        time.sleep(2)
    return value


def _server_restart(chaos: Chaos, name: str, seconds: float) -> Outcome:
    """Stop the server `seconds` right after iteration 2's reward commits in a deployment run, start
    it again on the same database, and let the one flow run carry on."""
    root = str(chaos.work / name)
    lay, fault = layout(root, "r"), SCENARIOS[name][0]
    prefect = FailpointPrefect(chaos, name, "after-commit:reward:2")
    release = prefect.work / "release"
    prefect.env["RLMILL_FAILPOINT_RELEASE"] = str(release)  # hold at the point only while the server stops
    try:
        prefect.up()
        prefect.start_worker()
        first = prefect.trigger("rl-training/manual", {"overrides": [*overrides(root, "r")]})
        _wait("iteration 2's reward commit", prefect.marker.exists, chaos.timeout)
        before = snapshot(lay)
        prefect.kill(prefect.server)  # the server (API + UI + its database handle)
        t_down = time.monotonic()
        release.touch()  # the run goes on and meets the outage at its next API call
        time.sleep(seconds)  # the outage itself
        prefect.start_server()
        down_s = time.monotonic() - t_down
        (run,) = _wait("the run finished", lambda: [
            r for r in prefect.flow_runs(ids=[first]) if r.state and r.state.is_final()], chaos.timeout)
        resumes = prefect.flow_runs(tag=f"resume-of:{first}")
        log = "".join(p.read_text(errors="replace") for p in prefect.work.glob("worker-*.log"))
    finally:
        prefect.down()
    report = audit(lay, before, ITERATIONS)
    ok = run.state_type.value == "COMPLETED" and not resumes
    waited = re.search(r"answers again after (\d+) s", log)
    how = (f"the run waited {waited.group(1)} s for the API, then ran iteration 2 again in the same process"
           if waited else "Prefect's client retries carried every call")
    outcome = (f"API down {down_s:.0f} s; {how}; the one flow run {run.state_name}"
               + (f", resumed {len(resumes)}x" if resumes else ", no resume, no restart"))
    return _result(fault, outcome, ok, report, chaos.same_as_reference(root, "r") if ok else "-")


# Prefect's client retries each call ~60 s by itself (5 retries, 2..32 s backoff): a 30 s outage
# stays inside them, a 3-minute one reaches the run's own wait (tasks.api_outage_budget_seconds).
scenario("server-restart", "Prefect server stopped 30 s mid-iteration 2 of a deployment run, then started "
                           "again; no operator")(lambda chaos: _server_restart(chaos, "server-restart", 30.0))
scenario("server-restart-3min", "Prefect server stopped 3 min mid-iteration 2 of a deployment run, then "
                                "started again; no operator")(
    lambda chaos: _server_restart(chaos, "server-restart-3min", 180.0))


@scenario("worker-killed", "worker SIGKILLed with the deployment run it runs (mid-reward, iter 2); a new worker, "
                           "no operator")
def worker_killed(chaos: Chaos) -> Outcome:
    root = str(chaos.work / "worker-killed")
    lay, fault = layout(root, "r"), SCENARIOS["worker-killed"][0]
    prefect = FailpointPrefect(chaos, "worker-killed", "before-commit:reward:2")
    try:
        prefect.up()
        worker = prefect.start_worker()
        first = prefect.trigger("rl-training/manual", {"overrides": [
            *overrides(root, "r"), "tasks.auto_resume_delay_seconds=5"]})
        _wait("iteration 2's reward computed, not committed", prefect.marker.exists, chaos.timeout)
        before = snapshot(lay)
        t_kill = time.monotonic()
        prefect.kill(worker)  # the worker and the flow run process it started, as a dead machine would
        prefect.start_worker()  # a new worker, as a restarted container or a second machine would be
        resumes = _wait("a finished automatic resume", lambda: [
            r for r in prefect.flow_runs(tag=f"resume-of:{first}") if r.state and r.state.is_final()], 900)
        took = time.monotonic() - t_kill
        crashed = prefect.flow_runs(ids=[first])[0]
    finally:
        prefect.down()
    report = audit(lay, before, ITERATIONS)
    again = resumes[0]
    ok = again.state_type.value == "COMPLETED"
    message = crashed.state.message or ""
    how = ("marked Crashed after 90 + 45 s without a heartbeat" if message.startswith("no heartbeat")
           else f"{crashed.state_name}: {message[:60]}")
    outcome = (f"run {how}; '{again.name.rsplit(' (', 1)[-1].rstrip(')')}' ran on the new worker: "
               f"{again.state_name}, {took:.0f} s after the kill")
    return _result(fault, outcome, ok, report, chaos.same_as_reference(root, "r") if ok else "-")

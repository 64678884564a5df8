"""rlmill serve during a canary, in-process on a registered model (two copies of the built-in model as
versions v1 and v2): sticky routing by user and session, the baseline for requests with neither,
per-arm /metrics, a restarted server keeping every id on its arm, and the watcher's poll retiring a
rolled-back candidate and promoting a loaded one without a second load. Polls are called by hand
(watch_s=0), so nothing waits on a thread's timing."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from gpu_jobs.online.app import Server, ServeSettings, create_app
from gpu_jobs.online.model import ModelSource
from gpu_jobs.online.swap import route_key
from storage import ModelLayout
from gpu_jobs.online.canary import CanaryPolicy, end_canary, read_canary, remove_canary, start_canary
from tests.serve.test_hot_swap import BOUND_S, publish_version


class CountingSource:
    """A ModelSource that records which versions were loaded."""

    def __init__(self, source: ModelSource):
        self.source, self.loads = source, []

    def __getattr__(self, name):
        return getattr(self.source, name)

    def load(self, version=None):
        self.loads.append(version)
        return self.source.load(version)


def _ids(canary, prefix: str, to_candidate: bool, n: int = 2) -> list[str]:
    """The first n ids "<prefix><i>" that the canary routes to the candidate (or not)."""
    def key(i: int) -> str | None:
        return route_key(f"{prefix}{i}", None) if prefix.startswith("u") else route_key(None, f"{prefix}{i}")

    return [f"{prefix}{i}" for i in range(1000) if canary.routes_to_candidate(key(i)) == to_candidate][:n]


def _ask(client: TestClient, **who) -> str:
    r = client.post("/v1/completions", json={"model": "arith", "prompt": "12+34=", "max_tokens": 3,
                                             "temperature": 0, **who})
    assert r.status_code == 200, r.text
    return r.json()["system_fingerprint"]


def _metrics(client: TestClient) -> dict[str, float]:
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in client.get("/metrics").text.splitlines())}


def _wait_retired(server, what: str) -> None:
    """Until no retired generation is left open (each closes once nothing holds it), bounded."""
    deadline = time.monotonic() + BOUND_S
    while server.models.stats()["retiring"]:
        assert time.monotonic() < deadline, f"gave up after {BOUND_S} s waiting for {what} to close"
        time.sleep(0.02)


@pytest.fixture
def registered(tmp_path):
    import torch

    torch.set_num_threads(1)  # two cores shared with other test sessions
    publish_version(tmp_path, "v1")
    publish_version(tmp_path, "v2", promote=False)
    return tmp_path


def test_sticky_arms_survive_a_restart_and_follow_the_record(registered):
    models = ModelLayout(str(registered), "arith")
    canary = start_canary(models, "v2", CanaryPolicy(share=0.5))
    source = CountingSource(ModelSource("arith", str(registered)))
    server = Server(source.load(), None, ServeSettings(watch_s=0), source=source)
    assert source.loads == [None, "v2"]  # CURRENT, then the candidate beside it, at start
    cand, base = _ids(canary, "u", True), _ids(canary, "u", False)
    (cand_session,) = _ids(canary, "s", True, 1)
    with TestClient(create_app(server)) as client:
        assert client.get("/health").json()["canary"] == {"id": canary.id, "candidate": "v2", "share": 0.5}
        for _ in range(2):  # sticky: the same id, the same arm, every time
            assert [_ask(client, user=u) for u in cand] == ["arith@v2"] * 2
            assert [_ask(client, user=u) for u in base] == ["arith@v1"] * 2
        assert _ask(client) == "arith@v1"  # neither user nor session: the baseline
        assert _ask(client, session_id=cand_session) == "arith@v2"
        # the user decides over the session: a baseline user with a candidate session stays on v1
        assert _ask(client, user=base[0], session_id=cand_session) == "arith@v1"
        m = _metrics(client)
        assert m['rlmill_serve_canary_requests_total{arm="candidate"}'] == 5
        assert m['rlmill_serve_canary_requests_total{arm="baseline"}'] == 6
        assert m[f'rlmill_serve_canary_info{{id="{canary.id}",candidate="v2",baseline="v1",share="0.5"}}'] == 1
    server.close()

    # A restart mid-canary: a new server object, the same record, the same arms.
    server = Server(source.load(), None, ServeSettings(watch_s=0), source=source)
    with TestClient(create_app(server)) as client:
        assert [_ask(client, user=u) for u in cand + base] == ["arith@v2"] * 2 + ["arith@v1"] * 2
        assert _ask(client, session_id=cand_session) == "arith@v2"

        # Rolled back (rl-canary's order: outcome, then CANARY removed): the poll retires v2.
        end_canary(models, canary, "rollback", {})
        assert remove_canary(models, canary)
        assert server.models.check() == "same" and server.models.canary is None
        _wait_retired(server, "the rolled-back candidate")
        assert [_ask(client, user=u) for u in cand] == ["arith@v1"] * 2
        assert server.models.check_canary() == "same"

        # A new canary of v2 is loaded at the next poll; its promote swaps to it with no second load.
        canary = start_canary(models, "v2", CanaryPolicy(share=0.5))
        server.models.check()
        assert server.models.canary == read_canary(models)
        loads = len(source.loads)
        models.promote("v2", by="canary")
        assert server.models.check() == "swapped" and len(source.loads) == loads
        assert server.models.canary is None and client.get("/health").json()["version"] == "v2"
        assert [_ask(client, user=u) for u in cand + base] == ["arith@v2"] * 4
        assert remove_canary(models, canary) and server.models.check_canary() == "same"
        _wait_retired(server, "v1 after the promote")
    server.close()


def test_a_candidate_that_does_not_load_leaves_everyone_on_the_baseline(registered, caplog):
    models = ModelLayout(str(registered), "arith")
    publish_version(registered, "v3", broken=True, promote=False)
    canary = start_canary(models, "v3", CanaryPolicy(share=0.9))
    source = CountingSource(ModelSource("arith", str(registered)))
    server = Server(source.load(), None, ServeSettings(watch_s=0), source=source)
    with TestClient(create_app(server)) as client:
        assert server.models.canary is None and server.models.stats()["swap_failures"] == 1
        assert [_ask(client, user=u) for u in _ids(canary, "u", True)] == ["arith@v1"] * 2
        assert server.models.check_canary() == "same" and source.loads == [None, "v3"]  # not tried again
    lines = [r.getMessage() for r in caplog.records if "does not load" in r.getMessage()]
    assert len(lines) == 1 and f"canary {canary.id}" in lines[0] and "\n" not in lines[0]
    server.close()

"""rlmill serve during a canary, in-process on a registered model (two copies of the built-in model as
versions v1 and v2): arms by voter (a keyed hash of who the key says the caller is: a frontend's
vouched-for users, another key's principal whatever `user` it sends, an anonymous caller per
request), /health telling the canary to the metrics role only, per-arm /metrics, a restarted
server keeping every voter on its arm, the watcher's poll retiring a rolled-back candidate and
promoting a loaded one without a second load, and the one-key attack of issue 61 (any `user`
values, n: 64, 256 posts) leaving the canary's decision where it was. Polls are called by hand
(watch_s=0), so nothing waits on a thread's timing."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from gpu_jobs.online.app import Server, ServeSettings, create_app
from gpu_jobs.online.auth import ApiKeys
from gpu_jobs.online.limits import ServeLimits
from gpu_jobs.online.model import ModelSource
from storage import ModelLayout
from gpu_jobs.online.canary import (CanaryPolicy, canary_secret, end_canary, read_canary, remove_canary,
                                    start_canary)
from tests.serve.conftest import Capture
from tests.serve.test_hot_swap import BOUND_S, publish_version

WEB, BOT, OPS = "sk-Web7Qz2Lp9Xc4Vb8Nm3Kj6Hg", "sk-Bot5Rt8Yu2Io7Pa4Sd9Fg1Hj", "sk-Ops3Mn6Bv9Cx2Za5Lk8Jh4Gf"
KEYS = ApiKeys.parse({WEB: {"principal": "web", "roles": ["query", "feedback"], "asserts_users": True},
                      BOT: {"principal": "bot", "roles": ["query", "feedback"]},
                      OPS: {"principal": "ops", "roles": ["metrics"]}})
OPEN = ServeLimits(rate_limit=0.0, feedback_rate_limit=0.0)  # the attack's 256 posts all go through


class CountingSource:
    """A ModelSource that records which versions were loaded."""

    def __init__(self, source: ModelSource):
        self.source, self.loads = source, []

    def __getattr__(self, name):
        return getattr(self.source, name)

    def load(self, version=None):
        self.loads.append(version)
        return self.source.load(version)


def _users(canary, secret: bytes, to_candidate: bool, n: int = 2) -> list[str]:
    """The first n users "u<i>" the frontend vouches for that the canary routes to the candidate (or not)."""
    return [f"u{i}" for i in range(1000) if canary.routes_to_candidate(f"web/u{i}", secret) == to_candidate][:n]


def _ask(client: TestClient, key: str | None = WEB, **body) -> str:
    r = client.post("/v1/completions", json={"model": "arith", "prompt": "12+34=", "max_tokens": 3,
                                             "temperature": 0, **body},
                    headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200, r.text
    return r.json()["system_fingerprint"]


def _metrics(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics", headers={"Authorization": f"Bearer {OPS}"}).text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines())}


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


def test_arms_by_voter_survive_a_restart_and_follow_the_record(registered):
    models = ModelLayout(str(registered), "arith")
    canary = start_canary(models, "v2", CanaryPolicy(share=0.5))
    secret = canary_secret(models, canary)
    source = CountingSource(ModelSource("arith", str(registered)))
    server = Server(source.load(), None, ServeSettings(watch_s=0), source=source, keys=KEYS)
    assert source.loads == [None, "v2"]  # CURRENT, then the candidate beside it, at start
    cand, base = _users(canary, secret, True), _users(canary, secret, False)
    bot_arm = "arith@v2" if canary.routes_to_candidate("bot", secret) else "arith@v1"
    with TestClient(create_app(server)) as client:
        # /health names the canary to the metrics role only; the secret is nowhere
        assert client.get("/health").json()["canary"] is None
        assert client.get("/health", headers={"Authorization": f"Bearer {WEB}"}).json()["canary"] is None
        shown = client.get("/health", headers={"Authorization": f"Bearer {OPS}"}).json()["canary"]
        assert shown == {"id": canary.id, "candidate": "v2", "share": 0.5}
        assert secret.decode() not in client.get("/metrics", headers={"Authorization": f"Bearer {OPS}"}).text
        for _ in range(2):  # sticky: the same vouched-for user, the same arm, every time
            assert [_ask(client, user=u) for u in cand] == ["arith@v2"] * 2
            assert [_ask(client, user=u) for u in base] == ["arith@v1"] * 2
        # a key that vouches for nobody is one voter: the users it names move nothing
        assert {_ask(client, BOT, user=u) for u in cand + base + ["x", "y"]} == {bot_arm}
        assert _ask(client, BOT, session_id="s1") == bot_arm
        m = _metrics(client)
        assert m['rlmill_serve_canary_requests_total{arm="candidate"}'] == 4 + 7 * (bot_arm == "arith@v2")
        assert m['rlmill_serve_canary_requests_total{arm="baseline"}'] == 4 + 7 * (bot_arm == "arith@v1")
        assert m[f'rlmill_serve_canary_info{{id="{canary.id}",candidate="v2",baseline="v1",share="0.5"}}'] == 1
    server.close()

    # A restart mid-canary: a new server object, the same record and secret, the same arms.
    server = Server(source.load(), None, ServeSettings(watch_s=0), source=source, keys=KEYS)
    with TestClient(create_app(server)) as client:
        assert [_ask(client, user=u) for u in cand + base] == ["arith@v2"] * 2 + ["arith@v1"] * 2

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


def test_without_keys_each_request_draws_its_own_arm(registered):
    """No keys, nobody to be sticky for: a `user` is anyone's to write, so it picks no arm."""
    models = ModelLayout(str(registered), "arith")
    start_canary(models, "v2", CanaryPolicy(share=0.5))
    source = ModelSource("arith", str(registered))
    server = Server(source.load(), None, ServeSettings(watch_s=0), source=source)
    with TestClient(create_app(server)) as client:
        # 40 requests of one user: both arms (all on one would happen with probability 2 * 2**-40)
        assert {_ask(client, None, user="alice") for _ in range(40)} == {"arith@v1", "arith@v2"}
        assert client.get("/health").json()["canary"]["candidate"] == "v2"  # no keys: every path is open
    server.close()


def _honest(version: str, voters: int, mean_up: float) -> list[dict]:
    """Feedback rows of `voters` vouched-for users on `version`, each rating two answers, thumbs
    up on the first round(mean_up * voters) voters' answers."""
    from gpu_jobs.online.answers import new_answer_id
    from gpu_jobs.online.events import feedback_event

    ups = round(mean_up * voters)
    return [feedback_event(new_answer_id("cmpl"), model="arith", version=version,
                           thumbs="up" if i < ups else "down", principal="web", voter=f"web/{version}-{i}")
            for i in range(voters) for _ in range(2)]


def _decision(rows: list[dict], canary, method: str) -> tuple[str, int, int]:
    from gpu_jobs.online.canary_stats import canary_test, split_arms

    base, cand = split_arms(rows, canary.baseline, canary.candidate, canary.started_ts)
    v = canary_test(base, cand, min_samples=canary.min_samples, confidence=canary.confidence, margin=canary.margin,
                    elapsed_s=60.0, max_duration_s=canary.max_duration_s, method=method)
    return v.decision, v.n_baseline, v.n_candidate


def test_one_key_and_any_user_values_cannot_decide_the_canary(registered):
    """Issue 61's attack, as measured on main: one principal with one query+feedback key tries
    `user` values for both arms, asks n: 64 twice on each, posts 1 on every candidate choice and
    0 on every baseline choice (256 posts, all accepted). Here its key vouches for nobody: every
    answer comes from one arm, and the 256 posts are one voter's one sample on it -- alone, the
    canary waits (it promoted on main); beside honest voters, the decision is theirs."""
    models = ModelLayout(str(registered), "arith")
    canary = start_canary(models, "v2", CanaryPolicy(share=0.5, min_samples=10, method="welch"))
    source = ModelSource("arith", str(registered))
    server = Server(source.load(), Capture(), ServeSettings(watch_s=0, limits=OPEN), source=source, keys=KEYS)
    with TestClient(create_app(server)) as client:
        arms = {_ask(client, BOT, user=f"u{i}") for i in range(64)}
        assert len(arms) == 1, arms  # 64 user values, one arm: the key's principal is the voter
        posts = 0
        for user in ("u0", "u1", "u0", "u1"):
            r = client.post("/v1/completions", json={"prompt": "12+34=", "max_tokens": 2, "n": 64, "user": user},
                            headers={"Authorization": f"Bearer {BOT}"})
            body = r.json()
            value = 1.0 if body["system_fingerprint"] == "arith@v2" else 0.0
            for c in body["choices"]:
                ok = client.post("/v1/feedback", json={"answer_id": body["id"], "index": c["index"], "score": value,
                                                       "user": user}, headers={"Authorization": f"Bearer {BOT}"})
                assert ok.status_code == 200, ok.text
                posts += 1
    server.close()
    assert posts == 256
    attack = [e for e in server.publisher.events if e["kind"] == "feedback"]
    assert {e["voter"] for e in attack} == {"bot"} and len(attack) == 256
    for method in ("welch", "msprt"):
        decided, n_base, n_cand = _decision(attack, canary, method)
        assert decided == "wait" and sorted((n_base, n_cand)) == [0, 1], (method, decided, n_base, n_cand)
        # 40 honest voters on each arm: a bad candidate, an equal one, a better one
        for base, cand in ((0.8, 0.2), (0.8, 0.8), (0.8, 0.95)):
            honest = _honest("v1", 40, base) + _honest("v2", 40, cand)
            alone = _decision(honest, canary, method)
            assert alone[0] == "rollback" or cand >= base, (method, alone)  # the planted bad one is caught
            assert _decision(honest + attack, canary, method)[0] == alone[0], (method, base, cand, alone)


def test_a_candidate_that_does_not_load_leaves_everyone_on_the_baseline(registered, caplog):
    models = ModelLayout(str(registered), "arith")
    publish_version(registered, "v3", broken=True, promote=False)
    canary = start_canary(models, "v3", CanaryPolicy(share=0.9))
    source = CountingSource(ModelSource("arith", str(registered)))
    server = Server(source.load(), None, ServeSettings(watch_s=0), source=source, keys=KEYS)
    with TestClient(create_app(server)) as client:
        assert server.models.canary is None and server.models.stats()["swap_failures"] == 1
        assert {_ask(client, user=f"u{i}") for i in range(6)} == {"arith@v1"}
        assert server.models.check_canary() == "same" and source.loads == [None, "v3"]  # not tried again
    lines = [r.getMessage() for r in caplog.records if "does not load" in r.getMessage()]
    assert len(lines) == 1 and f"canary {canary.id}" in lines[0] and "\n" not in lines[0]
    server.close()

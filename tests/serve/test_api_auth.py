"""API keys and roles, per-principal rate limits and one vote per voter, on the built-in model:
the `openai` package with `api_key=` against a real server, 401/403/409/429 in OpenAI's shape,
the principal (never the key) in every event, and `rlmill serve`'s refusals of an open host."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from gpu_jobs.online.app import Server, ServeSettings, create_app
from gpu_jobs.online.auth import ApiKeys, ApiKeysError
from gpu_jobs.online.limits import ServeLimits
from tests.serve.conftest import Capture

ALICE, BOB, GRAFANA = "sk-alice-Qm3Tz8Wp2Lx7Rv5Nc9", "sk-bob-Hd4Jk7Fs1Gq8Yw3Ue6Zo", "sk-grafana-Pt5Xa2Cv9Bn6Mk3Lw"
WEB = "sk-web-Ay6Rf3Th9Ku2Io5Pe8Dj"
KEYS = {ALICE: {"principal": "alice", "roles": ["query", "feedback"]},
        BOB: {"principal": "bob", "roles": ["query"]},
        GRAFANA: {"principal": "grafana", "roles": ["metrics"]},
        WEB: {"principal": "web", "roles": ["query", "feedback"], "asserts_users": True}}
COMPLETION = {"prompt": "12+34=", "max_tokens": 4, "temperature": 0}


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _is_openai_error(r, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"], err
    return err


@pytest.fixture(scope="module")
def keyed(served):
    """A server with keys, feedback limited to 3 posts per principal (a refill every 1000 s)."""
    limits = ServeLimits(feedback_rate_limit=0.001, rate_burst=3)
    server = Server(served, Capture(), ServeSettings(limits=limits), keys=ApiKeys.parse(KEYS))
    yield server
    server.close()


def test_the_openai_client_with_api_key(keyed, run_app):
    import openai

    with run_app(keyed) as base:
        client = openai.OpenAI(api_key=ALICE, base_url=f"{base}/v1", max_retries=0)
        chat = client.chat.completions.create(model="builtin", messages=[{"role": "user", "content": "12+34="}],
                                              max_tokens=6, temperature=0, user="u-1")
        assert chat.choices[0].message.content == "46"
        done = client.completions.create(model="builtin", prompt="12+34=", max_tokens=4, temperature=0)
        assert done.choices[0].text == "46" and [m.id for m in client.models.list()] == ["builtin"]
        with pytest.raises(openai.AuthenticationError) as wrong:
            openai.OpenAI(api_key="sk-nobody-Wq2Er4Ty6Ui8Op0As", base_url=f"{base}/v1", max_retries=0).models.list()
        assert wrong.value.status_code == 401 and wrong.value.body["message"] == "invalid API key"
        with pytest.raises(openai.PermissionDeniedError) as denied:  # grafana may read /metrics only
            openai.OpenAI(api_key=GRAFANA, base_url=f"{base}/v1", max_retries=0).models.list()
        assert "lacks the role 'query'" in denied.value.body["message"]
    answers = [e for e in keyed.publisher.events if e["answer_id"] in (chat.id, done.id)]
    assert [e["principal"] for e in answers] == ["alice", "alice"] and answers[0]["user"] == "u-1"
    assert [e["voter"] for e in answers] == ["alice", "alice"]  # a key that vouches for nobody: its principal
    assert ALICE not in json.dumps(keyed.publisher.events)  # the principal, never the key


def test_keys_roles_and_votes(keyed):
    client = TestClient(create_app(keyed))
    assert client.get("/health").status_code == 200  # open: a load balancer's probe has no key
    assert "no API key" in _is_openai_error(client.post("/v1/completions", json=COMPLETION), 401)["message"]
    _is_openai_error(client.post("/v1/completions", json=COMPLETION, headers={"Authorization": ALICE}), 401)
    _is_openai_error(client.post("/v1/completions", json=COMPLETION, headers=_auth(ALICE + "x")), 401)
    _is_openai_error(client.post("/v1/completions", json=COMPLETION, headers=_auth(GRAFANA)), 403)
    _is_openai_error(client.get("/metrics", headers=_auth(ALICE)), 403)
    assert "rlmill_serve_answers_total" in client.get("/metrics", headers=_auth(GRAFANA)).text
    # without a key the body is never read: a malformed one is still a 401, not a 400
    _is_openai_error(client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                     401)
    answer = client.post("/v1/completions", json={**COMPLETION, "n": 2}, headers=_auth(BOB)).json()["id"]
    vote = {"answer_id": answer, "thumbs": "up"}
    assert "lacks the role 'feedback'" in _is_openai_error(client.post("/v1/feedback", json=vote,
                                                                       headers=_auth(BOB)), 403)["message"]
    ok = client.post("/v1/feedback", json=vote, headers=_auth(ALICE))
    assert ok.status_code == 200, ok.text
    # the same principal again on the same choice, under another self-asserted user: refused
    again = client.post("/v1/feedback", json={**vote, "user": "someone-else"}, headers=_auth(ALICE))
    assert _is_openai_error(again, 409)["param"] == "answer_id"
    assert client.post("/v1/feedback", json={**vote, "index": 1}, headers=_auth(ALICE)).status_code == 200
    # alice's 3 feedback posts (the 409 counts: the gate takes a token before the body is read)
    # are spent: the next is a 429 with Retry-After
    limited = client.post("/v1/feedback", json={**vote, "index": 1}, headers=_auth(ALICE))
    assert _is_openai_error(limited, 429)["type"] == "rate_limit_error" and int(limited.headers["retry-after"]) >= 1
    assert client.post("/v1/completions", json=COMPLETION, headers=_auth(ALICE)).status_code == 200  # query: no limit
    metrics = client.get("/metrics", headers=_auth(GRAFANA)).text
    assert 'rlmill_serve_gate_refused_total{status="429"} 1' in metrics
    assert "rlmill_serve_refused_votes_total 1" in metrics
    feedback = [e for e in keyed.publisher.events if e["kind"] == "feedback"]
    assert [(e["index"], e["principal"], e["voter"]) for e in feedback] == [(0, "alice", "alice"),
                                                                          (1, "alice", "alice")]


def test_a_frontend_that_vouches_for_its_users_names_the_voters(served):
    """asserts_users: each user the frontend names is a voter of its own ("<principal>/<user>"),
    in the answer's event, the feedback's and the one-vote check; a user it cannot name is a 400."""
    keyed = Server(served, Capture(), ServeSettings(limits=ServeLimits(feedback_rate_limit=0.0)),
                   keys=ApiKeys.parse(KEYS))
    client = TestClient(create_app(keyed))
    answer = client.post("/v1/completions", json={**COMPLETION, "user": "ann"}, headers=_auth(WEB)).json()["id"]
    for user, status in (("ann", 200), ("ann", 409), ("ben", 200), (None, 200), (None, 409)):
        body = {"answer_id": answer, "thumbs": "up", **({"user": user} if user else {})}
        assert client.post("/v1/feedback", json=body, headers=_auth(WEB)).status_code == status, (user, status)
    events = [e for e in keyed.publisher.events if e["answer_id"] == answer]
    assert [e["voter"] for e in events] == ["web/ann", "web/ann", "web/ben", "web"]
    bad = client.post("/v1/completions", json={**COMPLETION, "user": "a\nb"}, headers=_auth(WEB))
    assert "printable text" in _is_openai_error(bad, 400)["message"] and bad.json()["error"]["param"] == "user"
    # /health tells the canary to the metrics role only (none runs here: None either way); the key's
    # own check is the Gate's on every other path
    assert client.get("/health", headers=_auth(WEB)).json()["canary"] is None


def test_votes_without_keys_count_per_user(served):
    client = TestClient(create_app(Server(served, None)))
    answer = client.post("/v1/completions", json=COMPLETION).json()["id"]
    for user, status in (("u1", 200), ("u1", 409), ("u2", 200)):
        r = client.post("/v1/feedback", json={"answer_id": answer, "score": 1.0, "user": user})
        assert r.status_code == status, r.text


def test_keys_file_and_cli_refusals(tmp_path, monkeypatch):
    import hashlib
    import os

    from flows.cli import main

    good = tmp_path / "keys.yaml"
    digest = hashlib.sha256(BOB.encode()).hexdigest()
    good.write_text(f"{ALICE}: {{principal: alice, roles: [query]}}\n"
                    f"sha256:{digest}: {{principal: bob, roles: [query], asserts_users: true}}\n")
    with pytest.raises(ApiKeysError, match=rf"may be read or written by group or others \(mode 0644\): `chmod 600 "):
        os.chmod(good, 0o644)
        ApiKeys.from_file(str(good))
    os.chmod(good, 0o600)
    keys = ApiKeys.from_file(str(good))
    assert keys.lookup(ALICE).name == "alice" and keys.lookup(BOB).asserts_users  # a digest entry holds no key
    example = "sk-frontend-0123456789abcdef0123456789abcdef"  # docs/guide/serving.md's, once
    for text, expect in (("sk-short: {principal: a, roles: [query]}", "fewer than 24"),
                         ("sk-aaaaaaaaaaaaaaaaaaaaaaaaaaaa: {principal: a, roles: [query]}", "distinct characters"),
                         ("sk-mallory-0123456789abcdef012345: {principal: a, roles: [query]}", "run of 8 consecutive"),
                         (f"{example}: {{principal: a, roles: [query]}}", "an example key from the docs"),
                         (f"sha256:{hashlib.sha256(example.encode()).hexdigest()}: {{principal: a, roles: [query]}}",
                          "the digest of an example key"),
                         ("sha256:abc: {principal: a, roles: [query]}", "64 lowercase hex digits"),
                         (f"{ALICE}: {{principal: a, roles: [admin]}}", "roles ['admin']"),
                         (f"{ALICE}: {{principal: 'a b', roles: [query]}}", "principal 'a b'"),
                         (f"{ALICE}: {{principal: a, roles: [query], asserts_users: yes please}}", "true or false"),
                         (f"{ALICE}: {{principal: a, roles: [query]}}\n{BOB}: {{principal: a, roles: [query], "
                          "asserts_users: true}", "disagree on asserts_users"),
                         ("[1, 2]", "must be a mapping"), ("{", "not valid YAML")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        os.chmod(bad, 0o600)
        with pytest.raises(ApiKeysError) as exc:
            ApiKeys.from_file(str(bad))
        assert expect in str(exc.value) and ALICE not in str(exc.value), str(exc.value)
        assert "\n" not in str(exc.value)

    def line(*argv) -> str:
        with pytest.raises(SystemExit) as exc:
            main(list(argv))
        text = str(exc.value.code)
        assert text.startswith("rlmill: ") and "\n" not in text and "Traceback" not in text, text
        return text

    monkeypatch.delenv("RLMILL_API_KEYS", raising=False)
    assert "no API keys are set" in line("serve", "--host", "0.0.0.0", "--port", "0", "--redis", "none")
    assert "not valid YAML" in line("serve", "--host", "0.0.0.0", "--api-keys", str(bad), "--port", "0")
    assert "--rate-limit -1 is negative" in line("serve", "--rate-limit", "-1", "--port", "0")
    assert "--max-body-bytes 0 is below 1" in line("serve", "--max-body-bytes", "0", "--port", "0")


def test_a_new_key_and_its_digest_line(tmp_path, capsys):
    """`python -m gpu_jobs.online.auth`: the key goes to a new 0600 file, the keys file gets its digest."""
    import os
    import stat

    from gpu_jobs.online.auth import main as new_key

    keys = tmp_path / "keys.yaml"
    new_key(["web", "query", "feedback", "--asserts-users", "--key-out", str(tmp_path / "web.key")])
    keys.write_text(capsys.readouterr().out)
    os.chmod(keys, 0o600)
    key = (tmp_path / "web.key").read_text().strip()
    assert stat.S_IMODE(os.stat(tmp_path / "web.key").st_mode) == 0o600 and key not in keys.read_text()
    web = ApiKeys.from_file(str(keys)).lookup(key)
    assert (web.name, sorted(web.roles), web.asserts_users) == ("web", ["feedback", "query"], True)
    with pytest.raises(SystemExit, match="give a new file"):  # never overwrites a key
        new_key(["web", "query", "--key-out", str(tmp_path / "web.key")])
    # --keys-file: the line appended to a file made 0600 (what the serving guide runs), never to an open one
    made = tmp_path / "made.yaml"
    new_key(["web", "query", "--key-out", str(tmp_path / "a.key"), "--keys-file", str(made)])
    new_key(["graf", "metrics", "--key-out", str(tmp_path / "b.key"), "--keys-file", str(made)])
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o600
    both = ApiKeys.from_file(str(made))
    assert both.lookup((tmp_path / "a.key").read_text().strip()).name == "web"
    assert both.lookup((tmp_path / "b.key").read_text().strip()).name == "graf"
    os.chmod(made, 0o644)
    with pytest.raises(SystemExit, match="chmod 600"):
        new_key(["web", "query", "--key-out", str(tmp_path / "c.key"), "--keys-file", str(made)])
    assert not (tmp_path / "c.key").exists()

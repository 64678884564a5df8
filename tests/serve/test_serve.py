"""rlmill serve and rlmill feedback: the OpenAI-compatible API on the built-in model, batching,
feedback checks, and the broker (a real redis-server) into committed Parquet segments, exactly
once across a consumer killed between commit and ack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from gpu_jobs.online.answers import new_answer_id
from gpu_jobs.online.app import Server, ServeSettings, create_app
from gpu_jobs.online.broker import STREAM, EventPublisher
from gpu_jobs.online.events import encode, feedback_event

REPO = Path(__file__).resolve().parents[2]
CHAT = {"model": "builtin", "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 6, "temperature": 0}


def _sse(text: str) -> list:
    lines = [ln[len("data: "):] for ln in text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_completions_and_chat_over_http(served, redis_url, run_app):
    # a wait far longer than any XADD: every answer below goes out after its event is in redis
    server = Server(served, EventPublisher(redis_url), ServeSettings(event_wait_ms=60_000))
    with run_app(server) as base, httpx.Client(base_url=base, timeout=60) as http:
        models = http.get("/v1/models").json()
        assert models["data"][0]["id"] == "builtin" and models["data"][0]["version"] == served.version
        first = http.post("/v1/completions", json={"model": "builtin", "prompt": "12+34=", "max_tokens": 4,
                                                   "temperature": 0})
        assert first.headers["x-rlmill-event"] == "logged"
        r = first.json()
        assert r["id"].startswith("cmpl-") and r["object"] == "text_completion"
        assert r["choices"][0]["text"] == "46" and r["choices"][0]["finish_reason"] == "stop"  # the model adds
        assert r["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}  # "46" + EOS
        c = http.post("/v1/chat/completions", json={**CHAT, "n": 2, "user": "u1"}).json()
        assert c["id"].startswith("chatcmpl-") and c["object"] == "chat.completion" and len(c["choices"]) == 2
        assert c["choices"][1]["message"] == {"role": "assistant", "content": "46"}
        stopped = http.post("/v1/completions", json={"prompt": "12+34=", "temperature": 0, "stop": "6"}).json()
        assert stopped["choices"][0]["text"] == "4" and stopped["usage"]["completion_tokens"] == 1
        chunks = _sse(http.post("/v1/chat/completions", json={**CHAT, "stream": True,
                                                               "stream_options": {"include_usage": True}}).text)
        assert {ch["object"] for ch in chunks} == {"chat.completion.chunk"} and len({ch["id"] for ch in chunks}) == 1
        assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"]) == "46"
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"]["completion_tokens"] == 3
        text = _sse(http.post("/v1/completions", json={"prompt": "12+34=", "temperature": 0, "stream": True}).text)
        assert "".join(ch["choices"][0]["text"] for ch in text) == "46" and text[0]["id"].startswith("cmpl-")
        bad = http.post("/v1/completions", json={"prompt": "1+1=", "presence_penalty": 0.5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "presence_penalty"
        assert http.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 0}).json()["error"]["param"] == \
            "max_tokens"
        assert http.post("/v1/completions", json={"model": "gpt-4", "prompt": "1+1="}).status_code == 404
    server.close()
    stats = server.publisher.stats()
    assert stats["published"] == stats["logged"] == 5 and stats["dropped"] == stats["buffered"] == 0, stats


def test_concurrent_requests_are_batched(served, run_app):
    server = Server(served, None, ServeSettings(max_batch=16, batch_wait_ms=300))
    results = {}
    body = lambda i: {"prompt": f"{10 + i}+{20 + i}=", "max_tokens": 4, "temperature": 0}  # noqa: E731
    with run_app(server) as base:
        def ask(i: int) -> None:
            results[i] = httpx.post(f"{base}/v1/completions", json=body(i), timeout=60).json()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    stats = {k.removeprefix("batcher_"): v for k, v in server.models.stats().items() if k.startswith("batcher_")}
    server.close()
    assert len(results) == 8 and all(r["object"] == "text_completion" for r in results.values())
    assert len({r["id"] for r in results.values()}) == 8
    assert stats["requests"] == 8 and stats["batches"] < 8, stats  # one generate call per batch
    alone = TestClient(create_app(Server(served, None)))  # each request got its own prompt's answer back
    for i, r in results.items():
        assert alone.post("/v1/completions", json=body(i)).json()["choices"] == r["choices"]


def test_feedback_checks(served):
    server = Server(served, None, ServeSettings(retention_hours=24))
    client = TestClient(create_app(server))
    answer = client.post("/v1/chat/completions", json=CHAT).json()["id"]
    ok = client.post("/v1/feedback", json={"answer_id": answer, "thumbs": "up", "user": "u1"})
    assert ok.status_code == 200 and ok.json()["answer_id"] == answer and ok.json()["logged"] is False
    assert ok.headers["x-rlmill-event"] == "off"
    unknown = client.post("/v1/feedback", json={"answer_id": new_answer_id("chatcmpl"), "score": 1})
    assert unknown.status_code == 404 and "no answer" in unknown.json()["error"]["message"]
    for body, field in (({"answer_id": answer, "score": 1.5}, "score"), ({"answer_id": answer, "thumbs": "meh"}, "thumbs"),
                        ({"score": 0.5}, "answer_id"), ({"answer_id": answer, "colour": "red"}, "colour")):
        r = client.post("/v1/feedback", json=body)
        assert r.status_code == 422 and r.json()["error"]["param"] == field, r.json()
        assert "\n" not in r.json()["error"]["message"] and field in r.json()["error"]["message"]
    none = client.post("/v1/feedback", json={"answer_id": answer})
    assert none.status_code == 422 and "give one of score" in none.json()["error"]["message"]
    old = client.post("/v1/feedback", json={"answer_id": new_answer_id("chatcmpl", at=time.time() - 30 * 3600),
                                            "score": 1})
    assert old.status_code == 410 and "24 h" in old.json()["error"]["message"], old.json()
    server.close()


def _consume(root, redis_url, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "RLMILL_FAILPOINT"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "flows.cli", "feedback", "consume", "--root", str(root),
                           "--redis", redis_url], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_every_answer_and_feedback_lands_exactly_once(served, redis_url, tmp_path):
    import redis

    from gpu_jobs.online.dataset import read_segments, training_rows, write_training_dataset
    from storage.datasets import read_prompts

    server = Server(served, EventPublisher(redis_url))
    client = TestClient(create_app(server))
    ids = [client.post("/v1/chat/completions", json={**CHAT, "n": 2}).json()["id"],
           client.post("/v1/completions", json={"prompt": "3+4=", "max_tokens": 4}).json()["id"],
           client.post("/v1/chat/completions", json={**CHAT, "temperature": 1.0, "seed": 3}).json()["id"]]
    feedback = [{"answer_id": ids[0], "score": 0.25}, {"answer_id": ids[0], "index": 1, "thumbs": "up"},
                {"answer_id": ids[2], "preferred_over": ids[0], "text": "better"}, {"answer_id": ids[1], "thumbs": "down"}]
    for body in feedback:
        assert client.post("/v1/feedback", json=body).status_code == 200
    assert server.publisher.flush(10)
    r = redis.Redis.from_url(redis_url)
    first = json.loads(r.xrange(STREAM, count=1)[0][1][b"event"])
    r.xadd(STREAM, encode(first))  # a publisher retry whose first reply was lost: the same event twice
    r.xadd(STREAM, encode({**feedback_event(ids[1], model="builtin", version="v"), "score": 2.0}))
    r.xadd(STREAM, encode(feedback_event(new_answer_id("cmpl"), model="builtin", version="v", thumbs="up")))
    r.xadd(STREAM, encode({**feedback_event(ids[1], model="builtin", version="v", score=1.0), "version": None}))
    server.close()

    root = tmp_path / "store"
    killed = _consume(root, redis_url, {"RLMILL_FAILPOINT": "feedback:after-commit"})
    assert killed.returncode == -9, killed.stdout + killed.stderr  # between commit and XACK
    assert r.xpending(STREAM, "rlmill-feedback")["pending"] == 11  # nothing acked
    again = _consume(root, redis_url)
    assert again.returncode == 0 and "11 events read: 0 answers and 0 feedback" in again.stdout, again.stdout
    assert "11 duplicate(s) skipped" in again.stdout and r.xpending(STREAM, "rlmill-feedback")["pending"] == 0

    answers, fb = read_segments(str(root), "builtin")
    assert sorted({a["answer_id"] for a in answers}) == sorted(ids) and len(answers) == 4  # n=2 -> 2 rows
    assert len({a["event_id"] for a in answers}) == 3 and len(fb) == 4 == len({f["event_id"] for f in fb})
    assert all(a["version"] == served.version and a["token_ids"] and len(a["logprobs"]) == len(a["token_ids"])
               for a in answers)
    quarantined = list((root / "feedback" / "_quarantine").rglob("quarantine-*.parquet"))
    import pyarrow.parquet as pq

    reasons = sorted(pq.read_table(quarantined[0])["reason"].to_pylist())
    assert len(quarantined) == 1 and len(reasons) == 3, reasons
    assert "no version" in reasons and any("outside [0, 1]" in x for x in reasons) and \
        any("never logged" in x for x in reasons)

    rows = training_rows(str(root), "builtin")
    by = {(x["extra_info"]["answer_id"], x["extra_info"]["index"]): x for x in rows}
    assert by[(ids[0], 0)]["reward"] == 0.25 and by[(ids[0], 1)]["reward"] == 1.0 and by[(ids[1], 0)]["reward"] == 0.0
    assert by[(ids[2], 0)]["extra_info"]["preferred_over"] == [f"{ids[0]}#0"]
    assert by[(ids[0], 0)]["extra_info"]["rejected_for"] == [f"{ids[2]}#0"]
    out = tmp_path / "feedback.parquet"
    assert write_training_dataset(str(root), "builtin", str(out)) == 4
    df = read_prompts(str(out))
    assert df.loc[0, "prompt"][0]["role"] == "user" and df.loc[0, "data_source"] == "rlmill/feedback/builtin"
    assert set(df["reward_model"].iloc[0]) == {"style", "ground_truth"}


def test_broker_down_serve_answers_and_counts_drops(served, caplog):
    from tests.servers import free_port

    publisher = EventPublisher(f"redis://127.0.0.1:{free_port()}/0", max_queue=2, timeout_s=0.2)
    # the first answer waits for its first XADD to fail (no timing involved), the others see the broker down
    server = Server(served, publisher, ServeSettings(event_wait_ms=60_000))
    client = TestClient(create_app(server))
    status = []
    for i in range(6):
        r = client.post("/v1/completions", json={"prompt": f"{i}+1=", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200
        status.append(r.headers["x-rlmill-event"])
    metrics = dict(line.split() for line in client.get("/metrics").text.splitlines())
    # one event held by the publisher thread (retrying), two queued, the other three dropped and counted
    assert status == ["buffered"] * 3 + ["dropped"] * 3, status
    assert metrics["rlmill_serve_events_dropped_total"] == "3" and metrics["rlmill_serve_events_queued"] == "2"
    assert metrics["rlmill_serve_events_buffered_total"] == "3" and metrics["rlmill_serve_events_logged_total"] == "0"
    assert int(metrics["rlmill_serve_events_send_errors_total"]) >= 1
    assert any("dropped 1 event" in rec.getMessage() for rec in caplog.records)
    publisher.close(0.5)
    server.models.close()
    assert publisher.stats()["dropped"] == 6  # closing with the broker still down: none of them was sent


def test_serve_a_promoted_model_and_the_cli_user_errors(tmp_path, redis_url):
    import shutil

    from flows.cli import main
    from gpu_jobs.models import resolve_model_path
    from gpu_jobs.online.model import load_served_model
    from storage import ModelLayout

    layout = ModelLayout(str(tmp_path), "arith")
    shutil.copytree(resolve_model_path("builtin"), layout.version("v7"))
    layout.promote("v7")
    model = load_served_model("arith", str(tmp_path))
    assert (model.name, model.version) == ("arith", "v7")
    model.close()

    def line(*argv) -> str:
        with pytest.raises(SystemExit) as exc:
            main(list(argv))
        text = str(exc.value.code)
        assert text.startswith("rlmill: ") and "\n" not in text and "Traceback" not in text, text
        return text

    assert "no promoted model 'nope'" in line("serve", "--model", "nope", "--root", str(tmp_path), "--redis", "none",
                                              "--port", "0")
    assert "registered models there: arith" in line("serve", "--model", "nope", "--root", str(tmp_path),
                                                     "--redis", "none", "--port", "0")
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert "cannot listen on 127.0.0.1" in line("serve", "--port", str(taken.getsockname()[1]))
    from tests.servers import free_port

    assert "--watch-s -1 is negative" in line("serve", "--watch-s", "-1", "--port", "0")
    assert "--event-wait-ms nan is negative" in line("serve", "--event-wait-ms", "nan", "--port", "0")
    dead = f"redis://127.0.0.1:{free_port()}/0"
    assert "does not answer" in line("serve", "--port", "0", "--redis", dead)
    assert "does not answer" in line("feedback", "consume", "--root", str(tmp_path), "--redis", dead)


def test_a_slow_broker_buffers_and_sends_later(redis_url):
    """A broker that does not answer within the wait (a stopped redis-server): the answer goes out
    counted as buffered, and the event reaches the stream once the broker answers again."""
    import asyncio
    import signal

    import redis

    client = redis.Redis.from_url(redis_url)
    pid = int(client.info("server")["process_id"])
    publisher = EventPublisher(redis_url, timeout_s=60)  # slow, not failing: no send error
    event = feedback_event(new_answer_id("cmpl"), model="builtin", version="v", thumbs="up")
    os.kill(pid, signal.SIGSTOP)
    try:
        status = asyncio.run(publisher.publish_async(event, wait_s=0.2))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert status == "buffered"
    assert publisher.flush(60), "gave up after 60 s waiting for the buffered event to be sent"
    stats = publisher.stats()
    assert (stats["buffered"], stats["logged"], stats["published"], stats["send_errors"]) == (1, 0, 1, 0), stats
    assert [json.loads(f[b"event"])["event_id"] for _, f in client.xrange(STREAM)] == [event["event_id"]]
    publisher.close()

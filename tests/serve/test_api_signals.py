"""SIGTERM as a container runtime sends it, to real processes: `rlmill serve` finishes the request in
flight, sends its event to a real redis-server and exits 0; `rlmill feedback consume --follow`
commits and acknowledges what it read and exits 0 on SIGTERM and on SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.servers import free_port, stop_process

REPO = Path(__file__).resolve().parents[2]
GROUP, STREAM = "rlmill-feedback", "rlmill:events"


def _start(*argv: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RLMILL_FAILPOINT", "RLMILL_API_KEYS")}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *argv], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _until(check, proc: subprocess.Popen, what: str, limit_s: float = 120) -> None:
    """Poll `check` until it is true; fail (with the process's output) if the process ends first."""
    deadline = time.monotonic() + limit_s
    while not check():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise AssertionError(f"{what} never happened; the process said: {proc.stdout.read()}")
        time.sleep(0.05)


def _metric(base: str, name: str) -> float | None:
    try:
        text = httpx.get(f"{base}/metrics", timeout=5).text
    except httpx.TransportError:
        return None
    return next((float(v) for k, v in (ln.split() for ln in text.splitlines()) if k == name), None)


def _consumers(client) -> set[str]:
    try:
        return {c["name"].decode() for c in client.xinfo_consumers(STREAM, GROUP)}
    except Exception:  # no stream or group yet
        return set()


def _all_acked(client) -> bool:
    g = {g["name"].decode(): g for g in client.xinfo_groups(STREAM)}.get(GROUP)
    return g is not None and g["pending"] == 0 and g["lag"] == 0


def test_serve_drains_on_sigterm_and_consume_stops_on_signals(redis_url, tmp_path):
    import redis

    from gpu_jobs.serve.dataset import read_segments

    client = redis.Redis.from_url(redis_url)
    root, port = tmp_path / "store", free_port()
    base = f"http://127.0.0.1:{port}"
    # two followers of the group (started first: their start-up overlaps the server's), one to be
    # stopped by SIGTERM, one by SIGINT
    consumers = {sig: _start("feedback", "consume", "--follow", "--root", str(root), "--redis", redis_url,
                             "--linger-ms", "0", "--consumer", sig.name) for sig in (signal.SIGTERM, signal.SIGINT)}
    # a batch collects for 3 s after its first request: that request is in flight when SIGTERM comes
    serve = _start("serve", "--port", str(port), "--redis", redis_url, "--batch-wait-ms", "3000", "--grace-s", "30")
    try:
        _until(lambda: _metric(base, "rlmill_serve_in_flight") == 0, serve, "serve answering /metrics")
        got = {}
        asking = threading.Thread(target=lambda: got.update(r=httpx.post(
            f"{base}/v1/completions", json={"prompt": "12+34=", "max_tokens": 4, "temperature": 0}, timeout=120)))
        asking.start()
        _until(lambda: _metric(base, "rlmill_serve_in_flight") == 1, serve, "a request in flight")
        serve.send_signal(signal.SIGTERM)
        asking.join(120)
        out, _ = serve.communicate(timeout=120)
        assert serve.returncode == 0, out
        assert "SIGTERM: drained and stopped (1 answers; 1 events sent, 0 dropped)" in out, out
        answer = got["r"]
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "46"
        logged = [json.loads(f[b"event"]) for _, f in client.xrange(STREAM)]
        assert [e["answer_id"] for e in logged] == [answer.json()["id"]] and logged[0]["principal"] is None

        for sig, proc in consumers.items():
            _until(lambda: sig.name in _consumers(client), proc, f"consumer {sig.name} reading the stream")
        _until(lambda: _all_acked(client), consumers[signal.SIGTERM], "the stream committed and acknowledged")
        for sig, proc in consumers.items():
            proc.send_signal(sig)
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out
            assert f"rlmill: {sig.name}: stopped after committing" in out and "Traceback" not in out, out
    finally:
        for proc in (serve, *consumers.values()):
            stop_process(proc)
    answers, _ = read_segments(str(root), "builtin")
    assert [a["answer_id"] for a in answers] == [answer.json()["id"]]

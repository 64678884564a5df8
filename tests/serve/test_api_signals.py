"""SIGTERM as a container runtime sends it, to real processes: `rlmill serve` finishes the request in
flight, sends its event to a real redis-server and exits 0; `rlmill feedback consume --follow`
commits and acknowledges what it read and exits 0. SIGINT (Ctrl-C) to consume, in this process:
the same handler, without the cost of a third process start."""

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


def test_serve_drains_and_consume_stops_on_sigterm(redis_url, tmp_path):
    import redis

    from gpu_jobs.online.dataset import read_segments

    client = redis.Redis.from_url(redis_url)
    root, port = tmp_path / "store", free_port()
    base = f"http://127.0.0.1:{port}"
    # the follower is started first: its start-up overlaps the server's
    consumers = {sig: _start("feedback", "consume", "--follow", "--root", str(root), "--redis", redis_url,
                             "--linger-ms", "0", "--consumer", sig.name) for sig in (signal.SIGTERM,)}
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
        assert "rlmill: SIGTERM: drained and stopped (1 answers; 1 events sent, 0 dropped)" in out, out
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


def test_consume_stops_on_sigint(redis_url, tmp_path, capsys):
    import redis

    from flows.cli import main

    client = redis.Redis.from_url(redis_url)

    def interrupt() -> None:  # once the consumer reads (its handler is installed by then), Ctrl-C
        deadline = time.monotonic() + 60
        while "ctrl-c" not in _consumers(client) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    main(["feedback", "consume", "--follow", "--root", str(tmp_path / "store"), "--redis", redis_url,
          "--linger-ms", "0", "--consumer", "ctrl-c"])
    out = capsys.readouterr().out
    assert "rlmill: SIGINT: stopped after committing" in out and "0 events read" in out, out
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back

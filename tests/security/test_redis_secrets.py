"""A Redis password never appears in what rlmill prints, logs or returns as a failure message;
it can stay out of URLs altogether (RLMILL_REDIS_PASSWORD)."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

# Imported here, at collection, not inside a test: Prefect binds its log handlers to the sys.stderr
# of the moment it is first imported, and a test's capfd stream is closed after that test, which
# broke every later Prefect test in the same worker ("I/O operation on closed file").
import flows.online.feedback  # noqa: F401
from tests.servers import free_port, stop_process

SECRET = "s3cr3t-b41ls-0ut"


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed: bash scripts/ensure_test_tools.sh installs it")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--requirepass", SECRET,
                             "--dir", str(tmp_path_factory.mktemp("redis"))], stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    try:
        yield port
    finally:
        stop_process(proc)


def test_the_password_is_redacted_and_can_come_from_the_environment(locked_redis, monkeypatch, tmp_path, capfd, caplog):
    from flows.online.feedback import check_inputs
    from gpu_jobs.online.broker import BrokerUnreachable, EventPublisher, connect
    from gpu_jobs.online.consumer import consume

    port = locked_redis
    wrong = f"redis://:wrong-{SECRET}@127.0.0.1:{port}/0"
    with pytest.raises(BrokerUnreachable) as refused:
        connect(wrong)
    assert SECRET not in str(refused.value) and f"127.0.0.1:{port}" in str(refused.value)
    dead = f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"  # nothing listens there
    with pytest.raises(BrokerUnreachable) as gone:
        consume(str(tmp_path), dead)
    assert SECRET not in str(gone.value)
    publisher = EventPublisher(dead, timeout_s=0.2)
    publisher.publish({"kind": "answer"})
    time.sleep(0.5)
    publisher.close(0.2)
    logged = capfd.readouterr().err + caplog.text  # stderr, or the root logger under pytest-xdist
    assert "event broker redis://127.0.0.1" in logged and SECRET not in logged + publisher.url
    assert SECRET not in (check_inputs(".rlmill", f"http://:{SECRET}@host", 1.0, "c") or "")

    monkeypatch.setenv("RLMILL_REDIS_PASSWORD", SECRET)
    assert connect(f"redis://127.0.0.1:{port}/0").ping()  # the URL holds no password
    result = consume(str(tmp_path), f"redis://127.0.0.1:{port}/0")
    assert result.read == 0


@pytest.mark.parametrize("url", [f"redis://:{SECRET}@127.0.0.1:6379/0", f"redis://rlmill:{SECRET}@127.0.0.1:6379/0",
                                 f"redis://127.0.0.1:6379/0?password={SECRET}"])
def test_a_password_inside_a_given_url_is_refused_with_the_pointer(url, monkeypatch, tmp_path):
    """A URL given as a flag or a flow parameter shows in process listings and the Prefect UI:
    one line pointing at RLMILL_REDIS_PASSWORD, the password not in it, nothing started."""
    import argparse

    from flows.cli_serve import _publisher, cmd_feedback_consume
    from flows.online.feedback import check_inputs
    from flows.user_errors import UserError

    line = check_inputs(".rlmill", url, 1.0, "c")
    assert "RLMILL_REDIS_PASSWORD" in line and SECRET not in line and line.startswith("redis_url 'redis://127.0.0.1")
    consume_args = argparse.Namespace(root=str(tmp_path), redis=url, consumer="c", follow=False, linger_ms=0.0)
    for command in (lambda: cmd_feedback_consume(consume_args), lambda: _publisher(url, 10)):  # consume, serve
        with pytest.raises(UserError) as refused:
            command()
        said = str(refused.value)
        assert said.startswith("--redis 'redis://127.0.0.1:6379/0' holds a password") and SECRET not in said
        assert "RLMILL_REDIS_PASSWORD" in said and "\n" not in said
    assert check_inputs(".rlmill", "redis://rlmill@127.0.0.1:6379/0", 1.0, "c") is None  # a user name is fine


def test_make_serves_redis_asks_for_its_password(tmp_path):
    """scripts/serve_redis.sh (what `make serve` runs): a redis-server that refuses a client
    without the generated password, whose ACL reaches only rlmill:* keys and no FLUSHALL; the
    password and the event key 0600; started once (a second call finds it), stopped by its PID."""
    import os
    import stat

    import redis

    from gpu_jobs.online.broker import BrokerUnreachable, connect

    repo = __import__("pathlib").Path(__file__).resolve().parents[2]
    port, state = free_port(), tmp_path / "state"
    script = ["bash", str(repo / "scripts" / "serve_redis.sh"), str(port), str(state), str(repo / ".venv/bin/python")]
    first = subprocess.run(script, capture_output=True, text=True, timeout=60, cwd=repo)
    try:
        assert first.returncode == 0 and "started redis-server" in first.stdout, first.stdout + first.stderr
        password = (state / "redis.password").read_text()
        for name in ("redis.password", "event.key", "redis.conf"):
            assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
        again = subprocess.run(script, capture_output=True, text=True, timeout=60, cwd=repo)
        assert again.returncode == 0 and "started" not in again.stdout and "RLMILL_REDIS_PASSWORD_FILE" in again.stdout
        assert password not in first.stdout + again.stdout + " ".join(script)
        url = f"redis://127.0.0.1:{port}/0"
        with pytest.raises(BrokerUnreachable, match="asks for a password; set RLMILL_REDIS_PASSWORD"):
            connect(url)
        client = redis.Redis(port=port, password=password)
        assert client.xadd("rlmill:events", {"event": "{}"}) and client.xlen("rlmill:events") == 1
        for denied in (lambda: client.flushall(), lambda: client.set("elsewhere", 1)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                denied()
    finally:
        pid = state / "redis.pid"
        if pid.exists():
            os.kill(int(pid.read_text()), 15)

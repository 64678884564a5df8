"""A Redis password never appears in what rlmill prints, logs or returns as a failure message;
it can stay out of URLs altogether (RLMILL_REDIS_PASSWORD)."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

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

"""The sandbox that runs users' rewards, tools and environments: what a hostile file can reach.

Each check is a user's file doing the bad thing through the real entry points (score_batch for
a reward, ToolSet for a tool): reading the parent's secrets, leaving a grandchild behind a
timeout, allocating 8 GB, reaching a local service, burning CPU, writing a huge file.
"""

from __future__ import annotations

import json
import os
import socket
import textwrap
import time

import pytest

from gpu_jobs.chat.tools import ToolSet
from gpu_jobs.reward import RewardConfig, score_batch
from gpu_jobs.reward import sandbox

HOSTILE = textwrap.dedent(
    '''
    import json, os, socket, subprocess, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        what = solution_str
        if what == "environ":
            with open("/proc/self/environ", "rb") as f:
                raw = f.read().decode(errors="replace")
            return {"score": 1.0, "environ": json.dumps(dict(os.environ)), "raw": raw, "home": os.environ["HOME"]}
        if what == "allocate":
            block = bytearray(8 << 30)      # 8 GB
            return {"score": 1.0, "len": len(block)}
        if what == "connect":
            socket.create_connection(("127.0.0.1", int(ground_truth)), timeout=5).close()
            return 1.0
        if what == "spin":
            while True:
                pass
        if what == "big_file":
            with open(os.path.join(os.environ["TMPDIR"], "big"), "wb") as f:
                f.write(b"x" * (3 << 20))
            return 1.0
        return 0.5

    def leave_a_sleeper(arguments):
        sleeper = subprocess.Popen(["sleep", "300"])
        with open(arguments, "w") as f:
            f.write(str(sleeper.pid))
        time.sleep(300)

    def read_env(arguments):
        return json.dumps(dict(os.environ))
    '''
)


@pytest.fixture
def hostile(tmp_path):
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE)
    return str(path)


def _score(path: str, what: str, ground_truth: str = "", **cfg):
    cfg = RewardConfig(custom_reward_function={"path": path}, num_workers=1, **{"timeout_s": 20.0, **cfg})
    scores, extras, _ = score_batch([{"data_source": "x/y", "solution_str": what, "ground_truth": ground_truth}], cfg)
    return scores[0], extras[0]


def _gone(pid: int, within_s: float = 15.0) -> bool:
    """The process is dead (or a zombie waiting for its new parent to reap it)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_reward_sees_none_of_the_parents_secrets(hostile, secrets, monkeypatch):
    planted = {"AWS_ACCESS_KEY_ID": secrets.key, "AWS_SECRET_ACCESS_KEY": secrets.secret,
               "AWS_SESSION_TOKEN": secrets.token, "RLMILL_REDIS_PASSWORD": secrets.secret + "r",
               "RLMILL_EVENT_KEY": secrets.token + "e"}
    for k, v in planted.items():
        monkeypatch.setenv(k, v)
    score, extra = _score(hostile, "environ")
    assert score == 1.0, extra
    seen = json.loads(extra["environ"])
    assert not set(planted) & set(seen), seen
    for value in planted.values():  # nor in the process's initial environment block
        assert value not in extra["raw"] and value not in extra["environ"]
    assert extra["home"] != os.environ.get("HOME") and "rlmill-sandbox-" in extra["home"]
    assert seen["PATH"]  # what a program needs is still there


def test_a_tool_sees_none_of_the_parents_secrets(hostile, secrets, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secrets.secret)
    [text] = ToolSet([f"{hostile}:read_env"]).run([("read_env", "")])
    assert "AWS_SECRET_ACCESS_KEY" not in json.loads(text) and secrets.secret not in text


def test_a_timeout_kills_the_grandchildren_too(hostile, tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    [text] = ToolSet([f"{hostile}:leave_a_sleeper"], timeout_s=3.0, num_workers=1).run(
        [("leave_a_sleeper", str(pid_file))])
    assert text.startswith("error:") and "longer than" in text
    pid = int(pid_file.read_text())
    assert _gone(pid), f"the tool's grandchild {pid} outlived the timeout"


def test_allocating_8_gb_fails_inside_the_limit(hostile):
    score, extra = _score(hostile, "allocate", sandbox={"memory_mb": 1024})
    assert score == 0.0 and extra["error_kind"] == "exception" and "MemoryError" in extra["error"]
    score, extra = _score(hostile, "allocate")  # the default limit (4 GiB) holds as well
    assert "MemoryError" in extra["error"]


def test_no_network_in_the_worker(hostile):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = str(server.getsockname()[1])
        score, extra = _score(hostile, "connect", port)
        if sandbox.network_unavailable():
            pytest.skip(f"this OS gives the workers no network namespace: {sandbox.network_unavailable()}")
        assert score == 0.0 and "Network is unreachable" in extra["error"], extra
        score, extra = _score(hostile, "connect", port, sandbox={"network": True})  # the key turns it back on
        assert score == 1.0, extra


def test_cpu_and_file_size_limits(hostile):
    score, extra = _score(hostile, "spin", timeout_s=60.0, sandbox={"cpu_s": 1})
    assert score == 0.0 and "CPU time limit" in extra["error"], extra
    score, extra = _score(hostile, "big_file", sandbox={"file_size_mb": 1})
    assert score == 0.0 and "File too large" in extra["error"], extra
    assert _score(hostile, "fine")[0] == 0.5

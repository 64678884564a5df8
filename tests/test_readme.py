"""The README's S3 demo (write/read a table and a checkpoint on s3://) runs as written."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.servers import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.s3
def test_readme_s3_demo_runs_against_a_local_moto_server():
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- readme-s3-demo -->\n```bash\n(.*?)```", text, re.S).group(1)
    port = str(free_port())
    script = block.replace("5555", port)
    from gpu_jobs.train.dist import child_env

    env = {k: v for k, v in child_env().items() if not k.startswith("AWS_")}
    proc = subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the moto server, should `kill %1` not have
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out
    lines = [ln for ln in out.strip().splitlines() if "Loading weights" not in ln and ln.strip()]
    assert lines[-3] == "s3://demo-bucket/runs/demo/iterations/1/rollout/_MANIFEST.json", out
    assert lines[-2] == "[{'uid': 'a', 'response_ids': [1, 2]}, {'uid': 'b', 'response_ids': [3]}]", out
    assert lines[-1] == "True", out

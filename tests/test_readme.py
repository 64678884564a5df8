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
    """...and cleans up after itself: its AWS_* exports and its moto server end with the block."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- readme-s3-demo -->\n```bash\n(.*?)```", text, re.S).group(1)
    port = str(free_port())
    # What the user's shell holds after pasting the block: no exports, nothing on the port.
    after = (f'\nsleep 1; echo "after: AWS_ACCESS_KEY_ID=${{AWS_ACCESS_KEY_ID:-unset}} '
             f'AWS_ENDPOINT_URL=${{AWS_ENDPOINT_URL:-unset}}"\n'
             f'if (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null; then echo "after: moto up"; '
             f'else echo "after: moto stopped"; fi\n')
    script = block.replace("5555", port) + after
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
    assert "after: AWS_ACCESS_KEY_ID=unset AWS_ENDPOINT_URL=unset" in out and "after: moto stopped" in out, out
    lines = [ln for ln in out.strip().splitlines()
             if "Loading weights" not in ln and ln.strip() and not ln.startswith("after: ")]
    assert lines[-3] == "s3://demo-bucket/runs/demo/iterations/1/rollout/_MANIFEST.json", out
    assert lines[-2] == "[{'uid': 'a', 'response_ids': [1, 2]}, {'uid': 'b', 'response_ids': [3]}]", out
    assert lines[-1] == "True", out

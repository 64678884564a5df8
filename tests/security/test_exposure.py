"""What the packaged setups expose: the image's user, run.sh's podman flags, the cluster's bind
addresses. Cheap checks of the real scripts and service tables (the image build and `make
cluster` themselves are long and run in `make e2e` / by hand: docs/guide/image.md, cluster.md).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_image_runs_as_a_user_of_its_own():
    text = (ROOT / "deployments" / "Containerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    assert users and users[-1] not in ("root", "0"), users
    assert re.search(rf"useradd [^\n]*--uid 10001 [^\n]*{users[-1]}\b", text)
    assert text.index("USER ") < text.index("ENTRYPOINT")


def _fake_bin(tmp_path: Path, uid: str) -> Path:
    """podman that prints its run arguments, id that says `uid`: run.sh as that caller."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "podman").write_text('#!/bin/sh\n[ "$1" = image ] && exit 0\necho "$@"\n')
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("uid, expected", [("0", ".rlmill:/app/.rlmill:U "), ("1000", "keep-id:uid=10001,gid=10001")])
def test_run_sh_gives_the_container_user_its_folder(tmp_path, uid, expected):
    bin_dir = _fake_bin(tmp_path, uid)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "image" / "run.sh"), "run"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout + " ", out.stdout
    assert ("keep-id" in out.stdout) == (uid != "0")


def test_the_cluster_binds_prefect_and_s3_to_its_own_subnet():
    from deployments.cluster.services import SERVICES, address

    env = {"RLMILL_CLUSTER_SUBNET": "10.231.0", "PREFECT_API_URL": "http://10.231.0.10:4200/api"}
    api_env = dict(env)
    api = SERVICES["api"](api_env)
    s3 = SERVICES["s3"](dict(env))["s3"]
    assert api_env["RLMILL_SERVER_HOST"] == address("api", env) == "10.231.0.10"
    assert s3[s3.index("--host") + 1] == address("s3", env) == "10.231.0.11"
    assert "0.0.0.0" not in " ".join([*api["prefect-server"], *s3, *api_env.values()])

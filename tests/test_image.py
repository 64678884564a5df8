"""rlmill's container image (make image, docs/guide/image.md): its scripts refuse bad setups with one
line, and `rlmill run` inside the built image prints the table `make run` prints on this machine.

    .venv/bin/python -m pytest -q tests/test_image.py               # the refusals (seconds)
    .venv/bin/python -m pytest -q tests/test_image.py -m e2e        # the run in the image

Building the image is not part of any test: ~20 min the first time on 2 cores (debootstrap, the
pinned stack, ~6 GB), ~1-2 min after a code change. The e2e test is skipped, saying so, when the
image is not built.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"localhost/rlmill:{VERSION}"
ITERATIONS = 10  # of make run's 20: validations after 5 and 10 (the test's docstring says why)
RUN_LIMIT_S = 1200  # one `rlmill run` on a busy 2-core machine is ~2-4 min; this only stops a hang


def _image_built() -> bool:
    if shutil.which("podman") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["podman", "image", "exists", IMAGE], capture_output=True, timeout=60).returncode == 0


def summary_rows(out: str) -> list[str]:
    """The rows of `rlmill run`'s closing table that one machine repeats exactly: the accuracies,
    the change and the iteration count; not the run id, the seconds or the curves' path.

    >>> summary_rows("held-out mean score (val/acc), before RL    37.3 %\\n"
    ...              "  after iteration 5 (12 s training)         45.7 %  (+8.3)\\n"
    ...              "training wall time (s)                    42.1")
    ['held-out mean score (val/acc), before RL 37.3 %', 'after iteration 5: 45.7 % (+8.3)']
    """
    rows = []
    for line in out.splitlines():
        if line.startswith(("held-out mean score", "change ", "iterations ")):
            rows.append(" ".join(line.split()))
        elif m := re.match(r"\s+after iteration (\d+) \(\d+ s training\)\s+(.*)$", line):
            rows.append(f"after iteration {m[1]}: {' '.join(m[2].split())}")
    return rows


def _run(cmd: list[str], cwd: Path, what: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}  # a live port would clash
    env.update(PYTHONUNBUFFERED="1", GX_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               PREFECT_SERVER_ANALYTICS_ENABLED="false")  # as the Makefile exports them
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what} did not end within {RUN_LIMIT_S} s; its output so far:\n{exc.stdout}\n{exc.stderr}")
    assert done.returncode == 0, f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_build_refuses_a_checkout_without_its_environment(tmp_path):
    """No .venv behind the checkout (or, on a machine without them, no debootstrap/podman/buildah):
    one `rlmill:` line that says what to do, exit 2, before any download or mount."""
    (tmp_path / "scripts" / "image").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "image" / "build.sh", tmp_path / "scripts" / "image" / "build.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    done = subprocess.run(["bash", "scripts/image/build.sh"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "RLMILL_CACHE_DIR": str(tmp_path / "cache")}, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlmill: "), done.stderr
    if os.geteuid() != 0:
        assert "root" in lines[0]
    elif all(shutil.which(c) for c in ("debootstrap", "podman", "buildah")):
        assert "run make venv first" in lines[0]
    else:
        assert "apt-get install" in lines[0]
    assert "Traceback" not in done.stderr and not (tmp_path / "cache" / "image").exists()


@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed (apt-get install -y podman)")
def test_run_refuses_an_image_not_built(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "image" / "run.sh"), "run"], cwd=tmp_path, text=True,
                          capture_output=True, env={**os.environ, "RLMILL_IMAGE": "localhost/rlmill-absent:none"},
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == ("rlmill: no image localhost/rlmill-absent:none here: build it with make image "
                                   "(bash scripts/image/build.sh)")
    assert not (tmp_path / ".rlmill").exists()  # refused before anything was made


@pytest.mark.e2e
@pytest.mark.skipif(not _image_built(), reason=f"{IMAGE} is not built here (make image: ~20 min the first time, "
                                               "needs root, podman, buildah and debootstrap)")
def test_rlmill_run_in_the_image_prints_make_runs_table(tmp_path):
    """`make run`'s command (rlmill run) here and in the container: the same accuracies at every
    validation, to the digit. The image holds the same package versions (constrained to .venv's),
    the same built-in model (baked from this machine's cache) and the same CPU, and a run repeats
    exactly on one machine (docs/index.md, "Quick start"); a difference means the image computes
    something else. 10 of make run's 20 iterations (two validations after the first): the whole
    run on both sides took 8.5 min of this test on a busy 2-core machine, and the 20-iteration
    tables were compared by hand (docs/guide/image.md). Both runs write under tmp_path (the
    container's ./.rlmill mounted)."""
    host_dir, image_dir = tmp_path / "host", tmp_path / "image"
    host_dir.mkdir()
    image_dir.mkdir()
    args = ["run", f"trainer.total_iterations={ITERATIONS}"]
    host = _run([sys.executable, "-m", "flows.cli", *args], host_dir, "make run's command on this machine")
    inside = _run(["bash", str(ROOT / "scripts" / "image" / "run.sh"), *args], image_dir, f"rlmill run in {IMAGE}")
    host_rows, image_rows = summary_rows(host), summary_rows(inside)
    assert any(r.startswith("held-out mean score (val/acc), after RL") for r in host_rows), host
    assert any(r.startswith(f"after iteration {ITERATIONS}:") for r in host_rows), host
    assert image_rows == host_rows, f"host:\n{host}\nimage:\n{inside}"
    runs = list((image_dir / ".rlmill" / "runs").iterdir())  # the container's run, on this machine
    assert len(runs) == 1 and (runs[0] / "report" / "curves.png").is_file(), runs


@pytest.mark.e2e
@pytest.mark.skipif(not _image_built(), reason=f"{IMAGE} is not built here (make image)")
def test_the_image_runs_rlmill_and_its_own_programs(tmp_path):
    """The entrypoint: `IMAGE config show` is rlmill's command; a program of the image runs as
    itself, as a Prefect worker's Kubernetes job needs (`prefect ...` arrives as the container's
    args); the code is the checkout's, at /app, the working folder."""
    run = ["bash", str(ROOT / "scripts" / "image" / "run.sh")]
    assert "total_iterations" in _run([*run, "config", "show"], tmp_path, "rlmill config show in the image")
    assert "3.7.7" in _run([*run, "prefect", "version"], tmp_path, "prefect version in the image")
    where = _run([*run, "python", "-c", "import os, flows; print(flows.__file__, os.getcwd())"], tmp_path,
                 "python in the image")
    assert where.split() == ["/app/flows/__init__.py", "/app"]

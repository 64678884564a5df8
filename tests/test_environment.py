"""Environments: every clone's .venv runs its own code while sharing the cached pinned stack
(scripts/ensure_venv.sh), and rlmill installs as a plain wheel that works outside the repository.

    .venv/bin/python -m pytest -q tests/test_environment.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "gpu_jobs", "storage", "deployments")
# What ensure_venv.sh and `pip install -e .` read from a clone.
CLONE_FILES = ("pyproject.toml", "README.md", "scripts", *PACKAGES)


def _shared_env() -> Path:
    """The shared environment the repository's .venv is layered on (or, in the layout of earlier
    versions, a symlink to)."""
    venv = REPO / ".venv"
    marker = venv / ".rlmill-shared"
    if marker.is_file():
        return Path(marker.read_text().strip())
    if venv.is_symlink():
        return venv.resolve()
    pytest.skip(".venv was not made by scripts/ensure_venv.sh (run `make`)")


def _clone(dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in CLONE_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def _ensure_venv(clone: Path, cache: Path) -> None:
    env = {**os.environ, "RLMILL_VENV_CACHE": str(cache), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "scripts/ensure_venv.sh"], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "building environment" not in proc.stdout  # reused the shared stack, built nothing


def _run(exe: Path, *args: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.e2e  # installs: two clones' environments (make e2e, docs/testing.md)
def test_two_clones_each_run_their_own_code(tmp_path):
    shared = _shared_env()
    hashed = subprocess.run([sys.executable, "scripts/deps.py", "--hash"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.strip()
    if shared.name != hashed or not (shared / ".complete").exists():
        pytest.skip(f"the shared environment for these pins ({hashed}) is not built: run `make`")
    cache = shared.parent
    listing = sorted(os.listdir(shared / "bin"))
    one, two = _clone(tmp_path / "one"), _clone(tmp_path / "two")
    for clone, name in ((one, "one"), (two, "two")):
        (clone / "flows" / "__init__.py").write_text(f'CLONE = "{name}"\n')
        _ensure_venv(clone, cache)
    _ensure_venv(one, cache)  # `make` again in the first clone changes nothing in the second

    neutral = tmp_path / "elsewhere"  # not a clone: nothing importable from the working directory
    neutral.mkdir()
    probe = "import flows, torch, prefect; print(flows.CLONE, flows.__file__)"
    for clone, name in ((one, "one"), (two, "two")):
        bin_dir = clone / ".venv" / "bin"
        said = _run(bin_dir / "python", "-c", probe, cwd=neutral).split()
        assert said == [name, str(clone / "flows" / "__init__.py")]
        assert "usage: rlmill" in _run(bin_dir / "rlmill", "--help", cwd=neutral)
        # The shared commands run this clone's interpreter, hence this clone's code.
        for command in ("prefect", "torchrun", "pip"):
            assert (bin_dir / command).read_text().splitlines()[0] == f"#!{bin_dir / 'python'}", command
    # The shared environment was only read: same commands, no rlmill of either clone in it.
    assert sorted(os.listdir(shared / "bin")) == listing
    site = subprocess.run([str(shared / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert not any(str(tmp_path) in p.read_text(errors="ignore") for p in Path(site).glob("__editable__*"))


@pytest.mark.e2e  # an install: a wheel built and installed outside the checkout
def test_a_wheel_installs_and_runs_outside_the_repository(tmp_path):
    src = _clone(tmp_path / "src")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("rlmill-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in PACKAGES:  # every package, with every module of the source tree
        modules = {str(p.relative_to(REPO)) for p in (REPO / pkg).rglob("*.py") if "__pycache__" not in p.parts}
        assert modules <= set(names), sorted(modules - set(names))
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "rlmill = flows.cli:entry" in entry_points

    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    check = f"""
import importlib, pkgutil
for top in {PACKAGES!r}:
    pkg = importlib.import_module(top)
    assert pkg.__file__.startswith({str(site)!r}), pkg.__file__
    for m in pkgutil.walk_packages(pkg.__path__, top + "."):
        importlib.import_module(m.name)
# `rlmill run`'s config is built in: no examples/ folder is needed.
from flows.cli import DEFAULT_RUN_CONFIG, as_overrides
from flows.config import load_run_config
cfg = load_run_config(None, as_overrides(DEFAULT_RUN_CONFIG))
print("ok", cfg.data.train_batch_size, cfg.trainer.total_iterations)
"""
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", check], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-3:] == ["ok", "64", "20"]
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "config", "show", "trainer.total_iterations=3"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "total_iterations: 3" in proc.stdout, proc.stderr[-3000:]

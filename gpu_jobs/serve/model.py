"""The model a server answers with: the promoted version of a registered model, or the built-in one.

    served = load_served_model("arith", root="s3://bucket/rl", backend="hf")   # models/arith/CURRENT
    served = load_served_model(None)                                            # the built-in model
    served.name, served.version, served.engine, served.tokenizer, served.max_context
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelNotServable", "ServedModel", "load_served_model", "registered_models"]

BUILTIN = "builtin"


class ModelNotServable(ValueError):
    """The model asked for is not registered or has no promoted version; the message says which
    models are and how to promote one."""


@dataclass
class ServedModel:
    name: str
    version: str
    path: str  # local HF folder
    tokenizer: Any
    engine: Any  # a gpu_jobs.rollout RolloutEngine
    max_context: int

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


def registered_models(root: str, storage=None) -> list[str]:
    """Names under <root>/models/ that have a CURRENT pointer."""
    from storage import join, url_to_fs

    fs, path = url_to_fs(join(root, "models"), storage)
    if not fs.exists(path):
        return []
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    return [n for n in names if fs.exists(f"{path.rstrip('/')}/{n}/CURRENT")]


def resolve_served(name: str | None, root: str | None, storage=None) -> tuple[str, str, str]:
    """(name, version, model path or URL) of what to serve; ModelNotServable when there is none."""
    if name is None or name == BUILTIN:
        from gpu_jobs.models import resolve_model_path

        path = resolve_model_path(BUILTIN)
        return BUILTIN, os.path.basename(path.rstrip("/")), path
    if root is None:
        raise ModelNotServable(f"--model {name} needs --root, the storage root its promoted versions live under")
    from storage import ModelLayout
    from storage.errors import InvalidNameError

    try:
        layout = ModelLayout(root, name, storage)
    except InvalidNameError as exc:
        raise ModelNotServable(str(exc)) from None
    version = layout.current_version()
    if version is None:
        known = ", ".join(registered_models(root, storage)) or "none"
        raise ModelNotServable(f"no promoted model {name!r} under {root} (models/{name}/CURRENT is missing; "
                               f"registered models there: {known}): the nightly flow promotes one, or serve the "
                               "built-in model by leaving out --model")
    return name, version, layout.version(version)


def load_served_model(name: str | None, root: str | None = None, *, backend: str = "hf",
                      options: Any = None, storage=None) -> ServedModel:
    """Resolve, download if remote, and build the rollout engine and tokenizer (seconds to minutes)."""
    from transformers import AutoTokenizer

    from gpu_jobs.models import resolve_model_path
    from gpu_jobs.rollout import RolloutEngineConfig
    from gpu_jobs.rollout.data_parallel import build_rollout_engine

    name, version, where = resolve_served(name, root, storage)
    path = resolve_model_path(where, storage)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = build_rollout_engine(backend, path, options or RolloutEngineConfig(), storage=storage)
    return ServedModel(name, version, path, tokenizer, engine, _max_context(path, tokenizer))


def _max_context(path: str, tokenizer) -> int:
    try:
        with open(os.path.join(path, "config.json")) as f:
            n = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        n = None
    return int(n or getattr(tokenizer, "model_max_length", 2048) or 2048)

"""The model a server answers with: the promoted version of a registered model, or the built-in one.

    served = load_served_model("arith", root="s3://bucket/rl", backend="hf")   # models/arith/CURRENT
    served = load_served_model(None)                                            # the built-in model
    served.name, served.version, served.engine, served.tokenizer, served.max_context

    source = ModelSource("arith", "s3://bucket/rl")     # what hot swap (swap.py) watches and loads
    source.current_version()                            # 'v8': what CURRENT points to now
    served = source.load("v8")                          # that version, whatever CURRENT says by then
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelNotServable", "ModelSource", "ServedModel", "load_served_model", "registered_models"]

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
    vocab_size: int | None = None  # the embedding's rows (config.json); None: the tokenizer's size

    @property
    def vocab(self) -> int:
        """Token ids a prompt may hold are [0, vocab): known to both the embedding and the tokenizer."""
        return min(self.vocab_size or len(self.tokenizer), len(self.tokenizer))

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


@dataclass(frozen=True)
class ModelSource:
    """Where a served model's versions come from: a registered model under `root`, or the
    built-in model (name None or "builtin", one version, nothing to watch)."""

    name: str | None
    root: str | None = None
    backend: str = "hf"
    options: Any = None  # a gpu_jobs.rollout RolloutEngineConfig; None = its defaults
    storage: Any = None

    @property
    def builtin(self) -> bool:
        return self.name is None or self.name == BUILTIN

    def _layout(self):
        from storage import ModelLayout
        from storage.errors import InvalidNameError

        if self.root is None:
            raise ModelNotServable(f"--model {self.name} needs --root, the storage root its promoted versions "
                                   "live under")
        try:
            return ModelLayout(self.root, self.name, self.storage)
        except InvalidNameError as exc:
            raise ModelNotServable(str(exc)) from None

    def current_version(self) -> str | None:
        """What models/<name>/CURRENT points to now (None when it is missing); the built-in
        model's one version."""
        return self.resolve()[1] if self.builtin else self._layout().current_version()

    def resolve(self, version: str | None = None) -> tuple[str, str, str]:
        """(name, version, model path or URL) of `version`, or of the promoted one when None;
        ModelNotServable when there is none."""
        if self.builtin:
            from gpu_jobs.models import resolve_model_path

            path = resolve_model_path(BUILTIN)
            return BUILTIN, os.path.basename(path.rstrip("/")), path
        layout = self._layout()
        version = version or layout.current_version()
        if version is None:
            known = ", ".join(registered_models(self.root, self.storage)) or "none"
            raise ModelNotServable(f"no promoted model {self.name!r} under {self.root} (models/{self.name}/CURRENT "
                                   f"is missing; registered models there: {known}): the nightly flow promotes one, "
                                   "or serve the built-in model by leaving out --model")
        return self.name, version, layout.version(version)

    def load(self, version: str | None = None) -> ServedModel:
        """Resolve, download if remote, and build the rollout engine and tokenizer (seconds to
        minutes). Raises whatever a broken version folder raises (OSError, ValueError, ...)."""
        from transformers import AutoTokenizer

        from gpu_jobs.models import resolve_model_path
        from gpu_jobs.rollout import RolloutEngineConfig
        from gpu_jobs.rollout.data_parallel import build_rollout_engine

        name, version, where = self.resolve(version)
        path = resolve_model_path(where, self.storage)
        tokenizer = AutoTokenizer.from_pretrained(path)
        engine = build_rollout_engine(self.backend, path, self.options or RolloutEngineConfig(), storage=self.storage)
        return ServedModel(name, version, path, tokenizer, engine, _max_context(path, tokenizer),
                           _config_int(path, "vocab_size"))


def load_served_model(name: str | None, root: str | None = None, *, backend: str = "hf",
                      options: Any = None, storage=None) -> ServedModel:
    """The promoted version of `name` (the built-in model when None), loaded (see ModelSource.load)."""
    return ModelSource(name, root, backend, options, storage).load()


def _config_int(path: str, key: str) -> int | None:
    try:
        with open(os.path.join(path, "config.json")) as f:
            n = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        n = None
    return int(n) if isinstance(n, int) and n > 0 else None


def _max_context(path: str, tokenizer) -> int:
    n = _config_int(path, "max_position_embeddings")
    return int(n or getattr(tokenizer, "model_max_length", 2048) or 2048)

"""LoRA adapters (peft) on the policy: build, merge, save as a small folder, load merged.

    spec = LoraSpec(rank=8, alpha=16, target_modules="all-linear", base="builtin", base_seed=0)
    model = apply_lora(hf_model, spec)        # PeftModel: only lora_A/lora_B require grad
    weights = merged_state_dict(model)        # HF names, W + B @ A * alpha / rank (fp32 copies)
    tensors = adapter_tensors(model)          # what an adapter checkpoint stores (peft's names)

An adapter checkpoint folder (written by ``storage.save_adapter``) holds peft's own
``adapter_config.json`` + ``adapter_model.safetensors``, the tokenizer, and ``rlmill_base.json``:
the base model it applies to, as the run named it (an alias, a folder or a storage URL, maybe
itself an adapter folder). Every rlmill reader that loads a policy for inference goes through
``gpu_jobs.models.loading``: ``read_state_dict`` (a rollout engine's weight reload) merges in
memory (``merge_adapter_tensors``); ``resolve_model_path`` (building an engine, evaluation, a
run starting from a promoted adapter) gets a plain HF folder from ``merge_adapter_folder``
(peft's merge_and_unload, cached by content hash).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.checkpoints import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_POINTER  # the folder's file names

__all__ = ["LoraSpec", "lora_spec_of", "apply_lora", "merged_state_dict", "adapter_tensors", "adapter_scaling",
           "merge_adapter_tensors", "adapter_config_dict", "BASE_POINTER", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS",
           "is_adapter_folder", "read_base_pointer", "merge_adapter_folder", "prune_merged"]

ADAPTER_NAME = "default"  # peft's name of the one adapter a policy carries


@dataclass(frozen=True)
class LoraSpec:
    """What the trainer needs to put an adapter on the policy, and the base it records."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...]
    base: str  # the run's model.path: alias, folder or storage URL
    base_seed: int = 0  # model.seed: which built-in model "builtin" is

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def pointer(self) -> dict[str, Any]:
        return {"path": self.base, "seed": self.base_seed}


def lora_spec_of(model_cfg: Any) -> LoraSpec | None:
    """The LoraSpec of a run's `model` section (None when lora_rank is 0)."""
    rank = getattr(model_cfg, "lora_rank", 0)
    if not rank:
        return None
    targets = model_cfg.target_modules
    return LoraSpec(rank=rank, alpha=float(model_cfg.lora_alpha),
                    target_modules=targets if isinstance(targets, str) else tuple(targets),
                    base=model_cfg.path, base_seed=model_cfg.seed)


def apply_lora(model: Any, spec: LoraSpec) -> Any:
    """Wrap an HF causal LM in a peft LoRA model: every base weight frozen, lora_A initialised
    from torch's global RNG (seed it first), lora_B zero, so the model starts equal to the base.
    Raises ValueError naming the fix when a target module is not in the model."""
    from peft import LoraConfig, get_peft_model

    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    cfg = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets, lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, cfg)
    except ValueError as e:
        raise ValueError(f"model.target_modules={spec.target_modules!r} does not fit this model ({e}); use "
                         "'all-linear' or names of its nn.Linear layers, e.g. [q_proj, v_proj]") from None


def _lora_layers(peft_model: Any) -> dict[str, Any]:
    """{HF module name: peft LoraLayer} of the wrapped model."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


def _hf_name(peft_param_name: str) -> str:
    return peft_param_name.replace(".base_layer.", ".")


def merged_state_dict(peft_model: Any) -> dict[str, Any]:
    """Full fp32 weights with HF names, every LoRA layer merged: ``W + (B @ A) * alpha / r``
    (``W`` ``(out, in)``, ``B`` ``(out, r)``, ``A`` ``(r, in)``). New tensors: the trainer's
    base weights are never touched (merging in place and back would not be bitwise exact)."""
    import torch

    base = peft_model.get_base_model()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in base.named_parameters():
            if ".lora_" not in name:
                out[_hf_name(name)] = p.detach().to(torch.float32, copy=True).cpu()
        for name, layer in _lora_layers(peft_model).items():
            w = layer.get_base_layer().weight
            delta = layer.get_delta_weight(ADAPTER_NAME)
            out[f"{name}.weight"] = (w.detach().float() + delta.detach().float()).cpu()
        keys = set(base.state_dict())
        for name, b in base.named_buffers():
            if name in keys:
                out[_hf_name(name)] = b.detach().to(torch.float32, copy=True).cpu()
    return out


def adapter_scaling(adapter_config: dict[str, Any]) -> float:
    """The factor on B @ A from peft's adapter_config.json: lora_alpha / r (/ sqrt(r) with
    rsLoRA). Per-module rank/alpha patterns are refused: rlmill never writes them."""
    import math

    if adapter_config.get("rank_pattern") or adapter_config.get("alpha_pattern"):
        raise ValueError("an adapter with per-module rank_pattern/alpha_pattern: merge it with peft's "
                         "merge_and_unload instead")
    r, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    return alpha / math.sqrt(r) if adapter_config.get("use_rslora") else alpha / r


def merge_adapter_tensors(base: dict[str, Any], adapter: dict[str, Any], scaling: float) -> dict[str, Any]:
    """``base`` (HF names) with ``W + (B @ A) * scaling`` for every adapted weight, fp32.

    ``adapter`` holds peft's saved names: ``base_model.model.<module>.lora_A.weight`` ``(r, in)``
    and ``...lora_B.weight`` ``(out, r)``; ``W`` is ``base["<module>.weight"]`` ``(out, in)``.
    Raises ValueError when an adapted module is not in ``base`` (an adapter of another model)."""
    import torch

    out = dict(base)
    suffix = ".lora_A.weight"
    for key, a in adapter.items():
        if not key.endswith(suffix):
            continue
        prefix = key[: -len(suffix)]
        name = prefix.removeprefix("base_model.model.") + ".weight"
        if name not in base:
            raise ValueError(f"the adapter changes {name}, which the base model does not have: "
                             "its rlmill_base.json points at another model")
        b = adapter[prefix + ".lora_B.weight"]
        with torch.no_grad():
            out[name] = base[name].float() + (b.float() @ a.float()) * scaling
    return out


def adapter_tensors(peft_model: Any) -> dict[str, Any]:
    """The adapter's tensors under peft's file names (what ``PeftModel.from_pretrained`` reads),
    fp32 CPU copies."""
    import torch
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, adapter_name=ADAPTER_NAME)
    return {k: v.detach().to(torch.float32, copy=True).cpu().contiguous() for k, v in state.items()}


def adapter_config_dict(peft_model: Any, base_folder: str) -> dict[str, Any]:
    """peft's adapter_config.json content; base_model_name_or_path is the local base folder so
    plain peft/transformers load it on this machine (rlmill follows BASE_POINTER instead)."""
    cfg = peft_model.peft_config[ADAPTER_NAME]
    data = cfg.to_dict()
    data["base_model_name_or_path"] = base_folder
    return json.loads(json.dumps(data, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def is_adapter_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, BASE_POINTER)) and os.path.isfile(os.path.join(folder, ADAPTER_CONFIG))


def read_base_pointer(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, BASE_POINTER)) as f:
        return json.load(f)


def _folder_key(folder: str, base: str) -> str:
    """Hash of an adapter folder's files (contents) and of the base folder it merges into (path,
    file names, sizes and modification times: a rebuilt base gives a new merged folder)."""
    h = hashlib.sha256(os.path.abspath(base).encode())
    for entry in sorted(os.scandir(base), key=lambda e: e.name):
        if entry.is_file():
            st = entry.stat()
            h.update(f"{entry.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    for name in sorted(os.listdir(folder)):
        if name.startswith(".") or not os.path.isfile(os.path.join(folder, name)):
            continue
        h.update(name.encode())
        with open(os.path.join(folder, name), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:20]


# Merged folders are a cache: each adapter a run publishes (every checkpoint, every promoted
# version) gets one, and nothing else would ever delete them. The newest MERGED_KEEP stay, and
# none used (built or returned) in the last MERGED_IDLE_S: a process between resolving a folder
# and loading it never finds it gone.
MERGED_KEEP = 8
MERGED_IDLE_S = 3600.0


def merge_adapter_folder(folder: str, base: str) -> str:
    """A plain HF folder holding the local HF folder `base` + the adapter at `folder` merged, for
    from_pretrained / vLLM; built once per adapter content under <cache>/merged-<hash>, the
    cache pruned to the MERGED_KEEP most recently used.
    (gpu_jobs.models.loading resolves `base` from the folder's pointer first.)"""
    from gpu_jobs.models.build import build_once, default_cache_dir

    final = Path(default_cache_dir()) / f"merged-{_folder_key(folder, base)}"
    path = build_once(final, lambda tmp: _merge_into(base, folder, tmp))
    os.utime(final)  # used now: the pruning below goes by last use
    prune_merged(final.parent)
    return path


def prune_merged(cache: Path, keep: int = MERGED_KEEP, idle_s: float = MERGED_IDLE_S) -> list[Path]:
    """Delete the merged-* folders of `cache` beyond the `keep` most recently used, sparing any
    used in the last `idle_s` seconds; returns what was deleted."""
    import time

    folders = sorted((p for p in cache.glob("merged-*") if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    now, gone = time.time(), []
    for old in folders[keep:]:
        try:
            if now - old.stat().st_mtime > idle_s:
                shutil.rmtree(old)
                gone.append(old)
        except FileNotFoundError:  # another process pruned it first
            pass
    return gone


def _merge_into(base: str, adapter: str, out: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    # Keep where it came from next to the weights: a merged folder is an export, not a source.
    shutil.copy(os.path.join(adapter, BASE_POINTER), out / "rlmill_merged_from.json")

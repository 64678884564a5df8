"""safetensors checkpoints as Hugging Face folders, on any storage URL.

A folder holds config.json, the tokenizer files, `model-0000k-of-0000N.safetensors` shards and
`model.safetensors.index.json`. The index is the folder's manifest (storage.manifest.commit,
kind "checkpoint"): written LAST and create-only, it lists every file with its size and sha256
beside HF's own `weight_map` and `metadata`, so `from_pretrained` and vLLM read it as an HF index
and every rlmill read checks the files with the one verifier. A folder without it is not a
checkpoint. torch is imported lazily.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from typing import TYPE_CHECKING, Any, Mapping

from .config import StorageConfig
from .errors import CorruptShardError
from .fs import is_local, redact_url, url_to_fs
from .layout import check_name
from .manifest import (
    Manifest,
    commit,
    copy_committed,
    download_file,
    ensure_uncommitted,
    read_file,
    read_manifest,
    write_files,
)

if TYPE_CHECKING:
    import torch

__all__ = ["INDEX_NAME", "CHECKPOINT_KIND", "save_checkpoint", "load_state_dict", "download_checkpoint",
           "read_index", "copy_checkpoint", "save_adapter", "is_adapter_checkpoint", "ADAPTER_WEIGHTS",
           "ADAPTER_CONFIG", "BASE_POINTER"]

INDEX_NAME = "model.safetensors.index.json"
CHECKPOINT_KIND = "checkpoint"
_COMPLETE_MARKER = ".rlmill-complete"
# A LoRA policy folder: peft's file names, plus the base it applies to (gpu_jobs.models.lora).
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
BASE_POINTER = "rlmill_base.json"


def _prepare(state_dict: Mapping[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """CPU, contiguous tensors, no two sharing storage (safetensors refuses shared storage,
    e.g. tied embeddings): every tensor after the first on a storage is cloned."""
    seen: set[int] = set()
    out = {}
    for name, t in state_dict.items():
        t = t.detach().cpu()
        if t.numel() > 0:
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
            seen.add(ptr)
        out[name] = t.contiguous()
    return out


def _plan_shards(tensors: Mapping[str, "torch.Tensor"], shard_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _config_bytes(config: Any) -> bytes:
    if hasattr(config, "to_json_string"):  # transformers.PretrainedConfig
        return config.to_json_string(use_diff=False).encode()
    if isinstance(config, Mapping):
        return json.dumps(dict(config), indent=2, sort_keys=True).encode()
    raise TypeError(f"config must be a dict or a transformers PretrainedConfig, got {type(config).__name__}")


def _tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    if tokenizer is None:
        return {}
    with tempfile.TemporaryDirectory(prefix="rlmill-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        files = {}
        for dirpath, _, names in os.walk(tmp):
            for name in names:
                full = os.path.join(dirpath, name)
                with open(full, "rb") as f:
                    files[os.path.relpath(full, tmp)] = f.read()
        return files


def save_checkpoint(
    dest_url: str,
    state_dict: Mapping[str, "torch.Tensor"],
    *,
    config: Any,
    tokenizer: Any = None,
    extra_files: Mapping[str, bytes] | None = None,
    shard_bytes: int = 64 << 20,
    storage: StorageConfig | None = None,
) -> str:
    """Save an HF folder at `dest_url` and commit it by writing the index last; returns dest_url.

    Raises ManifestExistsError if a checkpoint is already committed there. Peak extra memory is
    about one shard (shards are serialised and uploaded one at a time). HF fixes the file names,
    so unlike a table's they are not fresh: two writers racing to one URL can overwrite each
    other's shards; the index's create-only write picks one, and the verifier catches the rest.
    """
    import safetensors.torch

    ensure_uncommitted(dest_url, "a checkpoint", storage, name=INDEX_NAME)
    small = {"config.json": _config_bytes(config), **_tokenizer_files(tokenizer)}
    for name, data in (extra_files or {}).items():
        for segment in name.split("/"):
            check_name(segment, "extra file name")
        small[name] = data
    files = write_files(dest_url, small, storage)

    tensors = _prepare(state_dict)
    groups = _plan_shards(tensors, shard_bytes)
    weight_map = {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        data = safetensors.torch.save({k: tensors[k] for k in names}, metadata={"format": "pt"})
        files += write_files(dest_url, {fname: data}, storage)
        weight_map.update({k: fname for k in names})
    hf_index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                "weight_map": weight_map}
    commit(dest_url, files, kind=CHECKPOINT_KIND, extra=hf_index, name=INDEX_NAME, storage=storage)
    return dest_url


def save_adapter(
    dest_url: str,
    tensors: Mapping[str, "torch.Tensor"],
    *,
    adapter_config: Mapping[str, Any],
    base: Mapping[str, Any],
    tokenizer: Any = None,
    storage: StorageConfig | None = None,
) -> str:
    """Save a LoRA policy folder at `dest_url`: peft's adapter_config.json and
    adapter_model.safetensors (`tensors`, peft's names), the tokenizer, and rlmill_base.json
    (`base`: the model it applies to, e.g. {"path": "builtin", "seed": 0}). Committed like a full
    checkpoint (the index last, create-only, every file with its sha256; the index's weight_map
    names the adapter's tensors and `lora` holds `base`), so read_index, copy_checkpoint and
    download_checkpoint work on it as they are; returns dest_url."""
    import safetensors.torch

    ensure_uncommitted(dest_url, "a checkpoint", storage, name=INDEX_NAME)
    small = {ADAPTER_CONFIG: json.dumps(dict(adapter_config), indent=2, sort_keys=True).encode(),
             BASE_POINTER: json.dumps(dict(base), sort_keys=True).encode(), **_tokenizer_files(tokenizer)}
    prepared = _prepare(tensors)
    small[ADAPTER_WEIGHTS] = safetensors.torch.save(prepared, metadata={"format": "pt"})
    files = write_files(dest_url, small, storage)
    hf_index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in prepared.values())},
                "weight_map": {k: ADAPTER_WEIGHTS for k in prepared}, "lora": dict(base)}
    commit(dest_url, files, kind=CHECKPOINT_KIND, extra=hf_index, name=INDEX_NAME, storage=storage)
    return dest_url


def is_adapter_checkpoint(src_url: str, storage: StorageConfig | None = None) -> bool:
    """Whether the committed checkpoint at `src_url` is a LoRA adapter folder (save_adapter)."""
    return "lora" in read_index(src_url, storage).extra


def read_index(src_url: str, storage: StorageConfig | None = None) -> Manifest:
    """The checkpoint's index (its manifest; `extra["weight_map"]` is HF's), checked for
    consistency; NotCommittedError if there is none."""
    manifest = read_manifest(src_url, storage, name=INDEX_NAME, kind=CHECKPOINT_KIND)
    shards = set(manifest.extra.get("weight_map", {}).values())
    unlisted = sorted(shards - {f.path for f in manifest.files})
    if not shards or unlisted:
        raise CorruptShardError(f"{redact_url(manifest.uri)}: the weight_map's shards {sorted(shards)[:5]} "
                                "are not all listed with their sha256 (edited or not written by rlmill)")
    return manifest


def load_state_dict(src_url: str, storage: StorageConfig | None = None) -> dict[str, "torch.Tensor"]:
    """Load a committed checkpoint's tensors, one shard in memory at a time, verified."""
    import safetensors.torch

    index = read_index(src_url, storage)
    shards = set(index.extra["weight_map"].values())
    out: dict[str, torch.Tensor] = {}
    for f in index.files:
        if f.path in shards:
            out.update(safetensors.torch.load(read_file(index, f, storage)))
    missing = set(index.extra["weight_map"]) - set(out)
    if missing:
        raise CorruptShardError(f"{redact_url(src_url)}: tensors in the index but in no shard: {sorted(missing)[:5]}")
    return out


def copy_checkpoint(src_url: str, dest_url: str, storage: StorageConfig | None = None) -> str:
    """Copy a committed HF folder to `dest_url` (e.g. a promoted model version); returns dest_url.

    Every file is verified against the source's index before the copy's index is committed
    (create-only), so the version is either absent or complete and intact. A source without an
    index raises NotCommittedError; an already committed destination is left as it is.
    """
    read_index(src_url, storage)  # a checkpoint, not another kind of commit
    copy_committed(src_url, dest_url, storage, name=INDEX_NAME)
    return dest_url


def _cache_dir(src_url: str) -> str:
    base = os.environ.get("RLMILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "rlmill")
    key = hashlib.sha256(redact_url(src_url).rstrip("/").encode()).hexdigest()[:20]
    return os.path.join(base, "checkpoints", key)


def _is_complete(local_dir: str, index_sha: str) -> bool:
    try:
        with open(os.path.join(local_dir, _COMPLETE_MARKER)) as f:
            return f.read().strip() == index_sha
    except OSError:
        return False


def _fetch_into(index: Manifest, dest: str, storage: StorageConfig | None) -> None:
    for f in index.files:  # each file verified as it lands
        download_file(index, f, os.path.join(dest, *f.path.split("/")), storage)
    with open(os.path.join(dest, INDEX_NAME), "wb") as f:
        f.write(index.to_json())
    with open(os.path.join(dest, _COMPLETE_MARKER), "w") as f:
        f.write(index.sha256)


def download_checkpoint(src_url: str, local_dir: str | None = None, storage: StorageConfig | None = None) -> str:
    """A local folder holding the committed checkpoint, for from_pretrained / vLLM.

    A local source with no `local_dir` is returned as is (it is already a loadable folder).
    Otherwise files go to `local_dir`, or to a cache folder keyed by the URL's hash
    ($RLMILL_CACHE_DIR or ~/.cache/rlmill), reused when a previous download completed.
    """
    index = read_index(src_url, storage)
    fs, root = url_to_fs(src_url, storage)
    if local_dir is None and is_local(fs):
        return root
    if local_dir is not None:
        if not _is_complete(local_dir, index.sha256):
            os.makedirs(local_dir, exist_ok=True)
            _fetch_into(index, local_dir, storage)
        return local_dir
    final = _cache_dir(src_url)
    if _is_complete(final, index.sha256):
        return final
    # Download beside the final folder, then rename: a crash never leaves a half folder that
    # looks complete, and concurrent downloaders do not write into each other's files.
    tmp = f"{final}.tmp-{uuid.uuid4().hex}"
    os.makedirs(tmp)
    try:
        _fetch_into(index, tmp, storage)
        if os.path.isdir(final) and not _is_complete(final, index.sha256):
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final, index.sha256):  # lost a race to a complete copy: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final

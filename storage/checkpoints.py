"""safetensors checkpoints as Hugging Face folders, on any storage URL.

A folder holds config.json, the tokenizer files, `model-0000k-of-0000N.safetensors` shards and
`model.safetensors.index.json`, which is written LAST and create-only: it is the commit marker,
and a folder without it is not a checkpoint. The index also records each shard's size and
sha256 (under the extra key "rlmill"), which loads verify. torch is imported lazily.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from typing import TYPE_CHECKING, Any, Mapping

from .config import StorageConfig
from .errors import CorruptShardError, ManifestExistsError, NotCommittedError, ObjectExistsError
from .fs import create_only, is_local, join, redact_url, url_to_fs
from .layout import check_name

if TYPE_CHECKING:
    import torch

__all__ = ["INDEX_NAME", "save_checkpoint", "load_state_dict", "download_checkpoint", "read_index"]

INDEX_NAME = "model.safetensors.index.json"
_COMPLETE_MARKER = ".rlmill-complete"
CHECKPOINT_FORMAT = "rlmill.checkpoint/1"


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
    about one shard (shards are serialised and uploaded one at a time).
    """
    import safetensors.torch

    fs, root = url_to_fs(dest_url, storage)
    index_path = join(root, INDEX_NAME)
    if fs.exists(index_path):
        raise ManifestExistsError(f"{redact_url(join(dest_url, INDEX_NAME))} exists: checkpoint already committed")
    small = {"config.json": _config_bytes(config), **_tokenizer_files(tokenizer)}
    for name, data in (extra_files or {}).items():
        for segment in name.split("/"):
            check_name(segment, "extra file name")
        small[name] = data
    fs.pipe({join(root, name): data for name, data in small.items()})

    tensors = _prepare(state_dict)
    groups = _plan_shards(tensors, shard_bytes)
    weight_map, files = {}, {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        data = safetensors.torch.save({k: tensors[k] for k in names}, metadata={"format": "pt"})
        fs.pipe_file(join(root, fname), data)
        files[fname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        weight_map.update({k: fname for k in names})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": weight_map,
        "rlmill": {"format": CHECKPOINT_FORMAT, "files": files,
                   "created_at": dt.datetime.now(dt.timezone.utc).isoformat()},
    }
    try:
        create_only(fs, index_path, json.dumps(index, indent=1).encode(), url=join(dest_url, INDEX_NAME))
    except ObjectExistsError:
        raise ManifestExistsError(f"{redact_url(dest_url)} was committed by another writer first") from None
    return dest_url


def read_index(src_url: str, storage: StorageConfig | None = None) -> dict[str, Any]:
    """The checkpoint's index, checked for consistency; NotCommittedError if there is none."""
    fs, root = url_to_fs(src_url, storage)
    return _check_index(_read_index_bytes(fs, root, src_url), src_url)[0]


def _read_index_bytes(fs: Any, root: str, src_url: str) -> bytes:
    try:
        return fs.cat_file(join(root, INDEX_NAME))
    except FileNotFoundError:
        raise NotCommittedError(
            f"no {INDEX_NAME} at {redact_url(src_url)}: not a committed checkpoint"
        ) from None


def _check_index(data: bytes, src_url: str) -> tuple[dict[str, Any], list[str]]:
    index = json.loads(data)
    shards = sorted(set(index.get("weight_map", {}).values()))
    listed = set(index.get("rlmill", {}).get("files", shards))
    if not shards or set(shards) != listed:
        raise CorruptShardError(f"{redact_url(src_url)}/{INDEX_NAME}: weight_map and file list disagree")
    n = len(shards)
    expected = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    if all(s.startswith("model-") for s in shards) and shards != expected:
        raise CorruptShardError(f"{redact_url(src_url)}/{INDEX_NAME}: lists {shards}, expected {expected}")
    return index, shards


def _fetch_shard(fs: Any, root: str, src_url: str, fname: str, index: dict[str, Any]) -> bytes:
    shown = f"{redact_url(src_url).rstrip('/')}/{fname}"
    try:
        data = fs.cat_file(join(root, fname))
    except FileNotFoundError:
        raise CorruptShardError(f"{shown}: listed by the index but missing") from None
    expect = index.get("rlmill", {}).get("files", {}).get(fname)
    if expect:
        if len(data) != expect["size"]:
            raise CorruptShardError(f"{shown}: size {len(data)} != {expect['size']} in the index (truncated?)")
        if hashlib.sha256(data).hexdigest() != expect["sha256"]:
            raise CorruptShardError(f"{shown}: sha256 does not match the index (corrupted)")
    return data


def load_state_dict(src_url: str, storage: StorageConfig | None = None) -> dict[str, "torch.Tensor"]:
    """Load a committed checkpoint's tensors, one shard in memory at a time, verified."""
    import safetensors.torch

    fs, root = url_to_fs(src_url, storage)
    index, shards = _check_index(_read_index_bytes(fs, root, src_url), src_url)
    out: dict[str, torch.Tensor] = {}
    for fname in shards:
        out.update(safetensors.torch.load(_fetch_shard(fs, root, src_url, fname, index)))
    missing = set(index["weight_map"]) - set(out)
    if missing:
        raise CorruptShardError(f"{redact_url(src_url)}: tensors in the index but in no shard: {sorted(missing)[:5]}")
    return out


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


def _fetch_into(fs: Any, root: str, src_url: str, dest: str, index: dict[str, Any], index_bytes: bytes) -> None:
    shards = set(index["weight_map"].values())
    for full in fs.find(root):
        rel = full[len(root):].lstrip("/")
        if not rel or rel == INDEX_NAME or ".tmp-" in rel or rel == _COMPLETE_MARKER:
            continue
        data = _fetch_shard(fs, root, src_url, rel, index) if rel in shards else fs.cat_file(full)
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        with open(os.path.join(dest, rel), "wb") as f:
            f.write(data)
    with open(os.path.join(dest, INDEX_NAME), "wb") as f:
        f.write(index_bytes)
    with open(os.path.join(dest, _COMPLETE_MARKER), "w") as f:
        f.write(hashlib.sha256(index_bytes).hexdigest())


def download_checkpoint(src_url: str, local_dir: str | None = None, storage: StorageConfig | None = None) -> str:
    """A local folder holding the committed checkpoint, for from_pretrained / vLLM.

    A local source with no `local_dir` is returned as is (it is already a loadable folder).
    Otherwise files go to `local_dir`, or to a cache folder keyed by the URL's hash
    ($RLMILL_CACHE_DIR or ~/.cache/rlmill), reused when a previous download completed.
    """
    fs, root = url_to_fs(src_url, storage)
    index_bytes = _read_index_bytes(fs, root, src_url)
    index, _ = _check_index(index_bytes, src_url)
    if local_dir is None and is_local(fs):
        return root
    index_sha = hashlib.sha256(index_bytes).hexdigest()
    if local_dir is not None:
        if not _is_complete(local_dir, index_sha):
            os.makedirs(local_dir, exist_ok=True)
            _fetch_into(fs, root, src_url, local_dir, index, index_bytes)
        return local_dir
    final = _cache_dir(src_url)
    if _is_complete(final, index_sha):
        return final
    # Download beside the final folder, then rename: a crash never leaves a half folder that
    # looks complete, and concurrent downloaders do not write into each other's files.
    tmp = f"{final}.tmp-{uuid.uuid4().hex}"
    os.makedirs(tmp)
    try:
        _fetch_into(fs, root, src_url, tmp, index, index_bytes)
        if os.path.isdir(final) and not _is_complete(final, index_sha):
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final, index_sha):  # lost a race to a complete copy: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final

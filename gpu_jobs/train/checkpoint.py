"""Exact-resume checkpoints of a DeepSpeed engine in object storage.

Layout under ``<url>/trainer/``: DeepSpeed's own ``save_checkpoint`` folder (weights, ZeRO
optimizer shards, ``latest``), then ``trainer_state.json`` written LAST: it lists every file
and carries step, data cursor, RNG states, world size and parameter shapes. A folder without it
is an unfinished save and is not loaded.

Every file's size and sha256 are recorded in trainer_state.json and checked on load: a file
damaged after the save raises ``storage.CorruptShardError`` (naming it) instead of loading
wrong weights, so a resume can fall back to an older checkpoint (gpu_jobs.stages.context).

Same world size: ``engine.load_checkpoint`` restores weights and optimizer bit for bit.
Different world size: ZeRO shards do not re-split, so the consolidated fp32 weights are loaded
(``get_fp32_state_dict_from_zero_checkpoint``) and the optimizer starts fresh (logged).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import posixpath
import random
import shutil
import tempfile
from typing import Any

import numpy as np

from . import dist
from .errors import TrainInputError

log = logging.getLogger("gpu_jobs.train")

__all__ = ["Resumable", "save_engine_state", "load_engine_state", "rng_state", "set_rng_state", "STATE_FILE"]

STATE_FILE = "trainer_state.json"
TAG = "zero"
FORMAT = "rlmill.trainer/1"


def _b64(t: Any) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> Any:
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state(generator: Any) -> dict[str, Any]:
    """JSON-able RNG states: the shuffle generator, torch's global RNG, numpy and random."""
    import torch

    np_state = np.random.get_state()
    return {
        "shuffle": _b64(generator.get_state()),
        "torch": _b64(torch.get_rng_state()),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def set_rng_state(state: dict[str, Any], generator: Any) -> None:
    import torch

    generator.set_state(_unb64(state["shuffle"]))
    torch.set_rng_state(_unb64(state["torch"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _shared_tmpdir() -> str:
    path = tempfile.mkdtemp(prefix="rlmill-ds-") if dist.is_rank0() else None
    return dist.broadcast_object(path)


def _mine(rel: str, rank: int) -> bool:
    """Files this rank uploads: its own ZeRO shards; rank 0 also everything rank-independent."""
    name = posixpath.basename(rel)
    if "zero_pp_rank_" in name:
        return name.startswith(f"zero_pp_rank_{rank}_") or f"_zero_pp_rank_{rank}_" in name
    return rank == 0


def _file_digest(path: str) -> dict[str, Any]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _verify_file(path: str, expected: dict[str, Any] | None, shown: str) -> None:
    """Raise CorruptShardError if the downloaded file differs from what the save recorded."""
    from storage import CorruptShardError

    if expected is None:  # checkpoints written before checksums were recorded
        return
    got = _file_digest(path)
    if got["size"] != expected["size"]:
        raise CorruptShardError(f"{shown}: size {got['size']} != {expected['size']} recorded at save (truncated or replaced)")
    if got["sha256"] != expected["sha256"]:
        raise CorruptShardError(f"{shown}: sha256 does not match the one recorded at save (corrupted)")


def _local_files(root: str) -> list[str]:
    out = []
    for base, _, files in os.walk(root):
        out += [os.path.relpath(os.path.join(base, f), root).replace(os.sep, "/") for f in files]
    return sorted(out)


def save_engine_state(module: Any, url: str, extra: dict[str, Any]) -> str:
    """DeepSpeed checkpoint of ``module.engine`` plus ``extra`` (JSON-able) to ``<url>/trainer/``.
    All ranks call it. Returns the URL of trainer_state.json."""
    from storage import url_to_fs

    from storage import ManifestExistsError

    fs, root = url_to_fs(url, getattr(module, "storage", None))
    dest = posixpath.join(root, "trainer")
    if fs.exists(posixpath.join(dest, STATE_FILE)):
        # Never write over the last good checkpoint: each save goes to a fresh URL.
        raise ManifestExistsError(f"{url}/trainer/{STATE_FILE} exists: trainer state already saved there")
    tmp = _shared_tmpdir()
    try:
        module.engine.save_checkpoint(tmp, tag=TAG, client_state={})
        dist.barrier()
        files = _local_files(tmp)
        for rel in (f for f in files if _mine(f, module.rank)):
            fs.makedirs(posixpath.dirname(posixpath.join(dest, rel)), exist_ok=True)
            fs.put_file(os.path.join(tmp, rel), posixpath.join(dest, rel))
        dist.barrier()
        if module.rank == 0:
            state = {
                "format": FORMAT,
                "tag": TAG,
                "files": files,
                "checksums": {rel: _file_digest(os.path.join(tmp, rel)) for rel in files},
                "world_size": module.world_size,
                "zero_stage": module.config.zero_stage,
                "pipeline_parallel_size": module.config.pipeline_parallel_size,
                "param_shapes": module._param_shapes,
                "step": module.step,
                **extra,
            }
            fs.pipe_file(posixpath.join(dest, STATE_FILE), json.dumps(state).encode())
        dist.barrier()
    finally:
        if module.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return url.rstrip("/") + f"/trainer/{STATE_FILE}"


def _read_state(fs: Any, dest: str, url: str) -> dict[str, Any]:
    path = posixpath.join(dest, STATE_FILE)
    if not fs.exists(path):
        raise TrainInputError(
            f"no trainer state at {url}/trainer/{STATE_FILE}: the save did not finish or this is "
            f"not a trainer checkpoint; pass the URL given to save() (the folder holding trainer/)."
        )
    state = json.loads(fs.cat_file(path))
    if state.get("format") != FORMAT:
        raise TrainInputError(f"{url}: unknown trainer state format {state.get('format')!r}")
    return state


def load_engine_state(module: Any, url: str) -> dict[str, Any]:
    """Restore ``module.engine`` from ``save_engine_state(url)``; returns the saved JSON state.
    Raises TrainInputError (before touching any weight) for a checkpoint of another model."""
    from storage import url_to_fs

    fs, root = url_to_fs(url, getattr(module, "storage", None))
    dest = posixpath.join(root, "trainer")
    state = _read_state(fs, dest, url)
    module.check_shapes(state["param_shapes"], url)
    tmp = tempfile.mkdtemp(prefix="rlmill-ds-load-")  # per rank: every rank reads the files it needs
    try:
        sums = state.get("checksums", {})
        for rel in state["files"]:
            os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
            try:
                fs.get_file(posixpath.join(dest, rel), os.path.join(tmp, rel))
            except FileNotFoundError:
                from storage import CorruptShardError

                raise CorruptShardError(f"{url}/trainer/{rel}: listed in {STATE_FILE} but missing") from None
            _verify_file(os.path.join(tmp, rel), sums.get(rel), f"{url}/trainer/{rel}")
        saved = (state["world_size"], state["zero_stage"], state.get("pipeline_parallel_size", 1))
        mine = (module.world_size, module.config.zero_stage, module.config.pipeline_parallel_size)
        # ZeRO-0 data-parallel states are whole on every rank, so any world size can load them.
        full_copies = saved[1:] == mine[1:] == (0, 1)
        if saved == mine or full_copies:
            module.engine.load_checkpoint(
                tmp, tag=state["tag"], load_optimizer_states=module.optimizer is not None,
                load_lr_scheduler_states=False,
            )
        else:
            _load_consolidated(module, tmp, state, url)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    return state


def _load_consolidated(module: Any, tmp: str, state: dict[str, Any], url: str) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    weights = get_fp32_state_dict_from_zero_checkpoint(tmp, tag=state["tag"])
    module.load_weights(weights)
    log.warning(
        "%s was saved with world_size=%s zero_stage=%s and is loaded with world_size=%s "
        "zero_stage=%s: weights are restored exactly from the consolidated fp32 copy, but the "
        "optimizer state (Adam moments) starts fresh, so the next steps differ from an "
        "uninterrupted run.",
        url, state["world_size"], state["zero_stage"], module.world_size, module.config.zero_stage,
    )


class Resumable:
    """save()/load() for a trainer holding ``engine`` (DeepSpeed), ``config``, ``rank``,
    ``world_size``, ``step``, ``samples_seen``, ``_shuffle`` (torch.Generator), ``_param_shapes``
    and ``load_weights(state_dict)``."""

    def save(self, url: str) -> str:
        """Everything exact resume needs under ``<url>/trainer/`` (all ranks call it): DeepSpeed
        weights + optimizer, step, data cursor, RNG states. Returns the state file's URL."""
        extra = {
            "samples_seen": self.samples_seen,
            "rng": rng_state(self._shuffle),
            "config": self.config.model_dump(mode="json"),
            **self._extra_state(),
        }
        return save_engine_state(self, url, extra)

    def load(self, url: str) -> None:
        """Restore a ``save(url)``; a checkpoint of another model raises TrainInputError first."""
        state = load_engine_state(self, url)
        self.step = state["step"]
        self.samples_seen = state["samples_seen"]
        set_rng_state(state["rng"], self._shuffle)
        self._load_extra_state(state)

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def check_shapes(self, shapes: dict[str, list[int]], source: str) -> None:
        """Raise TrainInputError if ``shapes`` (name -> shape) is not this model's."""
        mine = self._param_shapes
        missing = sorted(set(mine) - set(shapes))
        extra = sorted(set(shapes) - set(mine))
        wrong = [n for n in mine if n in shapes and list(shapes[n]) != list(mine[n])]
        if missing or extra or wrong:
            detail = "; ".join(
                s
                for s in (
                    f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}" if missing else "",
                    f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}" if extra else "",
                    ", ".join(f"{n}: {shapes[n]} vs {mine[n]}" for n in wrong[:3]),
                )
                if s
            )
            raise TrainInputError(
                f"checkpoint {source} was saved from a different model ({detail}); load a "
                f"checkpoint of {self.model_path} or build the trainer from that checkpoint's model."
            )

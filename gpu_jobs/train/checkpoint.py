"""Exact-resume checkpoints of a DeepSpeed engine in object storage.

``save(url)`` makes ``url`` (e.g. ``runs/<id>/checkpoints/<k>/trainer``) one commit of the
storage primitive: DeepSpeed's own ``save_checkpoint`` folder uploaded under a fresh name
``<url>/<attempt>/`` (each rank its own ZeRO shards), then ``<url>/_MANIFEST.json`` (kind
"trainer") written LAST and create-only by rank 0. The manifest lists every file with its size
and sha256 and carries, under ``trainer_state``, the step, data cursor, RNG states, world size and
parameter shapes. A folder without it is an unfinished save and is not loaded
(``storage.committed(url)`` tells).

Every file is checked on load by storage's verifier: a file damaged after the save raises
``storage.CorruptShardError`` (naming it) before any weight changes, so a resume can fall back
to an older checkpoint (gpu_jobs.stages.resume). Every torch file is read with
``weights_only=True``, DeepSpeed's own loads included (gpu_jobs.train.safe_load): a file in
storage is data, never code that runs on load.

Same world size and ZeRO stage (or ZeRO-0 on both sides): ``engine.load_checkpoint`` restores
weights and optimizer bit for bit. Another world size or ZeRO stage (``zero_stage: auto`` is 0 on
one rank and 3 on more, so 2 -> 1 ranks crosses stages too): DeepSpeed's shards do not re-split,
so gpu_jobs.train.reshard consolidates the fp32 weights and each parameter's Adam state
(exp_avg, exp_avg_sq, step) from the saved shards and every rank puts its own partition into the
new engine's optimizer: the moments arrive exactly, the next steps match the old world size up to
float reduction order. Still reset to fresh moments (with a warning): pipeline-parallel layouts
(their states are per-layer files; the pipeline trainer refuses another layout anyway) and
optimizer layouts reshard cannot read or write (DeepSpeed's stage-0 bf16 FP16_UnfusedOptimizer, which
only a pipeline run can make now: ZeroModule's bf16 is autocast over an fp32 engine).
"""

from __future__ import annotations

import base64
import logging
import os
import posixpath
import random
import shutil
import tempfile
import uuid
from typing import Any

import numpy as np

from .ranks import dist
from .errors import TrainInputError
from .safe_load import load_weights_only, weights_only_loads

log = logging.getLogger("gpu_jobs.train")

__all__ = ["Resumable", "save_engine_state", "load_engine_state", "rng_state", "set_rng_state", "TRAINER_KIND"]

TRAINER_KIND = "trainer"
TAG = "zero"


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


def _shared_attempt() -> tuple[str, str]:
    """(local temp folder, fresh attempt name), the same on every rank."""
    mine = (tempfile.mkdtemp(prefix="rlmill-ds-"), uuid.uuid4().hex[:16]) if dist.is_rank0() else None
    return dist.broadcast_object(mine)


def _mine(rel: str, rank: int) -> bool:
    """Files this rank uploads: its own ZeRO shards; rank 0 also everything rank-independent."""
    name = posixpath.basename(rel)
    if "zero_pp_rank_" in name:
        return name.startswith(f"zero_pp_rank_{rank}_") or f"_zero_pp_rank_{rank}_" in name
    return rank == 0


def _local_files(root: str) -> list[str]:
    out = []
    for base, _, files in os.walk(root):
        out += [os.path.relpath(os.path.join(base, f), root).replace(os.sep, "/") for f in files]
    return sorted(out)


def save_engine_state(module: Any, url: str, extra: dict[str, Any]) -> str:
    """Commit ``module.engine``'s DeepSpeed checkpoint plus ``extra`` (JSON-able) at ``url``.
    All ranks call it. Returns the manifest's URI; ManifestExistsError if ``url`` committed."""
    from storage import ManifestFile, commit, join, url_to_fs
    from storage.manifest import ensure_uncommitted, manifest_uri

    storage = getattr(module, "storage", None)
    # Never write over the last good checkpoint: each save goes to a fresh URL.
    ensure_uncommitted(url, "trainer state", storage)
    fs, root = url_to_fs(url, storage)
    tmp, attempt = _shared_attempt()
    try:
        # A LoRA trainer's base weights are frozen and come back from the base model: its
        # trainer state holds the adapters and their optimizer moments only.
        module.engine.save_checkpoint(tmp, tag=TAG, client_state={}, exclude_frozen_parameters=_frozen_base(module))
        dist.barrier()
        mine = [rel for rel in _local_files(tmp) if _mine(rel, module.rank)]
        for rel in mine:
            fs.put_file(os.path.join(tmp, rel), join(root, attempt, rel))
        # Every rank lists what it uploaded: on several nodes rank 0 cannot see the others' folders.
        listed = dist.all_gather_object([ManifestFile.of_local_file(f"{attempt}/{rel}", os.path.join(tmp, rel))
                                         for rel in mine])
        if module.rank == 0:
            state = {
                "tag": TAG,
                "folder": attempt,
                "world_size": module.world_size,
                "zero_stage": module.config.resolved_zero_stage(module.world_size // module.config.pipeline_parallel_size),
                "pipeline_parallel_size": module.config.pipeline_parallel_size,
                "param_shapes": module._param_shapes,
                "step": module.step,
                "frozen_excluded": _frozen_base(module),
                **extra,
            }
            files = sorted((f for part in listed for f in part), key=lambda f: f.path)
            commit(url, files, kind=TRAINER_KIND, metrics={"step": module.step},
                   extra={"trainer_state": state}, storage=storage)
        dist.barrier()
    finally:
        if int(os.environ.get("LOCAL_RANK", module.rank)) == 0:  # one per node: each node has its own copy
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest_uri(url)


def _frozen_base(module: Any) -> bool:
    """Whether the module trains LoRA adapters on a frozen base (left out of its checkpoints)."""
    return getattr(module, "lora", None) is not None


def _read_manifest(url: str, storage: Any) -> Any:
    from storage import NotCommittedError, read_manifest

    try:
        return read_manifest(url, storage, kind=TRAINER_KIND)
    except NotCommittedError:
        raise TrainInputError(
            f"no trainer state at {url}: the save did not finish or this is not a trainer "
            "checkpoint; pass the URL given to save() (e.g. runs/<id>/checkpoints/<k>/trainer)."
        ) from None


def load_engine_state(module: Any, url: str) -> dict[str, Any]:
    """Restore ``module.engine`` from ``save_engine_state(url)``; returns the saved JSON state.
    Raises TrainInputError (before touching any weight) for a checkpoint of another model, and
    CorruptShardError naming a file that is missing or fails its size/sha256."""
    from storage import download_file

    storage = getattr(module, "storage", None)
    manifest = _read_manifest(url, storage)
    state = manifest.extra["trainer_state"]
    module.check_shapes(state["param_shapes"], url)
    tmp = tempfile.mkdtemp(prefix="rlmill-ds-load-")  # per rank: every rank reads the files it needs
    try:
        for f in manifest.files:  # every file checked before any weight changes
            download_file(manifest, f, os.path.join(tmp, *f.path.split("/")), storage)
        folder = os.path.join(tmp, state["folder"])
        with weights_only_loads():  # DeepSpeed's loaders pass weights_only=False themselves
            _load_folder(module, folder, state, url)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    return state


def _load_folder(module: Any, folder: str, state: dict[str, Any], url: str) -> None:
    """The downloaded checkpoint folder into ``module``, the way its layout allows."""
    saved = (state["world_size"], state["zero_stage"], state.get("pipeline_parallel_size", 1))
    mine = (module.world_size, module.config.resolved_zero_stage(module.world_size // module.config.pipeline_parallel_size), module.config.pipeline_parallel_size)
    # ZeRO-0 data-parallel states are whole on every rank, so any world size can load them.
    full_copies = saved[1:] == mine[1:] == (0, 1)
    if state.get("fresh_optimizer"):  # a run forked with --fresh-optimizer (gpu_jobs/stages/fork.py)
        _load_weights(module, folder, state)
    elif saved == mine or full_copies:
        module.engine.load_checkpoint(
            folder, tag=state["tag"], load_optimizer_states=module.optimizer is not None,
            load_lr_scheduler_states=False, load_module_strict=not state.get("frozen_excluded", False),
        )
    elif module.optimizer is not None and saved[2] == mine[2] == 1:
        _load_resharded(module, folder, state, url, mine)
    else:
        _load_consolidated(module, folder, state, url)


def _load_resharded(module: Any, folder: str, state: dict[str, Any], url: str, mine: tuple) -> None:
    """Weights and Adam state of a checkpoint of another world size or ZeRO stage, resharded
    (gpu_jobs.train.reshard); a layout reshard cannot handle falls back to fresh moments."""
    from .reshard import UnsupportedLayout, place_full_state, read_full_state

    trainable = {n: module._param_shapes[n] for n, p in module.engine.module.named_parameters() if p.requires_grad}
    try:
        full = read_full_state(os.path.join(folder, state["tag"]), trainable)
        place_full_state(module, full)
    except UnsupportedLayout as exc:  # raised before anything changed
        log.warning("%s: cannot reshard its optimizer state (%s)", url, exc)
        return _load_consolidated(module, folder, state, url)
    log.info(
        "%s: saved with world_size=%s zero_stage=%s, loaded with world_size=%s zero_stage=%s: "
        "weights and Adam state (exp_avg, exp_avg_sq, step) resharded from %s",
        url, state["world_size"], state["zero_stage"], mine[0], mine[1], full.source,
    )


def _load_consolidated(module: Any, folder: str, state: dict[str, Any], url: str) -> None:
    """Weights only, from the consolidated fp32 copy; the optimizer keeps fresh moments (logged).
    For layouts reshard does not handle: pipeline-parallel states, a trainer without optimizer."""
    _load_weights(module, folder, state)
    if module.optimizer is None:  # a reference model: weights are all it keeps
        return
    log.warning(
        "%s was saved with world_size=%s zero_stage=%s and is loaded with world_size=%s "
        "zero_stage=%s: weights are restored exactly from the consolidated fp32 copy, but the "
        "optimizer state (Adam moments) starts fresh, so the next steps differ from an "
        "uninterrupted run.",
        url, state["world_size"], state["zero_stage"], module.world_size, module.config.resolved_zero_stage(module.world_size // module.config.pipeline_parallel_size),
    )


def _load_weights(module: Any, folder: str, state: dict[str, Any]) -> None:
    """The saved fp32 weights, consolidated, into ``module``; its optimizer keeps what it holds."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if state["zero_stage"] == 0:  # no ZeRO shards: DeepSpeed wrote the whole module
        weights = load_weights_only(os.path.join(folder, state["tag"], "mp_rank_00_model_states.pt"))["module"]
    else:
        weights = get_fp32_state_dict_from_zero_checkpoint(folder, tag=state["tag"])
    module.load_weights(weights)


class Resumable:
    """save()/load() for a trainer holding ``engine`` (DeepSpeed), ``config``, ``rank``,
    ``world_size``, ``step``, ``samples_seen``, ``_shuffle`` (torch.Generator), ``_param_shapes``
    and ``load_weights(state_dict)``."""

    step: int  # update() calls so far

    def save(self, url: str) -> str:
        """Commit everything exact resume needs at ``url`` (all ranks call it): DeepSpeed
        weights + optimizer, step, data cursor, RNG states. Returns the manifest's URI."""
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

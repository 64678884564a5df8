"""The policy trainer's surface in the parent process, served by a warm RankGroup of DeepSpeed
ranks (each runs a PolicyTrainer, or a PipelinePolicyTrainer with pipeline_parallel_size > 1).

    from gpu_jobs.train.ranks.trainer import GroupTrainer
    trainer = GroupTrainer(model_dir, ActorConfig(zero_stage=3), n_ranks=2)  # starts on first use
    metrics = trainer.update(table)              # every rank reads the batch, trains on its slice
    weights = trainer.gathered_state_dict()      # full fp32 weights, here in the parent
    for bucket in trainer.iter_weight_buckets(256 << 20, torch.bfloat16): ...  # bounded memory
    trainer.save(url); trainer.load(url); trainer.save_hf(url + "/policy")
    trainer.close()                              # shutdown; SIGTERM, then SIGKILL what is left

Batches travel as a Parquet file in the group's local folder (``/dev/shm`` when it has room),
weights as safetensors bucket files that the parent reads and deletes one by one; on several
nodes both reach the other nodes' ranks broadcast from rank 0.

A failed call tears the group down (RankGroupError) and the next call starts a fresh one. The
fresh group is brought back to the trainer's state when that state is reproducible: the start
model, or the last ``save(url)``/``load(url)`` with nothing applied since (it loads ``url``). If
updates were applied since, that state died with the group: ``state_lost`` is set and every call
but ``load(url)`` and ``reset()`` raises ``TrainerStateLostError`` rather than training on the
wrong weights.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ..weights import DEFAULT_BUCKET_BYTES
from .errors import RankGroupError, TrainerStateLostError
from .group import RankGroup

__all__ = ["GroupTrainer"]


class GroupTrainer:
    """PolicyTrainer's surface, served by a warm group of ``n_ranks`` DeepSpeed ranks.

        trainer = GroupTrainer(model_path, config, n_ranks=2, tokenizer=tok, storage=storage_config)

    The group starts on the first call that needs it (``start()`` starts it now) and serves every
    later call; ``close()`` (or dropping the last reference) tears it down. Attributes as
    PolicyTrainer: ``step``, ``config``, ``model_config``, ``model_path``, ``tokenizer``,
    ``storage``, ``zero_stage``, ``rank`` (0: the parent speaks for rank 0), ``world_size``.
    Also ``state_lost``, ``groups_started`` and ``last_start_seconds``."""

    # The ranks are other processes: the agreement probe is a forward of its own (compute_log_probs).
    probes_in_update = False
    step: int
    state_lost: bool
    groups_started: int

    def __init__(self, model_path: str, config: Any = None, *, n_ranks: int, tokenizer: Any = None,
                 storage: Any = None, call_timeout: float | None = None, start_timeout: float = 600.0,
                 workdir_root: str | None = None, env: dict[str, str] | None = None, nnodes: int = 1,
                 master_addr: str = "", master_port: int = 0, model_source: str | None = None):
        from transformers import AutoConfig

        from gpu_jobs.models import resolve_model_path

        from ..config import ActorConfig

        self.config = config if config is not None else ActorConfig()
        pp = self.config.pipeline_parallel_size  # > 1: the ranks run PipelinePolicyTrainer (ZeRO 0/1)
        if n_ranks % pp:
            raise ValueError(f"pipeline_parallel_size={pp} must divide the {n_ranks} ranks of the group")
        self.storage = storage
        # What a rank of another node loads when node 0's folder is not there (a storage URL).
        self.model_source = model_source if model_source is not None else os.fspath(model_path)
        self.model_path = resolve_model_path(model_path, storage)
        self.model_config = AutoConfig.from_pretrained(self.model_path)
        self.tokenizer = tokenizer
        self.rank, self.world_size = 0, n_ranks
        resolve = getattr(self.config, "resolved_zero_stage", None)
        self.zero_stage = resolve(n_ranks // pp) if resolve else self.config.zero_stage
        self.step = 0
        self.state_lost = False
        self.groups_started = 0
        self.last_start_seconds: float | None = None
        self.call_timeout, self.start_timeout = call_timeout, start_timeout
        self._workdir_root, self._env = workdir_root, env
        self._nodes = {"nnodes": nnodes, "master_addr": master_addr, "master_port": master_port}
        self._restore_url: str | None = None  # what a fresh group loads to reach this state
        self._dirty = False  # state changed since the restore point (start model or _restore_url)
        self._box: list[RankGroup | None] = [None]
        self._start_lock = threading.RLock()
        self._finalizer = weakref.finalize(self, _close_box, self._box)

    def __repr__(self) -> str:
        return f"GroupTrainer({self.model_path!r}, {self.world_size} ranks, step {self.step}, {self._box[0]!r})"

    # ---- the group ------------------------------------------------------------------------
    @property
    def group(self) -> RankGroup | None:
        return self._box[0]

    @property
    def pids(self) -> list[int]:
        """The ranks' pids (rank order) of the current group; [] before it starts."""
        g = self._box[0]
        return list(g.pids) if g is not None and g.usable else []

    def group_layout(self):
        """Where the group's ranks run (a gpu_jobs.train.ranks.launch.NodeLayout): its join_command(i)
        is what node i runs."""
        from .launch import NodeLayout

        return NodeLayout(self.world_size, **self._nodes)

    def start(self) -> "GroupTrainer":
        """Start the group now (else the first call does)."""
        self._ensure()
        return self

    def _ensure(self, *, restore: bool = True, allow_lost: bool = False) -> RankGroup:
        with self._start_lock:
            return self._ensure_locked(restore, allow_lost)

    def _ensure_locked(self, restore: bool, allow_lost: bool) -> RankGroup:
        if self.state_lost and not allow_lost:
            raise TrainerStateLostError(
                f"the rank group holding {self.world_size}-rank trainer state (step {self.step}, updated "
                f"since {self._restore_url or 'the start model'}) died, and that state with it; "
                "load(url) a checkpoint and replay the updates after it, or reset() to the start model.")
        g = self._box[0]
        if g is not None and g.usable:
            return g
        if g is not None:
            g.close()
        g = RankGroup(self.world_size, env=self._env, start_timeout=self.start_timeout,
                      workdir_root=self._workdir_root, **self._nodes)
        self._box[0] = g
        t0 = time.monotonic()
        g.start()
        self.groups_started += 1
        info = g.call("init", timeout=self.start_timeout, model_path=self.model_path,
                      model_source=self.model_source, config=self.config,
                      tokenizer=self.tokenizer, storage=self.storage)
        self.step = info["step"]
        if restore and self._restore_url is not None and not self.state_lost:
            self.step = g.call("load", timeout=self.call_timeout, url=self._restore_url)["step"]
        self.last_start_seconds = time.monotonic() - t0
        return g

    def _call(self, command: str, *, restore: bool = True, allow_lost: bool = False, **kwargs: Any) -> Any:
        try:
            g = self._ensure(restore=restore, allow_lost=allow_lost)
            return g.call(command, timeout=self.call_timeout, **kwargs)
        except TrainerStateLostError:
            raise
        except RankGroupError:
            if self._dirty:
                self.state_lost = True
            raise

    def _local_file(self, suffix: str) -> str:
        return os.path.join(self._ensure().workdir, f"{uuid.uuid4().hex}{suffix}")

    def close(self) -> None:
        """Shut the group down. The trainer stays usable: the next call starts a fresh group
        (at the restore point; if updates were applied since, state_lost is set)."""
        g = self._box[0]
        self._box[0] = None
        if g is not None:
            if g.usable and self._dirty:
                self.state_lost = True
            g.close()

    def reset(self) -> None:
        """Back to the start model (step 0), dropping any lost state; the group restarts lazily."""
        self.close()
        self.state_lost, self._dirty, self._restore_url, self.step = False, False, None, 0

    # ---- PolicyTrainer's surface ------------------------------------------------------------
    def _check(self, table: Any, require: tuple[str, ...]) -> None:
        """The ranks' input checks, here first: a bad batch raises TrainInputError in the parent
        and leaves the group running."""
        from ..batch import read_rows

        read_rows(table, require=require, vocab_size=self.model_config.vocab_size)

    def _write_table(self, table: Any) -> str:
        import pyarrow.parquet as pq

        path = self._local_file(".parquet")
        pq.write_table(table, path, compression="none", use_dictionary=False)
        return path

    def update(self, table: Any, probe: Callable[[Any, Any, Any], None] | None = None) -> dict[str, float]:
        """One policy update (PolicyTrainer.update) on every rank; rank 0's metrics. No ``probe``:
        see ``probes_in_update``."""
        from ..policy import required_columns

        if probe is not None:
            raise ValueError("a rank group cannot score the agreement probe in its update: check agreement with "
                             "compute_log_probs before update()")

        self._check(table, required_columns(self.config, table))
        path = self._write_table(table)
        try:
            out = self._call("update", path=path)
        finally:
            _remove(path)
        self.step = out["step"]
        self._dirty = True
        return out["metrics"]

    def preference_update(self, table: Any, preference: Any) -> dict[str, float]:
        """Not on a rank group: preference updates train on one rank (PolicyTrainer), because
        KTO's reference point and the pair shares are not reduced over ranks. Raises before any
        rank is started or any batch is written; the run config refuses such runs first."""
        raise NotImplementedError(
            f"a {self.world_size}-rank group cannot run preference (DPO/KTO) updates: they train on one rank; "
            "set trainer.n_gpus_per_node=1 and trainer.nnodes=1 (the defaults) for a preference run")

    def sft_update(self, table: Any) -> dict[str, float]:
        """Not on a rank group yet: SFT runs train on one rank (PolicyTrainer); the run config
        refuses more first."""
        raise NotImplementedError(f"a {self.world_size}-rank group cannot run SFT updates yet: set "
                                  "trainer.n_gpus_per_node=1 and trainer.nnodes=1 (the defaults) for an SFT run")

    def compute_argmax_match(self, table: Any) -> list:
        """Not on a rank group yet (see sft_update)."""
        raise NotImplementedError(f"a {self.world_size}-rank group cannot score SFT's held-out exact match yet: "
                                  "set trainer.n_gpus_per_node=1 and trainer.nnodes=1")

    def compute_log_probs(self, table: Any) -> list:
        """Per-row float32 log-probs of each response token (no grad)."""
        self._check(table, ())
        path = self._write_table(table)
        try:
            return self._call("compute_log_probs", path=path)
        finally:
            _remove(path)

    def gathered_state_dict(self) -> dict[str, Any]:
        """Full fp32 weights (HF names, as PolicyTrainer.gathered_state_dict), in this process."""
        import torch

        out: dict[str, Any] = {}
        for bucket in self.iter_weight_buckets(DEFAULT_BUCKET_BYTES, torch.float32):
            out.update(bucket)
        return out

    def iter_weight_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: Any = None
                            ) -> Iterator[list[tuple[str, Any]]]:
        """The full weights as lists of (name, tensor) of about ``bucket_bytes`` each (whole
        layers; ``dtype`` default float32). The ranks gather one parameter at a time; rank 0
        writes a bucket file while this process reads the one before and deletes it, so this
        process holds one bucket beyond what the consumer keeps. Stopping early is fine."""
        import torch
        from safetensors.torch import load_file

        dtype = dtype or torch.float32
        name = str(dtype).removeprefix("torch.")
        g = self._ensure()
        folder = tempfile.mkdtemp(prefix="weights-", dir=g.workdir)
        stream = None
        try:
            stream = self._stream(g, "weights", workdir=folder, bucket_bytes=int(bucket_bytes), dtype=name)
            for kind, info in stream:
                if kind == "ok":
                    return
                bucket = load_file(info["path"])
                _remove(info["path"])
                g.reply(("ack", info["index"]))
                items = list(bucket.items())
                del bucket
                yield items
                del items
        except GeneratorExit:
            # The consumer stopped. Rank 0 waits for one answer per bucket it announces: answer
            # "stop" to the next one (if any) and read the command's result.
            if stream is not None and g.usable:
                for kind, info in stream:
                    if kind == "bucket":
                        _remove(info["path"])
                        g.reply(("stop", info["index"]))
            raise
        finally:
            if stream is not None:
                stream.close()
            shutil.rmtree(folder, ignore_errors=True)

    def _stream(self, g: RankGroup, command: str, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        try:
            yield from g.stream(command, timeout=self.call_timeout, **kwargs)
        except RankGroupError:
            if self._dirty:
                self.state_lost = True
            raise

    def save(self, url: str) -> str:
        """Exact-resume state at ``url`` (PolicyTrainer.save, every rank its ZeRO shards)."""
        out = self._call("save", url=url)
        self._restore_url, self._dirty = url, False
        return out

    def load(self, url: str) -> None:
        """Restore a save(url). Also how to recover after TrainerStateLostError."""
        out = self._call("load", restore=False, allow_lost=True, url=url)
        self.step = out["step"]
        self._restore_url, self._dirty, self.state_lost = url, False, False

    def save_hf(self, url: str) -> str | None:
        """HF safetensors checkpoint at ``url`` (written by rank 0)."""
        return self._call("save_hf", url=url)

    def load_weights(self, state: dict[str, Any]) -> None:
        """Copy a full state dict (HF names) into the model; the optimizer's moments stay."""
        from safetensors.torch import save_file

        seen: set[int] = set()
        tensors = {}
        for k, v in state.items():  # safetensors refuses tensors sharing memory (tied weights)
            v = v.detach().cpu()
            ptr = v.untyped_storage().data_ptr()
            tensors[k] = v.clone().contiguous() if ptr in seen else v.contiguous()
            seen.add(ptr)
        path = self._local_file(".safetensors")
        try:
            save_file(tensors, path)
            del tensors
            self._call("load_weights", path=path)
        finally:
            _remove(path)
        self._dirty = True

    def rank_info(self) -> list[dict[str, Any]]:
        """Per rank: pid, zero_stage, partition_numel (its ZeRO-3 share of the parameters),
        materialized_numel (parameter elements held now), full_numel, optimizer_numel."""
        return self._call("rank_info")

    def _debug_raise(self, rank: int, message: str = "debug_raise") -> None:
        """Make ``rank`` raise RuntimeError(message) (tests and diagnostics)."""
        self._call("debug_raise", rank=rank, message=message)


def _close_box(box: list) -> None:
    g = box[0]
    box[0] = None
    if g is not None:
        g.close()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass

"""One rank of a warm rank group (gpu_jobs.train.ranks.group): started once by torchrun, then serves
commands until told to stop.

    python -m torch.distributed.run --standalone --nproc_per_node N \\
        -m gpu_jobs.train.ranks.worker --address 127.0.0.1:PORT --workdir DIR

Not a command to run by hand: RankGroup starts it with the control channel's authkey in
RLMILL_GROUP_AUTHKEY (hex). Rank 0 connects to the parent's Listener, receives each command and
broadcasts it to the other ranks (torch.distributed broadcast_object_list over gloo/nccl); every
rank runs it on its own PolicyTrainer (PipelinePolicyTrainer with pipeline_parallel_size > 1), a
barrier closes it, and rank 0 replies. A rank that raises
writes ``<workdir>/error-rank<k>.json`` (time, traceback) and exits at once: its peers then fail
in their next collective, torchrun stops the rest, and the parent reports the first error.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from typing import Any

from ..weights import plan_buckets

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Rank 0 sends a no-op to the other ranks when the parent has said nothing for this long, so no
# rank waits in one collective longer than the process group's timeout (gloo: 30 min).
KEEPALIVE_S = 60.0


def die_with_parent() -> None:
    """SIGKILL this process when its parent (torchrun) dies: torchrun starts ranks in their own
    sessions, so killing its process group would not reach them."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:  # the parent died before prctl: nobody would stop this rank
        os._exit(1)


def error_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"error-rank{rank}.json")


def write_error(workdir: str, rank: int, exc: BaseException, command: str) -> dict[str, Any]:
    """Record this rank's failure where the parent looks for it (atomically)."""
    info = {
        "rank": rank,
        "pid": os.getpid(),
        "time": time.time(),
        "command": command,
        "type": type(exc).__name__,
        "message": " ".join(str(exc).split())[:2000],
        "traceback": "".join(traceback.format_exception(exc)),
        "comm": is_comm_error(exc),
    }
    tmp = error_path(workdir, rank) + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, error_path(workdir, rank))
    except OSError:
        pass
    return info


def is_comm_error(exc: BaseException) -> bool:
    """A failure of a collective, usually the echo of another rank dying, not a cause."""
    try:
        import torch.distributed as td

        if isinstance(exc, getattr(td, "DistError", ())):
            return True
    except ImportError:
        pass
    text = f"{type(exc).__name__} {exc}".lower()
    return any(s in text for s in ("gloo", "connection closed by peer", "connection reset by peer",
                                   "broken pipe", "nccl", "socket timeout", "timed out"))


class Server:
    """Runs the commands the parent sends; one instance per rank."""

    def __init__(self, rank: int, conn: Any, workdir: str):
        self.rank, self.conn, self.workdir = rank, conn, workdir
        self.trainer: Any = None
        self.shutdown_asked = False  # the parent closed the group in the middle of a stream

    # ---- the loop -------------------------------------------------------------------------
    def serve(self) -> None:
        from . import dist

        while True:
            msg = None
            if self.rank == 0:
                msg = ("shutdown", {}) if self.shutdown_asked else self._next_command()
            command, kwargs = dist.broadcast_object(msg)
            if command == "ping":
                continue
            if command == "shutdown":
                return
            try:
                result = getattr(self, f"cmd_{command}")(**kwargs)
                dist.barrier()  # a rank that failed has exited: the others fail here, not later
            except BaseException as exc:  # noqa: BLE001 - every failure ends this rank
                self._die(exc, command)
            if self.rank == 0:
                try:
                    self.conn.send(("ok", result))
                except OSError:  # the parent went away: stop the group
                    self.shutdown_asked = True

    def _next_command(self) -> tuple[str, dict[str, Any]]:
        try:
            if not self.conn.poll(KEEPALIVE_S):
                return ("ping", {})
            msg = self.conn.recv()
        except (EOFError, OSError):  # the parent went away
            return ("shutdown", {})
        return msg

    def _die(self, exc: BaseException, command: str) -> None:
        info = write_error(self.workdir, self.rank, exc, command)
        if self.rank == 0:
            try:
                self.conn.send(("error", info))
            except OSError:
                pass
        sys.stderr.write(f"[rank {self.rank}] {command} failed:\n{info['traceback']}")
        sys.stderr.flush()
        os._exit(1)  # peers blocked in a collective fail at once; torchrun stops the rest

    # ---- commands -------------------------------------------------------------------------
    def cmd_init(self, model_path: str, config: Any, tokenizer: Any = None, storage: Any = None,
                 model_source: str | None = None) -> dict:
        model_path = model_folder(model_path, model_source, storage)
        if getattr(config, "pipeline_parallel_size", 1) > 1:  # DeepSpeed pipeline stages, ZeRO 0/1
            from ..pipeline import PipelinePolicyTrainer

            self.trainer = PipelinePolicyTrainer(model_path, config, tokenizer=tokenizer)
            self.trainer.storage = storage  # its save()/load() reach storage through it
        else:
            from ..policy import PolicyTrainer

            self.trainer = PolicyTrainer(model_path, config, tokenizer=tokenizer, storage=storage)
        return {"step": self.trainer.step, "zero_stage": getattr(self.trainer, "zero_stage", None)}

    def cmd_update(self, path: str) -> dict:
        metrics = self.trainer.update(_read_table(path))
        return {"metrics": metrics, "step": self.trainer.step}

    def cmd_compute_log_probs(self, path: str) -> Any:
        out = self.trainer.compute_log_probs(_read_table(path))
        return out if self.rank == 0 else None

    def cmd_save(self, url: str) -> Any:
        return self.trainer.save(url)

    def cmd_load(self, url: str) -> dict:
        self.trainer.load(url)
        return {"step": self.trainer.step}

    def cmd_save_hf(self, url: str) -> Any:
        return self.trainer.save_hf(url)

    def cmd_load_weights(self, path: str) -> None:
        """A full state dict from a safetensors file. Under ZeRO-3 only rank 0's values are used
        (GatheredParameters with modifier_rank=0), so the other ranks read shapes only."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        if _multi_node():
            from safetensors.torch import load as load_bytes

            state = load_bytes(_file_bytes(path))
        elif self.rank == 0 or getattr(self.trainer, "zero_stage", 3) != 3:
            state = load_file(path)
        else:
            import torch

            with safe_open(path, framework="pt") as f:
                state = {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
        self.trainer.load_weights(state)

    def cmd_weights(self, workdir: str, bucket_bytes: int, dtype: str) -> int:
        """Stream the full weights to the parent as safetensors bucket files (see
        RankGroup.stream): each parameter is gathered on its own (ZeRO-3 GatheredParameters) and
        rank 0 writes one bucket while the parent reads the one before. Returns the bucket count."""
        import torch

        from . import dist

        target = getattr(torch, dtype)
        if hasattr(self.trainer, "pipe"):
            return self._pipeline_weights(workdir, bucket_bytes, target)
        buckets = plan_buckets(self._param_sizes(target), bucket_bytes)
        sent = 0
        for i, names in enumerate(buckets):
            tensors = dict(self._gathered(names, target))
            if i == len(buckets) - 1:
                tensors.update(self._buffers(target))
            go = True
            if self.rank == 0 and i > 0:
                go = self._acked(i - 1)
            if not dist.broadcast_object(go):
                break
            if self.rank == 0:
                self._send_bucket(workdir, i, tensors, last=i == len(buckets) - 1)
                sent += 1
            del tensors
        if self.rank == 0 and sent == len(buckets) and sent:
            self._acked(sent - 1)
        return sent

    def _pipeline_weights(self, workdir: str, bucket_bytes: int, dtype: Any) -> int:
        """The pipeline trainer's weights: each stage's layers gathered to rank 0 at once (the
        stages hold disjoint layers, a ZeRO 0/1 stage whole ones), then streamed as buckets by
        rank 0 alone; the other ranks are done after the gather."""
        import torch

        state = self.trainer.gathered_state_dict()  # collective; the full weights on rank 0 only
        if self.rank != 0:
            return 0
        size = torch.empty(0, dtype=dtype).element_size()
        buckets = plan_buckets([(n, t.numel() * size) for n, t in state.items()], bucket_bytes)
        for i, names in enumerate(buckets):
            if i > 0 and not self._acked(i - 1):
                return i
            self._send_bucket(workdir, i, {n: state[n].to(dtype).contiguous() for n in names},
                              last=i == len(buckets) - 1)
        if buckets:
            self._acked(len(buckets) - 1)
        return len(buckets)

    def _send_bucket(self, workdir: str, index: int, tensors: dict[str, Any], *, last: bool) -> None:
        """Rank 0: write bucket ``index`` as a safetensors file (whole, then renamed) and tell the parent."""
        from safetensors.torch import save_file

        path = os.path.join(workdir, f"bucket-{index:05d}.safetensors")
        save_file(tensors, path + ".tmp")
        os.replace(path + ".tmp", path)
        self.conn.send(("bucket", {"index": index, "path": path, "last": last}))

    def _acked(self, index: int) -> bool:
        """Wait for the parent to take bucket ``index``: True to go on, False to stop."""
        msg = self.conn.recv()
        if msg[0] == "shutdown":
            self.shutdown_asked = True
        if msg[0] in ("stop", "shutdown"):
            return False
        if msg != ("ack", index):
            raise RuntimeError(f"weight stream: expected ack of bucket {index}, got {msg!r}")
        return True

    def _param_sizes(self, dtype: Any) -> list[tuple[str, int]]:
        import torch

        size = torch.empty(0, dtype=dtype).element_size()
        return [(n, int(getattr(p, "ds_numel", p.numel())) * size)
                for n, p in self.trainer.engine.module.named_parameters()]

    def _gathered(self, names: list[str], dtype: Any):
        """(name, full tensor) on rank 0 for ``names``, one parameter gathered at a time; nothing
        on the other ranks (they take part in each gather). The weights are fp32 in every
        precision (ZeroModule.compute_precision): ``dtype`` is what is sent."""
        import torch

        t = self.trainer
        params = dict(t.engine.module.named_parameters())
        for name in names:
            p = params[name]
            with t._gather_params([p]):
                if self.rank == 0:
                    with torch.no_grad():
                        yield name, p.detach().to(dtype, copy=True).cpu().contiguous()

    def _buffers(self, dtype: Any) -> dict[str, Any]:
        if self.rank != 0:
            return {}
        module = self.trainer.engine.module
        keys = set(module.state_dict().keys())
        return {n: b.detach().to(dtype, copy=True).cpu() for n, b in module.named_buffers() if n in keys}

    def cmd_rank_info(self) -> list[dict] | None:
        """Per rank: pid, and how many parameter elements it holds: its ZeRO partitions
        (ds_tensor), what is materialized now (p.data: ZeRO-3 keeps small 'persistent'
        parameters gathered), the full model, and the optimizer's fp32 partition."""
        import torch

        from . import dist

        t = self.trainer
        part = mat = full = 0
        for p in t.engine.module.parameters():
            full += int(getattr(p, "ds_numel", p.numel()))
            ds = getattr(p, "ds_tensor", None)
            part += int(ds.numel()) if ds is not None else p.numel()
            mat += int(p.data.numel())
        opt = t.engine.optimizer
        flats = getattr(opt, "fp32_partitioned_groups_flat", None)
        if flats is None:
            flats = getattr(opt, "single_partition_of_fp32_groups", None)
        opt_numel = (sum(int(f.numel()) for f in flats) if flats is not None
                     else sum(p.numel() for g in getattr(t.optimizer, "param_groups", []) for p in g["params"]))
        info = {"rank": self.rank, "pid": os.getpid(), "zero_stage": getattr(t, "zero_stage", None),
                "partition_numel": part, "materialized_numel": mat, "full_numel": full,
                "optimizer_numel": opt_numel, "threads": torch.get_num_threads()}
        gathered = dist.all_gather_object(info)
        return gathered if self.rank == 0 else None

    def cmd_debug_raise(self, rank: int, message: str = "debug_raise") -> None:
        """Diagnostics and tests: raise on ``rank`` (a stand-in for any rank-local failure)."""
        if self.rank == rank:
            raise RuntimeError(message)


def model_folder(model_path: str, model_source: str | None, storage: Any = None) -> str:
    """The model folder a rank loads: `model_path`, the folder node 0 resolved; on another node,
    where that folder does not exist, `model_source` (the run's model.path) downloaded into this
    node's own cache, which needs a storage URL every node reaches."""
    if os.path.isdir(model_path):
        return model_path
    from gpu_jobs.models.loading import is_remote, resolve_model_path

    if not (model_source and is_remote(model_source)):
        raise FileNotFoundError(
            f"the model folder {model_path} (resolved on node 0 from {model_source!r}) is not on this node: give "
            f"model.path as a storage URL every node reaches (s3://...), or put the same folder on every node")
    return resolve_model_path(model_source, storage)


def _read_table(path: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not _multi_node():
        return pq.read_table(path, memory_map=True)
    return pq.read_table(pa.BufferReader(_file_bytes(path)))


def _multi_node() -> bool:
    return int(os.environ.get("RLMILL_GROUP_NNODES", "1")) > 1


def _file_bytes(path: str) -> bytes:
    """A file the parent wrote beside rank 0, on every rank: read by rank 0 and broadcast (the
    other nodes cannot see the parent's folder). Collective: every rank calls it."""
    from . import dist

    data = None
    if dist.rank() == 0:
        with open(path, "rb") as f:
            data = f.read()
    return dist.broadcast_object(data)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpu_jobs.train.ranks.worker", description=__doc__.split("\n")[0])
    p.add_argument("--address", required=True, help="host:port of the parent's Listener")
    p.add_argument("--workdir", required=True, help="the group's local folder (errors, batches, buckets)")
    return p


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    args = _parser().parse_args(argv)
    authkey = bytes.fromhex(os.environ.pop("RLMILL_GROUP_AUTHKEY", ""))
    rank = int(os.environ.get("RANK", "0"))
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    try:
        from . import dist

        dist.init_distributed()
        rank = dist.rank()
        # (node, pid) by rank: the parent watches only its own node's processes.
        pids = dist.all_gather_object((int(os.environ.get("GROUP_RANK", "0")), os.getpid()))
        conn = None
        if rank == 0:
            from multiprocessing.connection import Client

            host, port = args.address.rsplit(":", 1)
            conn = Client((host, int(port)), authkey=authkey)
            conn.send(("hello", {"pids": pids, "world_size": dist.world_size()}))
        server = Server(rank, conn, args.workdir)
    except BaseException as exc:  # noqa: BLE001
        write_error(args.workdir, rank, exc, "start")
        traceback.print_exc()
        return 1
    server.serve()
    # Nothing left to save: skip the interpreter's teardown of torch/DeepSpeed (seconds).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

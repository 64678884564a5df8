"""Process-group setup for DeepSpeed on CPU or GPU: one rank in-process, or N under torchrun.

``init_distributed()`` is idempotent. On one rank it fills RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/
MASTER_PORT when they are unset, so a notebook or a Prefect task needs no launcher. On CPU it
uses gloo and skips DeepSpeed's shared-memory comm op, whose C++ build costs 60-80 s per fresh
machine (measured here); gloo alone is what the tests measure.
"""

from __future__ import annotations

import importlib
import os
import socket
from typing import Any

__all__ = [
    "init_distributed",
    "child_env",
    "free_port",
    "rank",
    "world_size",
    "is_rank0",
    "barrier",
    "all_reduce_max",
    "all_reduce_sum",
    "all_gather_object",
    "broadcast_object",
]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; someone may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Whether this process picked MASTER_PORT itself (one rank, no launcher): then a port taken in the
# meantime may be replaced by another; a launcher's or the user's port never is.
_PORT_CHOSEN_HERE = False
# The torch WORLD group DeepSpeed's comm was last set up over in this process: when the current
# one is another object, the old one was destroyed and DeepSpeed's cached groups point at it.
_DS_WORLD = None


def _fill_single_rank_env() -> None:
    """What a one-rank world needs and no launcher set. A world of one may arrive partly filled:
    a process started from one that ran a trainer inherits its RANK/WORLD_SIZE but not always its
    MASTER_PORT (a live port is dropped so it cannot clash), and DeepSpeed then falls back to MPI
    discovery (`No module named 'mpi4py'`). A launcher's world of several ranks is left alone."""
    global _PORT_CHOSEN_HERE
    if os.environ.setdefault("WORLD_SIZE", "1") != "1":
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
        _PORT_CHOSEN_HERE = True


def _init_gloo_single_rank(deepspeed) -> None:
    """deepspeed.init_distributed over gloo. A free port found with bind(0) is only free until
    someone takes it: the kernel may hand the same ephemeral port to an outgoing connection (an
    API call of this process) before the rendezvous store listens on it (seen: EADDRINUSE in a
    busy test run). When this process chose the port, it chooses another and tries again."""
    from deepspeed.comm import comm as ds_comm

    for attempt in range(5):
        try:
            deepspeed.init_distributed(dist_backend="gloo")
            return
        except Exception as exc:  # torch.distributed.DistNetworkError (a RuntimeError)
            if not (_PORT_CHOSEN_HERE and "EADDRINUSE" in str(exc)) or attempt == 4:
                raise
            ds_comm.cdb = None
            os.environ["MASTER_PORT"] = str(free_port())


def _on_cpu() -> bool:
    import torch

    return os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()


def init_distributed() -> None:
    """Start the process group once (gloo on CPU, nccl on GPU); a no-op when already started."""
    import torch

    _fill_single_rank_env()
    if _on_cpu():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as td

    if _on_cpu():
        # DeepSpeed builds a shared-memory comm op (60-80 s of C++) whenever it sets up its comm
        # backend, even over a process group that vLLM already started: patch it out first.
        # `import deepspeed.comm.torch as m` would bind the torch package (deepspeed.comm
        # re-exports it), so patching that name silently does nothing: go through importlib.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    global _DS_WORLD
    if (td.is_available() and td.is_initialized() and deepspeed.comm.is_initialized()
            and td.group.WORLD is _DS_WORLD):
        return
    if not td.is_initialized() or _DS_WORLD is not None:
        # The process group DeepSpeed was set up over is gone: someone tore it down (an in-process
        # vLLM engine does on shutdown) and maybe started another (the next engine, accelerate).
        # DeepSpeed would keep handing out its destroyed groups ("Group ... is not registered"):
        # drop its references first.
        from deepspeed.comm import comm as ds_comm
        from deepspeed.utils import groups

        groups._release_process_group_references()
        ds_comm.cdb = None
    # Over an existing torch process group (vLLM's, in-process) DeepSpeed wraps it.
    if _on_cpu():
        _init_gloo_single_rank(deepspeed)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        deepspeed.init_distributed(dist_backend="nccl")
    _DS_WORLD = td.group.WORLD


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default os.environ) without the single-rank variables init_distributed set: a
    subprocess (a torchrun job, another rlmill process) must not inherit this process's
    MASTER_PORT, or it fails to listen on a port this process holds."""
    env = dict(os.environ if env is None else env)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _td():
    import torch.distributed as td

    return td if td.is_available() and td.is_initialized() else None


def rank() -> int:
    td = _td()
    return td.get_rank() if td else 0


def world_size() -> int:
    td = _td()
    return td.get_world_size() if td else 1


def is_rank0() -> bool:
    return rank() == 0


def barrier() -> None:
    td = _td()
    if td and td.get_world_size() > 1:
        td.barrier()


def _all_reduce(value: float | list[float], op: str) -> Any:
    import torch

    td = _td()
    scalar = not isinstance(value, list)
    t = torch.tensor([value] if scalar else value, dtype=torch.float64)
    if td and td.get_world_size() > 1:
        if t.device.type == "cpu" and td.get_backend() == "nccl":
            t = t.cuda()
        td.all_reduce(t, op=getattr(td.ReduceOp, op))
    out = t.cpu().tolist()
    return out[0] if scalar else out


def all_reduce_max(value: float) -> float:
    """Largest ``value`` over ranks (e.g. how many micro-batches the busiest rank runs)."""
    return _all_reduce(value, "MAX")


def all_reduce_sum(value: float | list[float]) -> float | list[float]:
    """Sum over ranks of a number or a list of numbers (metrics)."""
    return _all_reduce(value, "SUM")


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled; for small host-side results)."""
    td = _td()
    if not td or td.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * td.get_world_size()
    td.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` as rank ``src`` has it, on every rank."""
    td = _td()
    if not td or td.get_world_size() == 1:
        return obj
    box = [obj]
    td.broadcast_object_list(box, src=src)
    return box[0]

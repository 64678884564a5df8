"""Data-parallel rollout: N replicas of a rollout engine, each in its own process, prompts split evenly.

    >>> from gpu_jobs.rollout import RolloutEngineConfig, SamplingConfig
    >>> from gpu_jobs.rollout.data_parallel import build_rollout_engine
    >>> engine = build_rollout_engine("hf", "builtin", RolloutEngineConfig(data_parallel_size=2))
    >>> rows = engine.generate(prompts, n=8, sampling=SamplingConfig(seed=0))   # replica 0: first half
    >>> engine.update_weights(trainer.gathered_state_dict())                   # every replica
    >>> engine.close()

`rollout.engine_options.data_parallel_size` > 1 builds this around the chosen backend (hf or
vLLM): what verl calls rollout data parallelism, one engine per device group, each device group
`tensor_parallel_size` wide (vLLM's own tensor parallelism inside a replica; GPU only). On a CUDA
machine replica j sees devices j*tp .. (j+1)*tp-1 (CUDA_VISIBLE_DEVICES); on CPU the replicas
share the cores, each with cores / N threads, which proves the sharding and the weight sync but
buys no speed on a small box.

Sampling: replica j gets a contiguous shard of the prompts starting at prompt s_j and the seed
`seed + s_j * SEED_STRIDE`. vLLM seeds each prompt with `seed + index * SEED_STRIDE`, so with
vLLM the samples are the ones one engine would draw; the hf backend draws from one generator per
call, so its samples depend on the replica count (fixed by the frozen run config, so a resumed run
draws the same).

Weights: every replica gets every update, bucket by bucket (`update_weights_partial` from a rank
group, or a whole state dict cut into buckets here), then applies it at once; a replica holds one
full copy of the weights, as a single engine does. A replica that raises or dies fails the call
with its index, pid and error; the other replicas keep their state, and `close()` (or the parent's
exit: replicas leave when their pipe closes) ends them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from typing import Any

SEED_STRIDE = 1_000_003  # = gpu_jobs.rollout.vllm_engine._SEED_STRIDE (checked by a test)
BUCKET_BYTES = 64 << 20
START_TIMEOUT_S = 900.0


def build_rollout_engine(name: str, model_path: Any, config: Any = None, **kwargs: Any) -> Any:
    """The rollout engine a config asks for: `data_parallel_size` replicas of backend `name`, or
    one engine (gpu_jobs.rollout.get_rollout_engine) when it is 1. Lives here, not in
    rollout.base, so that the replicas' own engine factory never imports this module back."""
    from gpu_jobs.rollout import ROLLOUT_ENGINES, RolloutEngineConfig, get_rollout_engine

    config = config or RolloutEngineConfig()
    if config.data_parallel_size == 1:
        return get_rollout_engine(name, model_path, config, **kwargs)
    ROLLOUT_ENGINES[name]  # an unknown backend fails here, listing the valid ones, not in a replica
    return DataParallelRollout(name, model_path, config, config.data_parallel_size, **kwargs)


class RolloutReplicaError(RuntimeError):
    """A replica raised, died, or did not start; the message names it and carries its error."""


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` contiguous shards of range(total), sizes differing by at most one
    (the first `total % parts` shards get the extra item); empty shards when total < parts."""
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for j in range(parts):
        stop = start + base + (1 if j < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def replica_env(index: int, tensor_parallel_size: int, n_replicas: int, cpu_threads: int,
                cuda: bool) -> dict[str, str]:
    """Environment of replica `index`: its own CUDA devices on a GPU machine, its thread share on CPU."""
    env = {"OMP_NUM_THREADS": str(cpu_threads), "RLMILL_ROLLOUT_REPLICA": str(index)}
    if cuda:
        first = index * tensor_parallel_size
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in range(first, first + tensor_parallel_size))
    return env


def _chunks(state: dict[str, Any], bucket_bytes: int):
    bucket: dict[str, Any] = {}
    size = 0
    for name, tensor in state.items():
        bucket[name] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = {}, 0
    if bucket:
        yield bucket


def _serve(conn, backend: str, model_path: Any, config: Any, kwargs: dict, env: dict[str, str]) -> None:
    """A replica's main loop (a spawned process): build the engine, then answer (method, args)
    messages until the pipe closes. Weight buckets accumulate until `finish_weight_update`."""
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from gpu_jobs.rollout import get_rollout_engine  # the package: importing it registers the backends

    try:
        engine = get_rollout_engine(backend, model_path, config, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    conn.send(("ready", os.getpid()))
    pending: dict[str, Any] = {}
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe or died: nothing left to serve
            return
        try:
            if method == "weights_part":
                pending.update({k: v.clone() for k, v in args[0].items()})  # own it, not the sender's shm
                result = None
            elif method == "finish_weight_update":
                engine.update_weights(pending)
                pending, result = {}, None
            elif method == "close":
                getattr(engine, "close", lambda: None)()
                conn.send(("ok", None))
                return
            else:
                result = getattr(engine, method)(*args)
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
            pending = {} if method == "finish_weight_update" else pending
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class DataParallelRollout:
    """`n_replicas` engines of `backend` in spawned processes, used through the RolloutEngine
    interface (generate, score_tokens, update_weights, close)."""

    def __init__(self, backend: str, model_path: Any, config: Any, n_replicas: int, *,
                 start_timeout: float = START_TIMEOUT_S, **kwargs: Any):
        if n_replicas < 2:
            raise ValueError(f"a data-parallel rollout needs at least 2 replicas, got {n_replicas}")
        if not isinstance(model_path, (str, os.PathLike)):
            raise TypeError("data-parallel replicas load the model themselves: pass a folder, URL or alias, "
                            "not an in-memory module")
        import torch

        self.backend, self.n = backend, n_replicas
        cuda = torch.cuda.is_available()
        threads = max(1, (os.cpu_count() or 1) // n_replicas)
        inner = config.model_copy(update={"data_parallel_size": 1})  # a replica is one engine
        ctx = mp.get_context("spawn")  # a fork would copy this process's threads and torch state
        self._conns, self._procs = [], []
        try:
            for j in range(n_replicas):
                parent, child = ctx.Pipe()
                env = replica_env(j, config.tensor_parallel_size, n_replicas, threads, cuda)
                proc = ctx.Process(target=_serve, args=(child, backend, str(model_path), inner, kwargs, env),
                                   name=f"rlmill-rollout-replica-{j}", daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            deadline = time.monotonic() + start_timeout
            self.pids = [self._receive(j, "start", deadline) for j in range(n_replicas)]
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"DataParallelRollout({self.backend!r} x {self.n}, pids {getattr(self, 'pids', '?')})"

    # -- the RolloutEngine interface -------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, sampling: Any) -> list[dict]:
        """Replica j generates for its shard of prompts; rows come back prompt-major, with the
        prompt indices of the whole call."""
        shards = split_evenly(len(prompts), self.n)
        calls = {}
        for j, (start, stop) in enumerate(shards):
            if stop > start:
                seed = None if sampling.seed is None else sampling.seed + start * SEED_STRIDE
                calls[j] = (prompts[start:stop], n, sampling.model_copy(update={"seed": seed}))
        results = self._call_each("generate", calls)
        rows = []
        for j, (start, _) in enumerate(shards):
            for row in results.get(j, []):
                row["prompt_index"] += start
                rows.append(row)
        return rows

    def score_tokens(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        shards = split_evenly(len(sequences), self.n)
        results = self._call_each("score_tokens", {j: (sequences[a:b], temperature)
                                                   for j, (a, b) in enumerate(shards) if b > a})
        return [scores for j in range(self.n) for scores in results.get(j, [])]

    def update_weights(self, weights: Any) -> None:
        """A folder / URL: every replica loads it. A state dict: sent to every replica in buckets."""
        if isinstance(weights, (str, os.PathLike)):
            self._call_each("update_weights", {j: (str(weights),) for j in range(self.n)})
            return
        for bucket in _chunks(weights, BUCKET_BYTES):
            self.update_weights_partial(bucket)
        self.finish_weight_update()

    def update_weights_partial(self, bucket: dict[str, Any]) -> None:
        """One bucket of a weight update, to every replica; applied by finish_weight_update()."""
        self._call_each("weights_part", {j: (bucket,) for j in range(self.n)})

    def finish_weight_update(self) -> None:
        self._call_each("finish_weight_update", {j: () for j in range(self.n)})

    def close(self) -> None:
        """Stop every replica (politely, then by force); idempotent."""
        for conn, proc in zip(self._conns, self._procs):
            try:
                if proc.is_alive():
                    conn.send(("close", ()))
                    if conn.poll(30):
                        conn.recv()
            except (EOFError, OSError):
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            conn.close()
        self._conns, self._procs = [], []

    def alive_pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.is_alive()]

    # -- plumbing -------------------------------------------------------------------------

    def _call_each(self, method: str, calls: dict[int, tuple]) -> dict[int, Any]:
        """Send every call first (the replicas work at the same time), then collect the answers;
        the first failure is raised after all answers are in, so no reply is left in a pipe."""
        for j, args in calls.items():
            try:
                self._conns[j].send((method, args))
            except (OSError, ValueError) as exc:
                raise self._dead(j, method, exc) from exc
        results, errors = {}, []
        for j in calls:
            try:
                results[j] = self._receive(j, method, None)
            except RolloutReplicaError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return results

    def _receive(self, j: int, method: str, deadline: float | None) -> Any:
        conn, proc = self._conns[j], self._procs[j]
        while not conn.poll(1.0):
            if not proc.is_alive():
                raise self._dead(j, method)
            if deadline is not None and time.monotonic() > deadline:
                raise RolloutReplicaError(f"rollout replica {j} (pid {proc.pid}) did not start within "
                                          f"{START_TIMEOUT_S:.0f} s")
        try:
            kind, value = conn.recv()
        except (EOFError, OSError) as exc:
            raise self._dead(j, method, exc) from exc
        if kind == "error":
            raise RolloutReplicaError(f"rollout replica {j} of {self.n} (pid {proc.pid}) failed in {method}: {value}")
        return value

    def _dead(self, j: int, method: str, exc: BaseException | None = None) -> RolloutReplicaError:
        proc = self._procs[j]
        proc.join(1)
        return RolloutReplicaError(f"rollout replica {j} of {self.n} (pid {proc.pid}) died during {method} "
                                   f"(exit code {proc.exitcode}){f': {exc}' if exc else ''}; the run's retry "
                                   f"starts the replicas again")

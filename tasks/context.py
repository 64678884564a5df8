"""Where a stage task finds its run's warm engines.

The flow opens one RunContext per run and attaches it here; tasks receive only the run key
(a short string Prefect can show and hash) and look the context up. In colocated placement the
tasks run in the flow process, so the lookup hits the warm engines. A task run in a process
that has no context for the key (a retried task on a fresh worker) rebuilds one from storage.
"""

from __future__ import annotations

import threading

from gpu_jobs.stages import RunContext
from gpu_jobs.stages.iteration import probe_agreement

_LIVE: dict[str, RunContext] = {}
_LOCK = threading.Lock()


def run_key(root: str, run_id: str) -> str:
    return f"{root.rstrip('/')}::{run_id}"


def attach(ctx: RunContext) -> str:
    key = run_key(ctx.cfg.root, ctx.cfg.run_id)
    with _LOCK:
        _LIVE[key] = ctx
    return key


def detach(key: str) -> None:
    with _LOCK:
        ctx = _LIVE.pop(key, None)
    if ctx is not None:
        ctx.close()


def context_for(key: str) -> RunContext:
    with _LOCK:
        ctx = _LIVE.get(key)
    if ctx is None:
        ctx = RunContext.from_storage(*key.rsplit("::", 1))
        ctx.warm()
        ctx.restore()
        probe_agreement(ctx, f"a resume in a fresh process (weights after iteration {ctx.trainer_k})")
        attach(ctx)
    return ctx

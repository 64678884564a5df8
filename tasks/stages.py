"""Prefect tasks, one per stage: thin wrappers over gpu_jobs.stages, made from each stage's
declaration (`stage_task(spec)`), so a new `@stage` has its task with no edit here.

Each task takes the run, its warm roles and the iteration (plus the URIs of its committed
inputs) and returns the URI of the manifest it committed. The run and roles are passed as
they are (plain objects, never serialized): colocated tasks run in the flow process. The cache
key is (run uid, iteration, stage, input URIs, whether the stage is committed now) — never the
flow run id, so a resumed flow run reuses what committed, and a stage `rlmill verify --repair`
uncommitted runs again instead of returning its old URI from Prefect's cache. Stages are
idempotent on their own (they return an existing manifest), so a retry is always harmless.
A stage that commits nothing (the weight hand-off) is never cached: its inputs cannot be hashed.

A failed task is retried after a wait (tasks.retry_delay_seconds, by default 10 s, then 40 s),
never at once: a retry sent straight back into the fault that failed it (an object-store outage
longer than storage's own retry budget, a restarting service) fails the same way.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from gpu_jobs.stages import StageSpec
from gpu_jobs.stages.sections import TaskConfig
from storage import committed

_NOT_INPUTS = ("run", "roles", "k")


def stage_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    run, k, name = parameters["run"], parameters["k"], context.task.name
    inputs = [str(v) for key, v in sorted(parameters.items()) if key not in _NOT_INPUTS]
    digest = hashlib.sha256("\0".join(inputs).encode()).hexdigest()[:16]
    state = "done" if committed(run.layout.stage(k, name), run.storage) else "todo"
    return f"rlmill-{run.run_uid}-{k}-{name}-{digest}-{state}"


# The defaults of TaskConfig (tasks.retries, tasks.retry_delay_seconds): the flow applies the run's own
# settings with `with_options`; a task used bare retries the same way, with backoff, never at once.
_TASKS = TaskConfig()
_RETRY = dict(retries=_TASKS.retries, retry_delay_seconds=_TASKS.retry_delay_seconds)


@functools.cache
def stage_task(spec: StageSpec) -> Task:
    """The Prefect task of a stage: named after it, with the compute's parameters (the cache key
    and the UI read them), calling the spec at run time (a wrapped `spec.compute` is honoured).
    The parameters are the declared compute's (`spec.__wrapped__`), not those of a wrapper a test
    put on `spec.compute` when this task was first built: the task is cached for the process."""
    signature = inspect.signature(spec.__wrapped__)

    def run_stage(*args: Any, **kwargs: Any) -> Any:
        # Prefect passes parameters with defaults by keyword: the stage gets them in order, as
        # the graph and DirectCalls pass them.
        bound = signature.bind(*args, **kwargs)
        return spec(*bound.args, **bound.kwargs)

    run_stage.__signature__ = signature  # type: ignore[attr-defined]
    run_stage.__name__ = run_stage.__qualname__ = spec.__name__
    run_stage.__doc__ = spec.__doc__
    caching = dict(cache_key_fn=stage_cache_key, persist_result=True) if spec.commits else dict(cache_policy=NO_CACHE)
    return task(run_stage, name=spec.name, **caching, **_RETRY)

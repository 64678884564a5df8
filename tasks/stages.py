"""Prefect tasks, one per stage: thin wrappers over gpu_jobs.stages.

Each task takes the run, its warm engines and the iteration (plus the URIs of its committed
inputs) and returns the URI of the manifest it committed. The run and engines are passed as
they are (plain objects, never serialized): colocated tasks run in the flow process. The cache
key is (run uid, iteration, stage, input URIs, whether the stage is committed now) — never the
flow run id, so a resumed flow run reuses what committed, and a stage `rlmill verify --repair`
uncommitted runs again instead of returning its old URI from Prefect's cache. Stages are
idempotent on their own (they return an existing manifest), so a retry is always harmless.

A failed task is retried after a wait (tasks.retry_delay_seconds, by default 10 s, then 40 s),
never at once: a retry sent straight back into the fault that failed it (an object-store outage
longer than storage's own retry budget, a restarting service) fails the same way.
"""

from __future__ import annotations

import hashlib
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from gpu_jobs.stages import STAGE_FUNCTIONS
from gpu_jobs.stages.config import TaskConfig
from storage import committed

_NOT_INPUTS = ("run", "engines", "k")


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
_STAGE = dict(cache_key_fn=stage_cache_key, persist_result=True, **_RETRY)
_fn = STAGE_FUNCTIONS


@task(name="rollout", **_STAGE)
def rollout(run, engines, k: int) -> str:
    return _fn["rollout"](run, engines, k)


@task(name="baseline", **_STAGE)
def baseline(run, engines, k: int, rollout_uri: str) -> str | None:
    return _fn["baseline"](run, engines, k, rollout_uri)


@task(name="gate", **_STAGE)
def gate(run, engines, k: int, rollout_uri: str) -> str:
    return _fn["gate"](run, engines, k, rollout_uri)


@task(name="reward_model", **_STAGE)
def reward_model(run, engines, k: int, batch_uri: str) -> str | None:
    return _fn["reward_model"](run, engines, k, batch_uri)


@task(name="reward", **_STAGE)
def reward(run, engines, k: int, batch_uri: str, rm_uri: str | None = None) -> str:
    return _fn["reward"](run, engines, k, batch_uri, rm_uri)


@task(name="logprobs", **_STAGE)
def logprobs(run, engines, k: int, batch_uri: str) -> str | None:
    return _fn["logprobs"](run, engines, k, batch_uri)


@task(name="values", **_STAGE)
def values(run, engines, k: int, batch_uri: str) -> str | None:
    return _fn["values"](run, engines, k, batch_uri)


@task(name="advantages", **_STAGE)
def advantages(run, engines, k: int, batch_uri: str, reward_uri: str, logprobs_uri: str | None,
               values_uri: str | None, baseline_uri: str | None = None) -> str:
    return _fn["advantages"](run, engines, k, batch_uri, reward_uri, logprobs_uri, values_uri, baseline_uri)


@task(name="update", **_STAGE)
def update(run, engines, k: int, adv_uri: str) -> str:
    return _fn["update"](run, engines, k, adv_uri)


@task(name="weight-sync", cache_policy=NO_CACHE, **_RETRY)  # nothing to cache; its inputs cannot be hashed
def sync_weights(run, engines, k: int) -> float:
    """In-memory hand-off of the new weights to the rollout engine (nothing to commit)."""
    return _fn["weight-sync"](run, engines, k)


@task(name="commit", **_STAGE)
def commit(run, engines, k: int, stage_uris: dict[str, str | None], extra_metrics: dict) -> str:
    return _fn["commit"](run, engines, k, stage_uris, extra_metrics)


@task(name="validate", **_STAGE)
def validate(run, engines, k: int) -> str:
    return _fn["validate"](run, engines, k)


STAGE_TASKS = {t.name: t for t in (rollout, baseline, gate, reward_model, reward, logprobs, values, advantages, update,
                                   sync_weights, commit, validate)}
assert set(STAGE_TASKS) == set(STAGE_FUNCTIONS), "every stage function has its task"

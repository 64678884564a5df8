"""Prefect tasks, one per stage: thin wrappers over gpu_jobs.stages.

Each task takes the run key and the iteration (plus the URIs of its committed inputs) and
returns the URI of the manifest it committed. The cache key is (run uid, iteration, stage,
input URIs, whether the stage is committed now) — never the flow run id, so a resumed flow run
reuses what committed, and a stage `rlmill verify --repair` uncommitted runs again instead of
returning its old URI from Prefect's cache. Stages are idempotent on their own (they return an
existing manifest), so a retry is always harmless.
"""

from __future__ import annotations

import hashlib
from typing import Any

from prefect import task
from prefect.context import TaskRunContext

from gpu_jobs import stages
from storage import committed
from tasks.context import context_for


def stage_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    ctx = context_for(parameters["key"])
    inputs = [str(v) for name, v in sorted(parameters.items()) if name not in ("key", "k")]
    digest = hashlib.sha256("\0".join(inputs).encode()).hexdigest()[:16]
    name, k = context.task.name, parameters["k"]
    state = "done" if committed(ctx.layout.stage(k, name), ctx.storage) else "todo"
    return f"rlmill-{ctx.run_uid}-{k}-{name}-{digest}-{state}"


_STAGE = dict(cache_key_fn=stage_cache_key, persist_result=True, retries=2, retry_delay_seconds=0)


@task(name="rollout", **_STAGE)
def rollout(key: str, k: int) -> str:
    return stages.rollout(context_for(key), k)


@task(name="baseline", **_STAGE)
def baseline(key: str, k: int, rollout_uri: str) -> str | None:
    return stages.baseline(context_for(key), k, rollout_uri)


@task(name="gate", **_STAGE)
def gate(key: str, k: int, rollout_uri: str) -> str:
    return stages.gate(context_for(key), k, rollout_uri)


@task(name="reward", **_STAGE)
def reward(key: str, k: int, batch_uri: str) -> str:
    return stages.reward(context_for(key), k, batch_uri)


@task(name="logprobs", **_STAGE)
def logprobs(key: str, k: int, batch_uri: str) -> str | None:
    return stages.logprobs(context_for(key), k, batch_uri)


@task(name="values", **_STAGE)
def values(key: str, k: int, batch_uri: str) -> str | None:
    return stages.values(context_for(key), k, batch_uri)


@task(name="advantages", **_STAGE)
def advantages(key: str, k: int, batch_uri: str, reward_uri: str, logprobs_uri: str | None,
               values_uri: str | None, baseline_uri: str | None = None) -> str:
    return stages.advantages(context_for(key), k, batch_uri, reward_uri, logprobs_uri, values_uri, baseline_uri)


@task(name="update", **_STAGE)
def update(key: str, k: int, adv_uri: str) -> str:
    return stages.update(context_for(key), k, adv_uri)


@task(name="weight-sync", retries=2, retry_delay_seconds=0)
def sync_weights(key: str, k: int) -> float:
    """In-memory hand-off of the new weights to the rollout engine (nothing to commit)."""
    return stages.sync_weights(context_for(key))


@task(name="commit", **_STAGE)
def commit(key: str, k: int, stage_uris: dict[str, str | None], extra_metrics: dict) -> str:
    return stages.commit(context_for(key), k, stage_uris, extra_metrics)


@task(name="validate", **_STAGE)
def validate(key: str, k: int, weights_ref: str) -> str:
    return stages.validate(context_for(key), k)


STAGE_TASKS = {t.name: t for t in (rollout, baseline, gate, reward, logprobs, values, advantages, update,
                                   sync_weights, commit, validate)}

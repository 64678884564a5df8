"""The iteration's stages in order, written once.

    uris = run_iteration(DirectCalls(run, roles), run.cfg, k)     # tests, benchmarks: plain calls
    uris = run_iteration(PrefectCalls(...), run.cfg, k)             # the flow: Prefect tasks / remote runs

`run_iteration` says which stage runs after which and what each one reads; the `calls` argument
says how a stage is run. It passes the stage objects themselves (`StageSpec`, declared with
`@stage` in iteration.py), so everything about a stage — its compute, whether the run needs it,
where it runs — is read from its one declaration. Adding a stage is one decorated function and
one line here.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from gpu_jobs.stages import iteration as st
from gpu_jobs.stages import preference as pref
from gpu_jobs.stages import sft
from gpu_jobs.stages.roles import Roles
from gpu_jobs.stages.run import Run
from gpu_jobs.stages.shell import StageSpec

__all__ = ["StageCalls", "DirectCalls", "run_iteration"]


class StageCalls(Protocol):
    """How the graph runs a stage: `calls(stage, k, *inputs)` returns what the stage returns (a
    manifest URI); `calls.start(...)` starts it and returns a function that waits for it."""

    def __call__(self, stage: StageSpec, k: int, *inputs: Any) -> Any: ...

    def start(self, stage: StageSpec, k: int, *inputs: Any) -> Callable[[], Any]: ...


class DirectCalls:
    """Stages as plain function calls in this process, one after another."""

    def __init__(self, run: Run, roles: Roles):
        self.run, self.roles = run, roles

    def __call__(self, stage: StageSpec, k: int, *inputs: Any) -> Any:
        return stage(self.run, self.roles, k, *inputs)

    def start(self, stage: StageSpec, k: int, *inputs: Any) -> Callable[[], Any]:
        result = self(stage, k, *inputs)
        return lambda: result


def run_iteration(calls: StageCalls, cfg: Any, k: int) -> dict[str, str | None]:
    """rollout -> gate -> {reward model -> reward, log-probs, values} -> advantages -> update ->
    weight sync -> commit. Returns every stage's manifest URI (None for stages the algorithm does
    not need: the flow does not even start a task for those, ~25 ms of API calls each).

    With async_training.staleness_threshold = s > 0 the rollout runs ahead: iteration k's own
    rollout was made during iteration k-s (with the weights after update k-1-s), and iteration k
    starts the rollout of k+s with the weights after update k-1, concurrently with update k.

    A preference run (cfg.preference) is `_preference_iteration` instead, an SFT run (cfg.sft)
    `_sft_iteration`.
    """
    if cfg.preference is not None:
        return _preference_iteration(calls, cfg, k)
    if cfg.sft is not None:
        return _sft_iteration(calls, cfg, k)
    rollout = calls(st.rollout, k)
    baseline = calls(st.baseline, k, rollout) if st.baseline.is_needed(cfg) else None  # ReMax only
    batch = calls(st.gate, k, rollout)
    # Scoring and the log-prob/value passes are independent: they may run concurrently. The
    # reward model is its own stage (own engine, own commit); the reward stage combines its scores.
    pending = {spec.name: calls.start(spec, k, batch) for spec in (st.reward_model, st.logprobs, st.values)
               if spec.is_needed(cfg)}
    rm = pending["reward_model"]() if "reward_model" in pending else None
    reward = calls(st.reward, k, batch, rm)
    logprobs, values = (pending[n]() if n in pending else None for n in ("logprobs", "values"))
    advantages = calls(st.advantages, k, batch, reward, logprobs, values, baseline)
    if cfg.async_training.staleness_threshold == 0:
        update = calls(st.update, k, advantages)
        sync_s = calls(st.weights_to_rollout, k)
    else:
        update, sync_s = _update_with_rollout_ahead(calls, cfg, k, advantages)
    uris = {"rollout": rollout, "baseline": baseline, "gate": batch, "reward_model": rm, "reward": reward,
            "logprobs": logprobs, "values": values, "advantages": advantages, "update": update}
    uris["commit"] = calls(st.commit, k, uris, {"timing_s/weight_sync": sync_s})
    return uris


def _update_with_rollout_ahead(calls: StageCalls, cfg: Any, k: int, advantages: str) -> tuple[str, float]:
    """Update k while the rollout of k+s samples with the weights after update k-1.

    Rollouts k+1 .. k+s-1 use older weights and were made by earlier iterations (after a resume
    they are made here first, one by one, from published weights). The engine then takes the
    trainer's weights (still those after update k-1) before anything runs concurrently, so the
    rollout started next never races the update for them.
    """
    s, last = cfg.async_training.staleness_threshold, cfg.trainer.total_iterations
    for j in range(k + 1, min(k + s, last + 1)):
        calls(st.rollout, j)
    sync_s = calls(st.weights_to_rollout, k)
    ahead = calls.start(st.rollout, k + s) if k + s <= last else None
    update = calls(st.update, k, advantages)
    if ahead is not None:
        ahead()
    return update, sync_s


def _preference_iteration(calls: StageCalls, cfg: Any, k: int) -> dict[str, str | None]:
    """preference batch -> reference log-probs -> update (DPO/KTO loss) -> commit: no rollout, so
    no weight sync either (validation scores held-out pairs with the trainer itself)."""
    batch = calls(pref.preference_batch, k)
    ref = calls(pref.preference_ref, k, batch)
    update = calls(st.update, k, ref)
    uris: dict[str, str | None] = {"rollout": None, "gate": None, "reward": None, "preference_batch": batch,
                                   "preference_ref": ref, "update": update}
    uris["commit"] = calls(st.commit, k, uris, {})
    return uris


def _sft_iteration(calls: StageCalls, cfg: Any, k: int) -> dict[str, str | None]:
    """SFT batch -> update (the SFT loss) -> commit: no rollout, no reference, no weight sync
    (validation scores held-out demonstrations with the trainer itself)."""
    batch = calls(sft.sft_batch, k)
    update = calls(st.update, k, batch)
    uris: dict[str, str | None] = {"rollout": None, "gate": None, "reward": None, "sft_batch": batch, "update": update}
    uris["commit"] = calls(st.commit, k, uris, {})
    return uris

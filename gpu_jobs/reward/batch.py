"""Score a batch of responses: built-ins in-process, user functions in a guarded worker pool.

    >>> from gpu_jobs.reward import RewardConfig, score_batch
    >>> rows = [{"data_source": "rlmill/arith", "solution_str": "82", "ground_truth": "82"}]
    >>> scores, reward_extra, metrics = score_batch(rows, RewardConfig())
    >>> scores, metrics["critic/score/mean"]
    ([1.0], 1.0)

A user's function runs in worker processes with a per-sample timeout. One bad sample never
fails the batch: an exception, a timeout, a NaN or infinity, a non-number, or a score outside
`cfg.score_range` (only when one is set: by default any finite score counts, as in verl) scores
`cfg.on_error`, its row's reward_extra gets `error` / `error_kind`, and the
metrics count it (`reward/errors`, `reward/timeouts`). The pool is gpu_jobs.reward.sandbox's
(shared with users' tools): a hung sample is abandoned by killing the pool's processes and
starting a new pool; the other in-flight samples are re-run.

A response sampled with an environment (rollout.multi_turn.environment) carries the
environment's rewards in `extra_info["turn_scores"]`; with the built-ins, its score is the
environment's final reward (`environment_score`), whatever its data_source; a user's function
gets them and decides.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from .config import RewardConfig
from .custom import load_custom_reward_function
from .ground_truth import decode_ground_truth
from .registry import default_compute_score, get_reward_fn
from .sandbox import Failed, SandboxSpec, run_guarded

__all__ = ["score_batch", "coerce_result", "environment_score"]

# (status, score, extras, error_kind, error_message) travels back from a worker; plain tuples
# pickle cheaply and cannot carry a user's unpicklable exception object.
_OK, _ERR = "ok", "error"


def coerce_result(res: Any, score_range: tuple[float, float] | None) -> tuple[float, dict[str, Any]]:
    """A reward function's return value -> (score, extras); raises ValueError/TypeError when it
    is not a finite number (or a dict whose "score" is one) inside `score_range`."""
    extras: dict[str, Any] = {}
    if isinstance(res, Mapping):
        if "score" not in res:
            raise ValueError(f"reward dict has no 'score' key (keys: {sorted(map(str, res))})")
        extras = {str(k): _json_value(v) for k, v in res.items() if k != "score"}
        res = res["score"]
    if isinstance(res, (str, bytes)) or not _is_number(res):
        raise TypeError(f"reward is not a number: {type(res).__name__} {res!r:.80}")
    score = float(res)
    if not math.isfinite(score):
        raise ValueError(f"reward is not finite: {score}")
    if score_range is not None and not score_range[0] <= score <= score_range[1]:
        raise ValueError(f"reward {score} is outside the declared score_range {tuple(score_range)}")
    return score, extras


def _is_number(x: Any) -> bool:
    try:
        float(x)
    except (TypeError, ValueError):
        return False
    return not isinstance(x, (str, bytes))


def _json_value(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return str(v)


def _call(fn, task: tuple, kwargs: dict, score_range) -> tuple:
    data_source, solution_str, ground_truth, extra_info = task
    try:
        # Keywords, as verl's reward managers call it: user functions are written against these names.
        res = fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **kwargs,
        )
        score, extras = coerce_result(res, score_range)
    except (TypeError, ValueError) as e:
        return (_ERR, None, {}, "invalid", f"{type(e).__name__}: {e}")
    except Exception as e:  # the user's bug, recorded on the sample, never raised
        return (_ERR, None, {}, "exception", f"{type(e).__name__}: {e}")
    return (_OK, score, extras, None, None)


def environment_score(data_source, solution_str, ground_truth, extra_info=None, **_) -> float:
    """The built-in score of a response from an environment: its final reward, the last of
    `extra_info["turn_scores"]` (the earlier ones reach the advantages per turn, not through here).

    >>> environment_score("my/env", "...", None, {"turn_scores": [0.0, 1.0], "num_turns": 2})
    1.0
    """
    return float(extra_info["turn_scores"][-1])


def _from_environment(task: tuple) -> bool:
    extra = task[3]
    return isinstance(extra, Mapping) and isinstance(extra.get("turn_scores"), list) and bool(extra["turn_scores"])


# --------------------------------------------------------------------------------------------
# Worker side: the function is loaded once per process by the initializer, from the path
# (functions loaded from a file cannot be pickled by reference); the pool is sandbox.py's.
# --------------------------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def _worker_init(path: str, name: str, kwargs: dict, score_range) -> None:
    _WORKER.update(fn=load_custom_reward_function(path, name), kwargs=kwargs, score_range=score_range)


def _worker_score(task: tuple) -> tuple:
    return _call(_WORKER["fn"], task, _WORKER["kwargs"], _WORKER["score_range"])


def _score_in_pool(tasks: list[tuple], cfg: RewardConfig) -> tuple[list[tuple], int]:
    """Run every task in the sandbox's worker processes; returns (results, pool restarts)."""
    crf = cfg.custom_reward_function
    spec = SandboxSpec(work=_worker_score, timeout_s=cfg.timeout_s, num_workers=cfg.num_workers, what="reward",
                       init=_worker_init, init_args=(crf.path, crf.name, dict(crf.reward_kwargs), cfg.score_range),
                       startup_timeout_s=cfg.startup_timeout_s, limits=cfg.sandbox.limits())
    results, restarts = run_guarded(tasks, spec)
    return [_failure_row(r, cfg) if isinstance(r, Failed) else r for r in results], restarts


def _failure_row(failed: Failed, cfg: RewardConfig) -> tuple:
    message = {"timeout": f"reward function took longer than timeout_s={cfg.timeout_s}",
               "crash": "reward worker process died while scoring this sample"}.get(failed.kind, failed.message)
    return (_ERR, None, {}, failed.kind, message)


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------
def _task(row: Mapping[str, Any]) -> tuple:
    solution = row["solution_str"] if "solution_str" in row else row["response"]
    extra = row.get("extra_info")
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            pass
    gt = row.get("ground_truth")
    if gt is None and isinstance(row.get("reward_model"), Mapping):
        gt = row["reward_model"].get("ground_truth")
    # A sample table stores a list/dict/number ground truth as marked JSON in its string column:
    # the function gets back exactly what the dataset held, as verl passes it.
    return (row["data_source"], solution, decode_ground_truth(gt), extra)


def score_batch(
    rows: Iterable[Mapping[str, Any]], cfg: RewardConfig
) -> tuple[list[float], list[dict], dict[str, float]]:
    """Score every row; returns (scores, reward_extra, metrics), one score and one dict per row.

    A row has `data_source`, `solution_str` (the decoded response; `response` also accepted),
    `ground_truth` (or verl's `reward_model.ground_truth`; a sample-table cell written by
    `encode_ground_truth` is decoded back to its list/dict/number) and optionally `extra_info`
    (dict or JSON string). With `cfg.custom_reward_function.path` set, the user's function scores every
    row in worker processes; otherwise the built-in scorers run in-process (trusted and cheap).
    An unknown data_source with the built-ins is a configuration error and raises before any
    scoring.
    """
    t0 = time.perf_counter()
    if hasattr(rows, "to_dict") and hasattr(rows, "columns"):
        rows = rows.to_dict("records")  # pandas DataFrame
    tasks = [_task(r) for r in rows]
    restarts = 0
    if cfg.custom_reward_function.path is None:
        fns = [environment_score if _from_environment(t) else default_compute_score for t in tasks]
        for ds in {t[0] for t, fn in zip(tasks, fns) if fn is default_compute_score}:
            get_reward_fn(ds)
        results = [_call(fn, t, {}, cfg.score_range) for fn, t in zip(fns, tasks)]
    elif tasks:
        # Load once here too: a missing file, a syntax error or a wrong name raises now, with
        # its own message, instead of as a broken worker pool.
        crf = cfg.custom_reward_function
        load_custom_reward_function(crf.path, crf.name)
        results, restarts = _score_in_pool(tasks, cfg)
    else:
        results = []

    scores: list[float] = []
    extras: list[dict] = []
    kinds: Counter[str] = Counter()
    for status, score, extra, kind, message in results:
        if status == _OK:
            scores.append(score)
            extras.append(extra)
        else:
            kinds[kind] += 1
            scores.append(float(cfg.on_error))
            extras.append({"error": message, "error_kind": kind})
    return scores, extras, _metrics(scores, kinds, restarts, time.perf_counter() - t0)


def _metrics(scores: list[float], kinds: Counter, restarts: int, seconds: float) -> dict[str, float]:
    n = len(scores)
    errors = sum(kinds.values())
    m = {
        "reward/n": float(n),
        "reward/errors": float(errors),
        "reward/error_rate": errors / n if n else 0.0,
        "reward/timeouts": float(kinds["timeout"]),
        "reward/exceptions": float(kinds["exception"]),
        "reward/invalid": float(kinds["invalid"]),
        "reward/crashes": float(kinds["crash"]),
        "reward/pool_restarts": float(restarts),
        "timing_s/reward": seconds,
    }
    if n:
        m.update({
            "critic/score/mean": sum(scores) / n,
            "critic/score/max": max(scores),
            "critic/score/min": min(scores),
        })
    return m

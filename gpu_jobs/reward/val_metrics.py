"""Validation metrics as verl reports them: mean@N, best@N, worst@N, maj@N per data source.

    >>> m = validation_metrics(["a/x"] * 4, ["p0", "p0", "p1", "p1"],
    ...                        {"reward": [1.0, 0.0, 1.0, 1.0], "pred": ["5", "6", "7", "7"]})
    >>> m["val-core/a/x/reward/mean@2"]
    0.75

Definitions (verl `trainer/ppo/metric_utils.py`, `process_validation_metrics`): responses are
grouped by data source and prompt. For each prompt with N responses and each numeric variable
(the reward, and numeric reward extras such as `acc`): `mean@N` and `std@N` are the mean and
standard deviation of its N values; for n in 2, 4, 8, ... < N and N itself, `best@n` / `worst@n`
are the max / min over n values drawn with replacement, and `maj@n` the value of the answer most
of the n drawn responses predicted (ties: the answer drawn first; its first drawn value), each as
the mean and std over `N_BOOTSTRAP` seeded draws. Every metric is then averaged over the data
source's prompts. Like verl, the mean@/best@/maj@ metrics of the largest n for the core variable
(`acc` when the reward reports it, else `reward`) are `val-core/<data_source>/<var>/<metric>`,
everything else `val-aux/...`.

The bootstrap uses its own seeded generator (`numpy.random.RandomState(seed)`, the stream
verl's `np.random.seed(seed)` + `np.random.choice` draws), so a metric is a pure function of
the responses, and equals verl's for the same inputs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import numpy as np

__all__ = ["validation_metrics", "bootstrap_indices", "best_worst_at", "majority_at", "subset_sizes", "N_BOOTSTRAP",
           "BOOTSTRAP_SEED"]

N_BOOTSTRAP = 1000
BOOTSTRAP_SEED = 42  # verl's default: metrics compare across frameworks for the same responses


def subset_sizes(n_resps: int) -> list[int]:
    """The n of best@n / maj@n for N responses: 2, 4, 8, ... below N, then N (none for N <= 1)."""
    if n_resps <= 1:
        return []
    ns, n = [], 2
    while n < n_resps:
        ns.append(n)
        n *= 2
    return ns + [n_resps]


def bootstrap_indices(n_data: int, subset_size: int, n_bootstrap: int = N_BOOTSTRAP,
                      seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """(n_bootstrap, subset_size) indices into n_data items, drawn with replacement."""
    return np.random.RandomState(seed).choice(n_data, size=(n_bootstrap, subset_size), replace=True)


def best_worst_at(values: Sequence[float], idx: np.ndarray) -> tuple[tuple[float, float], tuple[float, float]]:
    """((best mean, best std), (worst mean, worst std)) over bootstrap draws.

    values: (N,) one prompt's values; idx: (n_bootstrap, n) from `bootstrap_indices`.
    """
    drawn = np.asarray(values, dtype=np.float64)[idx]  # (n_bootstrap, n)
    best, worst = drawn.max(axis=1), drawn.min(axis=1)
    return (float(best.mean()), float(best.std())), (float(worst.mean()), float(worst.std()))


def majority_at(values: Sequence[float], preds: Sequence[Any], idx: np.ndarray) -> tuple[float, float]:
    """(mean, std) over bootstrap draws of the majority answer's value.

    values, preds: (N,) one prompt's values and predicted answers; idx: (n_bootstrap, n). In each
    draw the answer drawn most often wins, a tie going to the one drawn first, and its value is
    that of its first drawn response (verl's `calc_maj_val`, which counts in a dict: insertion
    order breaks ties).
    """
    codes = {p: i for i, p in enumerate(dict.fromkeys(preds))}
    drawn = np.asarray([codes[p] for p in preds])[idx]  # (n_bootstrap, n) answer codes
    counts = (drawn[:, :, None] == drawn[:, None, :]).sum(axis=2)  # (n_bootstrap, n): votes of each slot's answer
    # The first slot holding a most-voted answer is that answer's first draw, and no other
    # most-voted answer was drawn before it: exactly the dict-order winner.
    winner = np.argmax(counts == counts.max(axis=1, keepdims=True), axis=1)  # (n_bootstrap,)
    vals = np.asarray(values, dtype=np.float64)[idx[np.arange(len(idx)), winner]]
    return float(vals.mean()), float(vals.std())


def _prompt_metrics(var_vals: list[float], preds: list[Any] | None, seed: int) -> dict[str, float]:
    """One prompt's metrics of one variable (its N values; its N predicted answers or None)."""
    n_resps = len(var_vals)
    metric = {f"mean@{n_resps}": float(np.mean(var_vals))}
    if n_resps == 1:
        return metric
    metric[f"std@{n_resps}"] = float(np.std(var_vals))
    for n in subset_sizes(n_resps):
        idx = bootstrap_indices(n_resps, n, seed=seed)
        (metric[f"best@{n}/mean"], metric[f"best@{n}/std"]), (metric[f"worst@{n}/mean"], metric[f"worst@{n}/std"]) = \
            best_worst_at(var_vals, idx)
        if preds is not None:
            metric[f"maj@{n}/mean"], metric[f"maj@{n}/std"] = majority_at(var_vals, preds, idx)
    return metric


def validation_metrics(data_sources: Sequence[str], prompt_uids: Sequence[str], infos: dict[str, Sequence[Any]],
                       seed: int = BOOTSTRAP_SEED) -> dict[str, float]:
    """verl's val-core/val-aux metrics (module doc) as one flat dict.

    data_sources, prompt_uids: (rows,) per response; infos: variable -> (rows,) values, with
    `reward` (the score), optional numeric extras, and optional `pred` (the predicted answer,
    which maj@n votes on). Non-numeric variables other than `pred` are skipped.
    """
    groups: dict[str, dict[str, dict[str, list]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, (source, uid) in enumerate(zip(data_sources, prompt_uids)):
        for var, vals in infos.items():
            groups[source][uid][var].append(vals[i])
    per_source: dict[str, dict[str, dict[str, list[float]]]] = \
        defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # source -> var -> metric -> per prompt
    for source, by_uid in groups.items():
        for var2vals in by_uid.values():
            preds = var2vals.get("pred")
            for var, vals in var2vals.items():
                if var == "pred" or not vals or not _numeric(vals):
                    continue
                for name, value in _prompt_metrics([float(v) for v in vals], preds, seed).items():
                    per_source[source][var][name].append(value)
    out: dict[str, float] = {}
    for source, by_var in per_source.items():
        core = "acc" if "acc" in by_var else "reward"
        for var, metrics in by_var.items():
            n_max = max(int(name.split("@")[1].split("/")[0]) for name in metrics)
            for name, per_prompt in metrics.items():
                is_core = var == core and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                out[f"{'val-core' if is_core else 'val-aux'}/{source}/{var}/{name}"] = float(np.mean(per_prompt))
    return out


def _numeric(vals: list[Any]) -> bool:
    return all(isinstance(v, (int, float, np.number)) for v in vals)  # bools count, as in verl

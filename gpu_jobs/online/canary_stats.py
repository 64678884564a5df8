"""The canary's stated test: per-arm feedback scores -> promote | rollback | wait, with its numbers.

    v = canary_test(baseline=[1, 0, 1, ...], candidate=[1, 1, 0, ...], min_samples=100, confidence=0.95,
                    margin=0.05, elapsed_s=3600, max_duration_s=86400)
    v.decision, v.lower, v.p_value          # 'promote', -0.031, 0.012

What a sample is (one per distinct voter and arm; the number min_samples counts):
  - a rating is signals.rating: a row's score, else its thumbs (the number the training rows'
    reward is made of, dataset.py); preferences and text alone carry none;
  - a voter is signals.voter_of: the voter the server derived from the API key (the principal,
    or "<principal>/<user>" for a key marked `asserts_users`), never a `user` a caller sends;
    an anonymous row (a server without keys) is its answer's own voter: once per answer;
  - one vote per (answer, voter): the mean of that voter's latest rating on each of the answer's
    choices (answer_votes), so `n: 64` is one vote, not 64;
  - one sample per (voter, arm): the mean of that voter's answer votes on the arm's version,
    given since the canary started (split_arms). A voter's weight is capped at one sample per
    arm, whatever it posts; serve routes a voter to one arm only (canary.py).

The test (TEST_NAME): a one-sided Welch t-test of non-inferiority (Welch 1947; the
Satterthwaite degrees of freedom), H0: mean(candidate) - mean(baseline) <= -margin, on those
samples. With d = mean_c - mean_b, se = sqrt(var_c/n_c + var_b/n_b) (sample variances) and t =
the Student-t quantile at `confidence` with Welch's df:
  - wait      while either arm has fewer than `min_samples` voters;
  - promote   when lower = d - t*se > -margin (p = P(T > (d + margin)/se) < 1 - confidence):
              the candidate is shown not worse than the baseline by more than the margin;
  - rollback  when upper = d + t*se < -margin: it is shown worse by more than the margin;
  - wait      otherwise, until `max_duration_s`; then rollback: a candidate that was not shown
              non-inferior in the time it had does not replace the baseline (also when an arm
              never reached `min_samples`).
`msprt` (the default of new canaries) bounds d with an always-valid confidence sequence
instead (_msprt) and rolls back once the candidate is shown worse than the baseline.
Both arms with zero variance (every score equal) give se = 0: the bounds are d itself.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

from gpu_jobs.online.signals import one_vote_each, rating, voter_of

__all__ = ["TEST_NAME", "METHODS", "ArmStats", "CanaryMethod", "CanaryVerdict", "arm_stats", "canary_method",
           "canary_test", "verdict", "feedback_value", "one_vote_each",
           "answer_votes", "split_arms", "voter"]

TEST_NAME = "one-sided Welch t-test, non-inferiority"


@dataclass(frozen=True)
class ArmStats:
    n: int
    mean: float  # nan when n == 0
    var: float  # sample variance (n - 1 in the denominator); nan when n < 2


def arm_stats(scores: Sequence[float]) -> ArmStats:
    """n, mean and sample variance of one arm's scores.

    >>> arm_stats([1.0, 0.0, 1.0, 0.0])
    ArmStats(n=4, mean=0.5, var=0.3333333333333333)
    """
    n = len(scores)
    mean = math.fsum(scores) / n if n else math.nan
    var = math.fsum((x - mean) ** 2 for x in scores) / (n - 1) if n >= 2 else math.nan
    return ArmStats(n, mean, var)


@dataclass(frozen=True)
class CanaryVerdict:
    """The decision and every number it rests on (nan where an arm is too small to compute it)."""

    decision: str  # "promote" | "rollback" | "wait"
    reason: str
    test: str
    n_baseline: int
    n_candidate: int
    mean_baseline: float
    mean_candidate: float
    diff: float  # mean_candidate - mean_baseline
    se: float
    df: float  # Welch-Satterthwaite degrees of freedom (inf when se == 0)
    t_crit: float
    lower: float  # one-sided lower confidence bound of diff at `confidence`
    upper: float  # one-sided upper confidence bound of diff at `confidence`
    p_value: float  # one-sided p of H0: diff <= -margin
    margin: float
    confidence: float
    min_samples: int
    elapsed_s: float
    max_duration_s: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe: nan and inf become None and "inf"."""
        def safe(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
            return v

        return {k: safe(v) for k, v in asdict(self).items()}


def _welch(b: ArmStats, c: ArmStats, confidence: float, margin: float) -> tuple[float, ...]:
    """(se, df, t_crit, lower, upper, p) of diff = c.mean - b.mean; both arms have n >= 2."""
    from scipy import stats

    vb, vc = b.var / b.n, c.var / c.n
    se = math.sqrt(vb + vc)
    diff = c.mean - b.mean
    if se == 0.0:  # every score equal in both arms: no spread, the difference is what it is
        return 0.0, math.inf, float(stats.norm.ppf(confidence)), diff, diff, 0.0 if diff > -margin else 1.0
    df = (vb + vc) ** 2 / (vb ** 2 / (b.n - 1) + vc ** 2 / (c.n - 1))
    t_crit = float(stats.t.ppf(confidence, df))
    p = float(stats.t.sf((diff + margin) / se, df))
    return se, df, t_crit, diff - t_crit * se, diff + t_crit * se, p


def _msprt(b: ArmStats, c: ArmStats, confidence: float, margin: float) -> tuple[float, ...]:
    """(se, df, radius/se, lower, upper, p) of diff = c.mean - b.mean from an always-valid
    confidence sequence: the normal-mixture mSPRT of Johari, Pekelis & Walsh ("Always valid
    inference", 2017), mixing variance tau^2 = margin^2 (the effect size that matters). With
    V = var_b/n_b + var_c/n_c (each variance floored at VAR_FLOOR, so a few equal scores never
    decide), the bounds diff -/+ sqrt(V (V + tau^2) / tau^2 * (2 log(1/alpha) + log(1 + tau^2/V)))
    hold at every n at once with probability >= 1 - alpha each: the flow may look after every
    rating, and stopping at the first look that decides keeps the error rates.
    p is the always-valid p-value of H0: diff <= -margin (1 / the mixture likelihood ratio)."""
    alpha, tau2 = 1.0 - confidence, max(margin, 0.01) ** 2
    v = max(b.var, VAR_FLOOR) / b.n + max(c.var, VAR_FLOOR) / c.n
    se, diff = math.sqrt(v), c.mean - b.mean
    radius = math.sqrt(v * (v + tau2) / tau2 * (2 * math.log(1 / alpha) + math.log(1 + tau2 / v)))
    z = diff + margin
    ratio = math.sqrt(v / (v + tau2)) * math.exp(min(700.0, tau2 * z * z / (2 * v * (v + tau2))))
    p = min(1.0, 1.0 / ratio) if z > 0 else 1.0
    return se, math.inf, radius / se, diff - radius, diff + radius, p


VAR_FLOOR = 0.01  # per-score variance at least this (a standard deviation of 0.1 on [0, 1] scores)


@dataclass(frozen=True)
class CanaryMethod:
    """A canary test: its bounds on candidate - baseline, and when it rolls back."""

    name: str
    bounds: Callable[[ArmStats, ArmStats, float, float], tuple[float, ...]]
    rollback_below: str  # "margin": upper < -margin (shown worse by more than the margin); "zero": upper < 0
    sequential: bool  # valid at every look (True) or at one fixed look (False)


METHODS = {m.name: m for m in (
    CanaryMethod("welch", _welch, "margin", False),
    # Rolls back as soon as the candidate is shown worse than the baseline at all: a candidate near
    # -margin is neither shown non-inferior nor, by the margin rule, worse by more than the margin,
    # and would wait until max_duration_s.
    CanaryMethod("msprt", _msprt, "zero", True),
)}
TEST_NAMES = {"welch": TEST_NAME, "msprt": "always-valid mSPRT (normal mixture), non-inferiority, sequential"}


def canary_method(name: str) -> CanaryMethod:
    """The registered canary test `name`; ValueError listing the valid ones otherwise."""
    if name not in METHODS:
        raise ValueError(f"canary method {name!r}: give one of {', '.join(sorted(METHODS))}")
    return METHODS[name]


def canary_test(baseline: Sequence[float], candidate: Sequence[float], *, min_samples: int, confidence: float,
                margin: float, elapsed_s: float, max_duration_s: float, method: str = "welch") -> CanaryVerdict:
    """The module docstring's test on the two arms' scores (each in [0, 1]); `method` "msprt"
    bounds the difference with an always-valid confidence sequence instead (_msprt) and rolls back
    once the candidate is shown worse than the baseline.

    >>> canary_test([1.0] * 3, [0.0] * 3, min_samples=5, confidence=0.95, margin=0.05, elapsed_s=10,
    ...             max_duration_s=60).decision
    'wait'
    >>> canary_test([1.0, 0.0] * 40, [0.0] * 80, min_samples=20, confidence=0.95, margin=0.05, elapsed_s=10,
    ...             max_duration_s=60, method="msprt").decision
    'rollback'
    """
    return verdict(arm_stats(baseline), arm_stats(candidate), min_samples=min_samples, confidence=confidence,
                   margin=margin, elapsed_s=elapsed_s, max_duration_s=max_duration_s, method=method)


def verdict(b: ArmStats, c: ArmStats, *, min_samples: int, confidence: float, margin: float, elapsed_s: float,
            max_duration_s: float, method: str = "welch") -> CanaryVerdict:
    """canary_test from the arms' summaries (what a simulation updates one rating at a time)."""
    how = canary_method(method)
    nan = math.nan
    expired = elapsed_s >= max_duration_s
    small = min(b.n, c.n) < min_samples
    se = df = t_crit = lower = upper = p = nan
    if min(b.n, c.n) >= 2:
        se, df, t_crit, lower, upper, p = how.bounds(b, c, confidence, margin)
    at = f"{confidence:.0%}" + (" always-valid" if how.sequential else "")
    floor = -margin if how.rollback_below == "margin" else 0.0
    if small:
        decision = "rollback" if expired else "wait"
        reason = (f"n = {b.n} baseline / {c.n} candidate, below min_samples {min_samples} per arm"
                  + (f"; max duration {max_duration_s:g} s reached: not shown non-inferior, rolled back"
                     if expired else ""))
    elif lower > -margin:
        decision, reason = "promote", (f"lower {at} bound of candidate - baseline {lower:+.4f} > -margin "
                                       f"{-margin:+.4f} (p = {p:.4g}): not worse by more than the margin")
    elif upper < floor:
        decision, reason = "rollback", (
            f"upper {at} bound of candidate - baseline {upper:+.4f} < -margin {-margin:+.4f}: worse by more than "
            "the margin" if how.rollback_below == "margin" else
            f"upper {at} bound of candidate - baseline {upper:+.4f} < 0: worse than the baseline")
    else:
        decision = "rollback" if expired else "wait"
        reason = (f"{at} bounds [{lower:+.4f}, {upper:+.4f}] hold -margin {-margin:+.4f}: undecided"
                  + (f"; max duration {max_duration_s:g} s reached: not shown non-inferior, rolled back"
                     if expired else ""))
    return CanaryVerdict(decision, reason, TEST_NAMES[method], b.n, c.n, b.mean, c.mean, c.mean - b.mean, se, df,
                         t_crit, lower, upper, p, margin, confidence, min_samples, elapsed_s, max_duration_s)


def feedback_value(row: dict[str, Any]) -> float | None:
    """One feedback row's rating in [0, 1] (signals.rating: its score, else its thumbs), else None.

    >>> feedback_value({"score": 0.25, "thumbs": "down"}), feedback_value({"score": None, "thumbs": "up"})
    (0.25, 1.0)
    """
    return rating(row)


def voter(row: dict[str, Any]) -> str | None:
    """Who a row names for lineage (governance.py counts them): the key's principal, else the
    self-asserted `user`. Not who a vote counts for: that is signals.voter_of.

    >>> voter({"principal": "team-a", "user": "u1"}), voter({"user": "u1"}), voter({})
    ('key:team-a', 'user:u1', None)
    """
    if row.get("principal"):
        return f"key:{row['principal']}"
    return f"user:{row['user']}" if row.get("user") else None


def answer_votes(feedback: Iterable[dict[str, Any]], versions: Collection[str],
                 since: float) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(version, voter) -> [(first created, vote)], one vote per answer that voter rated: the mean
    of its latest rating on each of the answer's choices (one_vote_each), so an answer of n
    choices weighs one vote, whatever n. Rows of other versions, given before `since` (Unix s)
    or without a rating are left out. An anonymous row's voter is its answer."""
    choices: dict[tuple[str, str, str], list[float]] = {}
    first: dict[tuple[str, str, str], float] = {}
    for row in one_vote_each(feedback):
        value, created = rating(row), row.get("created") or 0.0
        if value is None or row.get("version") not in versions or created < since:
            continue
        key = (row["version"], voter_of(row) or f"anonymous:{row.get('answer_id')}", str(row.get("answer_id")))
        choices.setdefault(key, []).append(value)
        first[key] = min(first.get(key, created), created)
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for (version, who, answer), values in choices.items():
        out.setdefault((version, who), []).append((first[(version, who, answer)], math.fsum(values) / len(values)))
    return out


def split_arms(feedback: Iterable[dict[str, Any]], baseline: str, candidate: str,
               since: float) -> tuple[list[float], list[float]]:
    """(baseline samples, candidate samples): one sample per distinct voter and arm, the mean of
    that voter's answer votes on the arm (answer_votes), ordered by each voter's first vote. See
    the module docstring for who a voter is; min_samples and the test count these samples."""
    arms: dict[str, list[tuple[float, float]]] = {baseline: [], candidate: []}
    for (version, _), votes in answer_votes(feedback, (baseline, candidate), since).items():
        arms[version].append((min(t for t, _ in votes), math.fsum(v for _, v in votes) / len(votes)))
    return [v for _, v in sorted(arms[baseline])], [v for _, v in sorted(arms[candidate])]

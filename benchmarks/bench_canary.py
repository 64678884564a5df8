"""The canary tests under repeated looks: how often each promotes, rolls back or waits, and after
how many ratings, on simulated arms whose true difference is known.

    python -m benchmarks.bench_canary                       # 400 trials per row, Bernoulli ratings
    python -m benchmarks.bench_canary --trials 2000 --base 0.17 --look-every 5 --max-per-arm 2000

rl-canary looks at the committed feedback every minute and stops at the first look that decides,
so a test is only as good as its error rates under that schedule: each trial draws ratings for
both arms (Bernoulli: thumbs up with the arm's probability), looks after every `--look-every`
ratings per arm from `--min-samples` on, and stops at the first promote or rollback; a trial that
reaches `--max-per-arm` undecided is what the canary's max_duration_s (or a demo's round limit)
ends. Rows: each method (canary_stats.METHODS) x true difference candidate - baseline, as a
multiple of the margin. A promotion where the true difference is -margin or below is a false
promotion; a rollback where it is 0 or above, a false rollback.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import numpy as np

from gpu_jobs.online.canary_stats import METHODS, ArmStats, verdict

__all__ = ["Outcome", "simulate", "main"]


@dataclass(frozen=True)
class Outcome:
    method: str
    diff: float
    trials: int
    promoted: float  # fractions of the trials
    rolled_back: float
    undecided: float
    median_ratings: float | None  # per arm, at the decision, over the decided trials


def _stats(cum: np.ndarray, cum2: np.ndarray, n: int) -> ArmStats:
    mean = cum[n - 1] / n
    var = (cum2[n - 1] - n * mean * mean) / (n - 1) if n >= 2 else float("nan")
    return ArmStats(n, float(mean), float(max(var, 0.0)))


def simulate(method: str, base: float, diff: float, *, trials: int, margin: float = 0.05, confidence: float = 0.95,
             min_samples: int = 20, look_every: int = 10, max_per_arm: int = 1000, seed: int = 0) -> Outcome:
    """`trials` canaries of `method` with baseline P(up) = `base` and candidate `base + diff`."""
    rng = np.random.default_rng(seed)
    decided: list[int] = []
    counts = {"promote": 0, "rollback": 0, "wait": 0}
    looks = range(min_samples, max_per_arm + 1, look_every)
    for _ in range(trials):
        arms = [(rng.random(max_per_arm) < p).astype(float) for p in (base, base + diff)]
        sums = [(np.cumsum(a), np.cumsum(a * a)) for a in arms]
        outcome = "wait"
        for n in looks:
            v = verdict(_stats(*sums[0], n), _stats(*sums[1], n), min_samples=min_samples, confidence=confidence,
                        margin=margin, elapsed_s=0.0, max_duration_s=1.0, method=method)
            if v.decision != "wait":
                outcome = v.decision
                decided.append(n)
                break
        counts[outcome] += 1
    return Outcome(method, diff, trials, counts["promote"] / trials, counts["rollback"] / trials,
                   counts["wait"] / trials, statistics.median(decided) if decided else None)


def table(rows: list[Outcome], margin: float) -> str:
    lines = ["| method | true diff | promoted | rolled back | undecided | median ratings per arm at the decision |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.method} | {r.diff:+.3f} ({r.diff / margin:+.1f} margin) | {r.promoted:.1%} | "
                     f"{r.rolled_back:.1%} | {r.undecided:.1%} | "
                     f"{'-' if r.median_ratings is None else f'{r.median_ratings:.0f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=400, help="simulated canaries per row")
    p.add_argument("--base", type=float, default=0.5, help="the baseline's P(thumbs up)")
    p.add_argument("--margin", type=float, default=0.05, help="the non-inferiority margin")
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--min-samples", type=int, default=20, help="ratings per arm before the first look")
    p.add_argument("--look-every", type=int, default=10, help="ratings per arm between looks")
    p.add_argument("--max-per-arm", type=int, default=1000, help="ratings per arm before the canary is ended")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for flag, value in (("--trials", args.trials), ("--min-samples", args.min_samples),
                        ("--look-every", args.look_every), ("--max-per-arm", args.max_per_arm)):
        if value < 1:
            p.error(f"{flag} {value}: give a positive number")
    if not 0 < args.base < 1 or not 0 < args.margin < args.base:
        p.error("--base must be in (0, 1) and --margin in (0, base)")
    rows = [simulate(m, args.base, k * args.margin, trials=args.trials, margin=args.margin,
                     confidence=args.confidence, min_samples=args.min_samples, look_every=args.look_every,
                     max_per_arm=args.max_per_arm, seed=args.seed)
            for m in METHODS for k in (1.0, 0.0, -0.5, -1.0, -2.0)]
    print(f"canary tests under repeated looks: {args.trials} trials per row, baseline P(up) {args.base:g}, margin "
          f"{args.margin:g}, confidence {args.confidence:g}, a look every {args.look_every} ratings per arm from "
          f"{args.min_samples}, ended undecided at {args.max_per_arm}")
    print(table(rows, args.margin))


if __name__ == "__main__":
    main()

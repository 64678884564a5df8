"""How often a bad candidate is promoted when an attacker controls k % of the voters, under the
canary's voter rules (gpu_jobs/online/canary_stats.py), for each test (welch, msprt).

    python -m benchmarks.bench_canary_attack                          # 400 trials per row
    python -m benchmarks.bench_canary_attack --trials 1000 --diff -0.05 --attackers 0 5 10

The rules simulated are the ones serve and rl-canary apply: a voter is who the API key says
(an attacker cannot mint voters beyond the keys or vouched-for users it holds: "controls k % of
voters" is that share of the distinct voters reaching the canary), its arm is a keyed hash of it
(uniform, and the attacker cannot choose it: an attacker's voter lands on the candidate with
probability `share` like anyone's), and it weighs one sample per arm, the mean of its votes, no
matter how many answers or choices it rates. Each trial: voters arrive one at a time; an honest
voter rates `--votes` answers, thumbs up with its arm's probability (baseline `--base`,
candidate `--base + --diff`: a bad candidate, `--diff` < 0); an attacker's sample is 1 on the
candidate and 0 on the baseline (its best push toward a promotion). rl-canary looks every
`--look-every` voters from `--min-samples` per arm and stops at the first look that decides; a
trial that reaches `--max-voters` undecided is rolled back (max_duration_s). A promotion is a
false promotion: the candidate is worse than the baseline by `-diff`.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import numpy as np

from gpu_jobs.online.canary_stats import METHODS, ArmStats, verdict

__all__ = ["AttackOutcome", "attack", "main", "table"]

ATTACKERS = (0.0, 0.01, 0.05, 0.10, 0.25)  # the shares of voters the attacker controls, by default


@dataclass(frozen=True)
class AttackOutcome:
    method: str
    attackers: float  # share of the voters the attacker controls
    trials: int
    promoted: float  # fractions of the trials: promoted is a false promotion (the candidate is bad)
    rolled_back: float
    undecided: float  # rolled back at max_voters, undecided
    median_voters: float | None  # per arm (the smaller), at the decision, over the decided trials


def _stats(values: np.ndarray) -> ArmStats:
    n = len(values)
    mean = float(values.mean()) if n else float("nan")
    return ArmStats(n, mean, float(values.var(ddof=1)) if n >= 2 else float("nan"))


def _trial(rng: np.random.Generator, method: str, attackers: float, *, base: float, diff: float, share: float,
           votes: int, margin: float, confidence: float, min_samples: int, look_every: int,
           max_voters: int) -> tuple[str, int | None]:
    """(decision, voters on the smaller arm when it decided) of one simulated canary."""
    to_candidate = rng.random(max_voters) < share
    attacker = rng.random(max_voters) < attackers
    p = np.where(to_candidate, base + diff, base)
    samples = np.where(attacker, to_candidate.astype(float), rng.binomial(votes, p) / votes)
    for t in range(look_every, max_voters + 1, look_every):
        arm = to_candidate[:t]
        b, c = samples[:t][~arm], samples[:t][arm]
        if min(len(b), len(c)) < min_samples:
            continue
        v = verdict(_stats(b), _stats(c), min_samples=min_samples, confidence=confidence, margin=margin,
                    elapsed_s=0.0, max_duration_s=1.0, method=method)
        if v.decision != "wait":
            return v.decision, min(len(b), len(c))
    return "wait", None


def attack(method: str, attackers: float, *, trials: int, base: float = 0.5, diff: float = -0.1,
           share: float = 0.5, votes: int = 3, margin: float = 0.05, confidence: float = 0.95,
           min_samples: int = 100, look_every: int = 10, max_voters: int = 2000, seed: int = 0) -> AttackOutcome:
    """`trials` canaries of `method` with a bad candidate (`diff` below the baseline) and
    `attackers` of the voters the attacker's (see the module docstring). Pure and seeded.

    >>> attack("msprt", 0.0, trials=3, min_samples=20, max_voters=200).trials
    3
    """
    if not 0 <= attackers < 1 or not 0 < share < 1 or votes < 1 or trials < 1:
        raise ValueError("attackers in [0, 1), share in (0, 1), votes and trials >= 1")
    rng = np.random.default_rng([seed, int(attackers * 10_000)])
    counts, decided = {"promote": 0, "rollback": 0, "wait": 0}, []
    for _ in range(trials):
        outcome, n = _trial(rng, method, attackers, base=base, diff=diff, share=share, votes=votes, margin=margin,
                            confidence=confidence, min_samples=min_samples, look_every=look_every,
                            max_voters=max_voters)
        counts[outcome] += 1
        if n is not None:
            decided.append(n)
    return AttackOutcome(method, attackers, trials, counts["promote"] / trials, counts["rollback"] / trials,
                         counts["wait"] / trials, statistics.median(decided) if decided else None)


def table(rows: list[AttackOutcome]) -> str:
    """The rows as a markdown table."""
    lines = ["| method | attacker's voters | promoted (false) | rolled back | undecided | median voters per arm at "
             "the decision |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.method} | {r.attackers:.0%} | {r.promoted:.1%} | {r.rolled_back:.1%} | {r.undecided:.1%} | "
                     f"{'-' if r.median_voters is None else f'{r.median_voters:.0f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_canary_attack", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=400, help="simulated canaries per row")
    p.add_argument("--attackers", type=float, nargs="+", default=[100 * k for k in ATTACKERS],
                   help="percent of the voters the attacker controls, one row each")
    p.add_argument("--base", type=float, default=0.5, help="the baseline's P(thumbs up)")
    p.add_argument("--diff", type=float, default=-0.1, help="candidate - baseline P(thumbs up): < 0, a bad candidate")
    p.add_argument("--share", type=float, default=0.5, help="the canary's share of voters")
    p.add_argument("--votes", type=int, default=3, help="answers each honest voter rates")
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--min-samples", type=int, default=100, help="voters per arm before the first look")
    p.add_argument("--look-every", type=int, default=10, help="voters between looks")
    p.add_argument("--max-voters", type=int, default=2000, help="voters before the canary is ended undecided")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if min(a.trials, a.votes, a.min_samples, a.look_every, a.max_voters) < 1:
        p.error("--trials, --votes, --min-samples, --look-every and --max-voters must be >= 1")
    if not all(0 <= k < 100 for k in a.attackers) or not 0 < a.base + a.diff < 1 or not 0 < a.base < 1:
        p.error("--attackers in [0, 100), --base and --base + --diff in (0, 1)")
    rows = [attack(m, k / 100, trials=a.trials, base=a.base, diff=a.diff, share=a.share, votes=a.votes,
                   margin=a.margin, confidence=a.confidence, min_samples=a.min_samples, look_every=a.look_every,
                   max_voters=a.max_voters, seed=a.seed)
            for m in METHODS for k in a.attackers]
    print(f"a bad candidate (P(up) {a.base + a.diff:g} against {a.base:g}) under an attacker: {a.trials} trials per "
          f"row, share {a.share:g}, {a.votes} votes per honest voter, margin {a.margin:g}, confidence "
          f"{a.confidence:g}, a look every {a.look_every} voters from {a.min_samples} per arm, ended at "
          f"{a.max_voters} voters")
    print(table(rows))


if __name__ == "__main__":
    main()

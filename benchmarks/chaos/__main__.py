"""Run the chaos scenarios and print fault / outcome / recovered / data lost / not finished / weights.

    .venv/bin/python -m benchmarks.chaos              # all scenarios (~20 min on 2 cores)
    .venv/bin/python -m benchmarks.chaos --quick      # the reduced set `make test` runs (~3.5 min)
    .venv/bin/python -m benchmarks.chaos --only kill-mid-update,s3-outage
    .venv/bin/python -m benchmarks.chaos --list

"recovered" is yes when the run completed with every committed manifest intact and readable;
"-" for bad input, which must be refused before anything is written. "data lost" counts what was
committed and then went missing, changed, became unreadable or was duplicated; "not finished"
counts stages of the run's iterations that were never committed (a run that stopped early has
work left, not data lost). "weights" compares the final policy with an uninterrupted run of the
same config, bitwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .harness import Chaos, Outcome
from .scenarios import QUICK, SCENARIOS


def run_scenarios(chaos: Chaos, names: list[str]) -> list[Outcome]:
    rows = []
    for name in names:
        fault, fn = SCENARIOS[name]
        t0 = time.perf_counter()
        try:
            row = fn(chaos)
        except Exception as e:  # noqa: BLE001 - a harness failure is a row too, never a silent skip
            traceback.print_exc(file=sys.stderr)
            row = Outcome(fault, f"harness error: {type(e).__name__}: {str(e)[:150]}", False, -1, "-", -1)
        print(f"  {name}: {time.perf_counter() - t0:.0f} s, recovered={row.recovered}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def format_table(rows: list[Outcome]) -> str:
    def yes(r: Outcome) -> str:
        return "-" if r.recovered is None else ("yes" if r.recovered else "no")

    def count(n: int) -> str:
        return "?" if n < 0 else str(n)  # the harness failed before it could count

    head = ("fault", "outcome", "recovered", "data lost", "not finished", "weights")
    body = [(r.fault, " ".join(r.outcome.replace("|", "/").split()), yes(r), count(r.data_lost),
             count(r.not_finished), r.weights) for r in rows]  # one line per row, whatever the outcome holds
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="only the reduced set make test runs")
    p.add_argument("--only", default="", help="comma-separated scenario names")
    p.add_argument("--list", action="store_true")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(f"{n:24s} {f}" for n, (f, _) in SCENARIOS.items()))
        return 0
    names = [n for n in args.only.split(",") if n] or (list(QUICK) if args.quick else list(SCENARIOS))
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; --list shows them")
    import torch

    torch.set_num_threads(1)  # in-process runs must match the one-thread reference bitwise
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlmill-chaos-") as tmp, Chaos.start(Path(tmp)) as chaos:
        rows = run_scenarios(chaos, names)
    print(f"\nrlmill chaos, {time.strftime('%Y-%m-%d')}, {len(rows)} scenarios in {time.perf_counter() - t0:.0f} s "
          f"(tiny GRPO run: 3 iterations of 8 prompts x 4, checkpoint every 2; "
          f"`python -m benchmarks.chaos{' --quick' if args.quick else ''}`)\n")
    print(format_table(rows))
    failed = [r for r in rows if r.data_lost != 0 or r.not_finished != 0 or r.weights == "differ"
              or r.recovered is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

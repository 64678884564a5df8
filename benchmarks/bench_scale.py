"""How one RL iteration's cost grows with its size (issue 7's `make bench-scale`).

    .venv/bin/python -m benchmarks.bench_scale [--iterations 4] [--points 4]
        [--sweeps prompts,samples,length] [--base prompts=32,samples=8,length=16]

The default workload (examples/grpo_arith.yaml: built-in tiny model, 2-digit addition, GRPO) is
run through the stage functions (gpu_jobs.stages, as the flow calls them, without Prefect) while
one axis doubles and the other two stay at the base:
  prompts  data.train_batch_size         32, 64, 128, 256   (actor.ppo_mini_batch_size = prompts/4,
  samples  rollout.n                      8, 16,  32,  64    so every iteration is 4 optimizer steps)
  length   rollout.max_response_length   16, 32,  64, 128   (rollout.ignore_eos: see below)
The prompts and samples sweeps cover the same 256..2048 samples per iteration, so they can be
compared row by row (what a prompt costs beyond its samples).
For each point: the iteration's wall time and its split as committed in the iteration's manifest
(timing_s/gen, gate, reward, old_log_prob, ref, adv, update_actor, weight_sync; commit is timed
here; "other" is the rest: reading inputs back by URI, writing shards and manifests), medians over
iterations 2..N (the first warms caches), then tokens/s (generated tokens per second of wall time)
and the wall-time ratio to the previous point (~2x when the cost is linear in the axis).

Response length: the built-in model answers in ~3 tokens and stops on EOS, so raising
max_response_length alone changes nothing. The length sweep sets rollout.ignore_eos=true (vLLM's
SamplingParams.ignore_eos; the hf engine honours it too), so every response is exactly
max_response_length tokens; the prompts and samples sweeps keep natural stopping (the real
workload). The "resp tok" column is the measured mean either way.

Prefect is not run per point: its cost per iteration is a constant (one subflow run and its task
runs; `make bench-overhead` measures it side by side with this same stage loop), which does
not grow with any of these axes; running the flow for every point would only add that constant
and a server start. Not a test: numbers depend on the machine and its load; compare the ratios
within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "grpo_arith.yaml"
AXES = {"prompts": "data.train_batch_size", "samples": "rollout.n", "length": "rollout.max_response_length"}
BASE = {"prompts": 32, "samples": 8, "length": 16}
# (column, metric): the stages' own timers from the iteration's manifest; timing_s/commit is timed here.
SPLIT = [("gen", "timing_s/gen"), ("gate", "timing_s/gate"), ("reward", "timing_s/reward"),
         ("old_lp", "timing_s/old_log_prob"), ("ref", "timing_s/ref"), ("adv", "timing_s/adv"),
         ("update", "timing_s/update_actor"), ("sync", "timing_s/weight_sync"), ("commit", "timing_s/commit")]
OTHER = "timing_s/other"  # the iteration's wall time outside every timer of SPLIT


def with_other(metrics: dict) -> dict:
    """`metrics` plus timing_s/other = wall_s - the SPLIT timers present. Per iteration, before
    the medians: a median of differences, not a difference of medians (which can go negative)."""
    return {**metrics, OTHER: metrics["wall_s"] - sum(metrics[m] for _, m in SPLIT if m in metrics)}


def sweep_grid(sweep: str, points: int, base: dict[str, int]) -> list[dict]:
    """The points of one sweep: `sweep`'s axis doubles from its base value, the others stay put.
    Each point: {prompts, samples, length, ignore_eos} (only the length sweep forces length)."""
    if sweep not in AXES:
        raise ValueError(f"unknown sweep {sweep!r}; choose from {sorted(AXES)}")
    return [{**base, sweep: base[sweep] * 2 ** i, "ignore_eos": sweep == "length"} for i in range(points)]


def point_overrides(point: dict, root: str, run_id: str, iterations: int) -> list[str]:
    """Dotted overrides of examples/grpo_arith.yaml for one point."""
    beyond = iterations + 1  # no checkpoint (nor the "last iteration" one) inside the measured loop
    return [f"root={root}", f"run_id={run_id}",
            *(f"{AXES[axis]}={point[axis]}" for axis in AXES),
            f"rollout.ignore_eos={str(point['ignore_eos']).lower()}",
            # A quarter of the prompts per optimizer step: 4 steps per iteration at every point.
            f"actor.ppo_mini_batch_size={max(1, point['prompts'] // 4)}",
            f"trainer.total_iterations={beyond}", f"trainer.checkpoint_every={beyond}",
            "trainer.val_every=0", "trainer.tensorboard=false", "data.val_size=32", "data.train_size=2000"]


def run_point(cfg, iterations: int) -> list[dict]:
    """`iterations` iterations of the flow's graph through the stage functions; per iteration the
    committed metrics plus `wall_s` (whole iteration) and timing_s/commit (the commit stage)."""
    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration
    from storage import read_manifest

    class TimedCalls(DirectCalls):
        def __call__(self, stage, k, *inputs):
            t0 = time.perf_counter()
            try:
                return super().__call__(stage, k, *inputs)
            finally:
                self.seconds[stage] = time.perf_counter() - t0

    run, engines = open_warm(cfg)
    calls = TimedCalls(run, engines)
    out = []
    try:
        for k in range(1, iterations + 1):
            calls.seconds = {}
            t0 = time.perf_counter()
            uris = run_iteration(calls, cfg, k)
            out.append(with_other({**read_manifest(uris["commit"], run.storage).metrics,
                                   "timing_s/commit": calls.seconds["commit"], "wall_s": time.perf_counter() - t0}))
    finally:
        engines.close()
    return out


def median_metrics(per_iteration: list[dict], skip: int = 1) -> dict[str, float]:
    """Median of each numeric metric over iterations skip+1..N; a metric missing from any of
    them (a stage that did not run) is left out. Needs more than `skip` iterations."""
    kept = per_iteration[skip:]
    if not kept:
        raise ValueError(f"need more than {skip} iterations to skip {skip} for warm-up")
    keys = set.intersection(*(set(m) for m in kept))
    return {key: statistics.median(float(m[key]) for m in kept)
            for key in sorted(keys) if all(isinstance(m[key], (int, float)) for m in kept)}


def table_rows(sweep: str, points: list[dict], medians: list[dict]) -> list[dict]:
    """One row per point: axis value, samples/iteration, measured response tokens, wall, the
    split (None for a stage that did not run), other, tokens/s and the ratio to the previous wall."""
    rows, prev = [], None
    for point, med in zip(points, medians):
        samples = point["prompts"] * point["samples"]
        wall, tokens = med["wall_s"], med["response_length/mean"]
        split = {name: med.get(metric) for name, metric in SPLIT}
        rows.append({"axis": point[sweep], "samples": samples, "resp_tokens": tokens, "wall": wall, **split,
                     "other": med[OTHER],
                     "tok_s": samples * tokens / wall, "ratio": wall / prev if prev else None})
        prev = wall
    return rows


def format_table(sweep: str, rows: list[dict]) -> str:
    """A markdown table of `table_rows` (seconds with 3 decimals; '-' for a stage that did not run)."""
    cols = [(sweep, "axis", "{:d}"), ("samples/it", "samples", "{:d}"), ("resp tok", "resp_tokens", "{:.1f}"),
            ("wall s", "wall", "{:.3f}"), *((name, name, "{:.3f}") for name, _ in SPLIT),
            ("other", "other", "{:.3f}"), ("tok/s", "tok_s", "{:.0f}"), ("x prev", "ratio", "{:.2f}x")]
    lines = ["| " + " | ".join(head for head, _, _ in cols) + " |",
             "|" + "|".join("---:" for _ in cols) + "|"]
    for row in rows:
        cells = ["-" if row[key] is None else fmt.format(row[key]) for _, key, fmt in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_sweeps(sweeps: list[str], points: int, iterations: int, base: dict[str, int],
               workdir: str, log=print) -> dict[str, list[dict]]:
    """Every sweep's table rows. A point shared by two sweeps (the base) is measured once."""
    from flows.config import load_run_config

    measured: dict[tuple, dict] = {}
    result = {}
    for sweep in sweeps:
        grid = sweep_grid(sweep, points, base)
        for point in grid:
            key = tuple(sorted(point.items()))
            if key not in measured:
                run_id = "scale-" + "-".join(f"{a}{point[a]}" for a in AXES) + ("-fixed" if point["ignore_eos"] else "")
                cfg = load_run_config(EXAMPLE, point_overrides(point, f"{workdir}/{run_id}", run_id, iterations))
                measured[key] = median_metrics(run_point(cfg, iterations))
                log(f"  {sweep:7s} {point}: {measured[key]['wall_s']:.3f} s/iteration")
        result[sweep] = table_rows(sweep, grid, [measured[tuple(sorted(p.items()))] for p in grid])
    return result


def parse_base(text: str) -> dict[str, int]:
    base = dict(BASE)
    for item in filter(None, text.split(",")):
        axis, _, value = item.partition("=")
        if axis not in AXES:
            raise SystemExit(f"--base: unknown axis {axis!r}; choose from {sorted(AXES)}")
        base[axis] = int(value)
    return base


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=4, help="iterations per point; medians of 2..N")
    p.add_argument("--points", type=int, default=4, help="points per sweep (the axis doubles points-1 times)")
    p.add_argument("--sweeps", default=",".join(AXES), help="comma-separated subset of " + ",".join(AXES))
    p.add_argument("--base", default="", help="base values (default prompts=32,samples=8,length=16)")
    args = p.parse_args(argv)
    if args.iterations < 2:
        raise SystemExit("--iterations must be >= 2 (the first one only warms)")
    sweeps, base = [s for s in args.sweeps.split(",") if s], parse_base(args.base)
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory() as tmp:
        tables = run_sweeps(sweeps, args.points, args.iterations, base, tmp,
                            log=lambda s: print(s, file=sys.stderr, flush=True))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}  python -m benchmarks.bench_scale {' '.join(argv or sys.argv[1:])}")
    print(f"workload: {EXAMPLE.name} (built-in model, arith, GRPO) through the stage functions; base {base}; "
          f"seconds per iteration, median of iterations 2..{args.iterations}")
    for sweep in sweeps:
        forced = " (rollout.ignore_eos: every response is max_response_length tokens)" if sweep == "length" else ""
        print(f"\n{sweep} ({AXES[sweep]}) doubling{forced}:\n{format_table(sweep, tables[sweep])}")
    print("\nother = wall - the split (reads by URI, shard and manifest writes); tok/s = samples x resp tok / wall; "
          "the Prefect flow adds a constant per iteration (one subflow run and its task runs; "
          "`make bench-overhead` measures it).")


if __name__ == "__main__":
    main()

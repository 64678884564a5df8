"""Asynchronous RL against the synchronous loop (issue "Asynchronous RL": `make bench-async`).

    .venv/bin/python -m benchmarks.bench_async [--iterations 10] [--thresholds 0,1,2] [--response-length 32]

The same GRPO run (built-in model and task, same seeds) through the rl-training flow at each
`async_training.staleness_threshold`, colocated (rollout and update share this process and its
cores), each in a fresh process. Printed per threshold: seconds per iteration (median of the
iterations after the first), the overlap achieved (the time the rollout of k+s and update k both
ran, read from their Prefect task runs, per iteration), held-out accuracy after the run and the
staleness metrics.

On a box where rollout and update share the same cores, overlap cannot buy much. The table also
prints what the measured stage times predict for a disaggregated setup where rollout and update
have their own devices:

    sync:   t_iter = t_gen + t_update + t_rest
    async:  t_iter = max(t_gen, t_update) + t_rest          (s >= 1, steady state)
    gain  = (t_gen + t_update + t_rest) / (max(t_gen, t_update) + t_rest)

with t_gen = timing_s/gen, t_update = timing_s/update_actor (+ old log-probs), t_rest = the rest of
timing_s/step, all from the synchronous run's commits. verl reports +20-40% for one-step-off
(recipe/one_step_off_policy README, 2025), where generation is a larger share than here.
Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "grpo_arith.yaml"


def overrides(root: str, threshold: int, iterations: int, response_length: int) -> list[str]:
    return [f"root={root}", f"run_id=async-{threshold}", f"trainer.total_iterations={iterations}",
            "trainer.val_every=0", f"trainer.checkpoint_every={iterations}", "trainer.tensorboard=false",
            "data.train_batch_size=32", "data.val_size=200", "actor.ppo_mini_batch_size=32",
            f"rollout.max_response_length={response_length}", "rollout.ignore_eos=true",
            f"async_training.staleness_threshold={threshold}", "actor.recompute_old_logprobs=true",
            *(["algorithm.rollout_correction.rollout_is=token"] if threshold else [])]


def worker(spec: dict) -> dict:
    """One run in this process: the flow, then per-iteration metrics and task-run intervals."""
    import asyncio

    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    from flows.training import rl_training
    from storage import RunLayout, committed, read_manifest

    t0, started = time.perf_counter(), time.time()
    summary = rl_training(config=str(EXAMPLE), overrides=spec["overrides"])
    wall = time.perf_counter() - t0
    layout = RunLayout(spec["root"], summary["run_id"])
    metrics = [read_manifest(committed(layout.stage(k, "commit")), None).metrics
               for k in range(1, summary["iterations"] + 1)]
    return {"wall": wall, "metrics": metrics, "acc": summary["val/acc after"],
            "intervals": asyncio.run(_intervals(started))}


async def _intervals(since: float) -> dict[str, list[float]]:
    """Start/end (epoch seconds) of every rollout and update task run that started after `since`
    (this run's: the API's database may hold other runs'), by task run name."""
    from prefect.client.orchestration import get_client

    runs, offset = [], 0
    async with get_client() as client:
        while page := await client.read_task_runs(limit=200, offset=offset):  # the API's page limit
            runs += page
            offset += len(page)
    return {r.name: [r.start_time.timestamp(), r.end_time.timestamp()] for r in runs
            if r.start_time and r.end_time and r.start_time.timestamp() >= since
            and (r.name.startswith("rollout") or r.name.startswith("update"))}


def overlap_per_iteration(intervals: dict[str, list[float]], threshold: int, iterations: int) -> float:
    """Mean seconds per iteration during which update k and the rollout of k+s both ran."""
    if threshold == 0:
        return 0.0
    import re

    named = ((re.match(r"rollout-(\d+) \(weights", n), v) for n, v in intervals.items())
    rollouts = {int(m.group(1)): v for m, v in named if m}
    updates = sorted(v for n, v in intervals.items() if n.startswith("update"))
    total = 0.0
    for k, (u0, u1) in enumerate(updates, start=1):
        if (r := rollouts.get(k + threshold)) is not None:
            total += max(0.0, min(u1, r[1]) - max(u0, r[0]))
    return total / max(1, iterations)


def predicted_gain(metrics: list[dict]) -> tuple[float, float, float, float]:
    """(t_gen, t_update, t_rest, predicted async gain) from a synchronous run's commits."""
    med = lambda name: statistics.median(m.get(name, 0.0) for m in metrics[1:])  # noqa: E731
    gen, update = med("timing_s/gen"), med("timing_s/update_actor") + med("timing_s/old_log_prob")
    rest = max(0.0, med("timing_s/step") - gen - update)
    return gen, update, rest, (gen + update + rest) / (max(gen, update) + rest)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--thresholds", default="0,1,2")
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        Path(spec["out"]).write_text(json.dumps(worker(spec)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in (int(x) for x in args.thresholds.split(",")):
            root = f"{tmp}/root-{s}"
            spec = {"root": root, "out": f"{tmp}/out-{s}.json",
                    "overrides": overrides(root, s, args.iterations, args.response_length)}
            Path(f"{tmp}/spec-{s}.json").write_text(json.dumps(spec))
            subprocess.run([sys.executable, "-m", "benchmarks.bench_async", "--worker", f"{tmp}/spec-{s}.json"],
                           cwd=REPO, check=True)
            out = json.loads(Path(spec["out"]).read_text())
            steps = [m["timing_s/step"] for m in out["metrics"]]
            rows.append((s, out, statistics.median(steps[1:]), overlap_per_iteration(out["intervals"], s,
                                                                                      args.iterations)))
            print(f"  threshold {s}: {out['wall']:.0f} s for {args.iterations} iterations", file=sys.stderr, flush=True)

    print(f"\nasync RL, colocated on this box ({os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, load average "
          f"{os.getloadavg()[0]:.1f}): GRPO, built-in model, 32 prompts x 8, {args.response_length}-token responses, "
          f"{args.iterations} iterations")
    base_wall = rows[0][1]["wall"]
    print(f"{'staleness':>9} {'run s':>7} {'run s/it':>8} {'vs sync':>8} {'overlap s/iter':>15} {'val/acc':>8} "
          f"{'staleness mean':>15}")
    for s, out, step, overlap in rows:
        stale = statistics.mean(m.get("async/staleness_mean", 0.0) for m in out["metrics"])
        per_iter = out["wall"] / args.iterations
        print(f"{s:>9} {out['wall']:>7.1f} {per_iter:>8.2f} {base_wall / out['wall']:>7.2f}x {overlap:>15.2f} "
              f"{out['acc']:>8.3f} {stale:>15.2f}")
    sync = next((out for s, out, _, _ in rows if s == 0), None)
    if sync is not None:
        gen, update, rest, gain = predicted_gain(sync["metrics"])
        print("run s = the whole `rl_training` call (setup, validation and Prefect start included), as a user waits.")
    print(f"\ndisaggregated prediction from the sync run's stage times: t_gen {gen:.2f} s, t_update {update:.2f} s, "
              f"t_rest {rest:.2f} s -> async (s>=1) {gain:.2f}x the sync iteration rate "
              f"(verl reports 1.2-1.4x for one-step-off).")


if __name__ == "__main__":
    main()

"""Asynchronous RL against the synchronous loop (issue "Asynchronous RL": `make bench-async`).

    .venv/bin/python -m benchmarks.bench_async [--iterations 10] [--thresholds 0,1,2] [--response-length 32]
    .venv/bin/python -m benchmarks.bench_async --disaggregated      # + thresholds 0 and 1 through two work pools
    .venv/bin/python -m benchmarks.bench_async --per-sample [--seeds 0,1]   # learning: sync vs s=1, 20 iterations

The same GRPO run (built-in model and task, same seeds) through the rl-training flow at each
`async_training.staleness_threshold`, colocated (rollout and update share this process and its
cores), each in a fresh process. Printed per threshold: seconds per iteration (median of the
iterations after the first), the overlap achieved (the time the rollout of k+s and update k both
ran, read from their Prefect task runs, per iteration), held-out accuracy after the run and the
staleness metrics.

--disaggregated adds rows for thresholds 0 and 1 with trainer.placement=remote on a real
`prefect server` (benchmarks/async_pools.py): rollout and validation are runs of rl-stage/rollout
on a `rollout` process pool, update and log-probs runs of rl-stage/gpu on an `update` pool, one
worker each; the overlap is read from the two pools' flow runs. Every stage run is a fresh process
that loads its model from the checkpoint (what a Kubernetes job would do), so the start-up of a
process per stage is in these rows; on one 2-core box the two pools still share the cores.

--per-sample answers "does s=1 learn as well per sample as the synchronous loop": the default
example (64 prompts x 8, 20 iterations, validation every 5) run synchronously and with s=1 for
each data.seed, printing held-out accuracy after the same number of samples.

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
    intervals = asyncio.run(_stage_flow_run_intervals(summary["run_id"]) if spec.get("disaggregated")
                            else _intervals(started))
    return {"wall": wall, "metrics": metrics, "acc": summary["val/acc after"], "intervals": intervals,
            "val_curve": summary["val_curve"]}


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


async def _stage_flow_run_intervals(run_id: str) -> dict[str, list[float]]:
    """Start/end of the rollout and update deployment runs (rl-stage flow runs, named
    `rollout-0003`, `update-0002`) of this run, from the two pools."""
    from prefect.client.orchestration import get_client

    from benchmarks.async_pools import stage_flow_runs

    async with get_client() as client:
        runs = await stage_flow_runs(client, run_id)
    return {r.name: [r.start_time.timestamp(), r.end_time.timestamp()] for r in runs
            if r.start_time and r.end_time and r.parameters["stage"] in ("rollout", "update")}


def overlap_per_iteration(intervals: dict[str, list[float]], threshold: int, iterations: int) -> float:
    """Mean seconds per iteration during which update k and the rollout of k+s both ran. Rollouts
    are named `rollout-3 (weights of update 1)` (task runs) or `rollout-0003` (deployment runs);
    updates are taken in the order they started."""
    if threshold == 0:
        return 0.0
    import re

    named = ((re.match(r"rollout-0*(\d+)\b", n), v) for n, v in intervals.items())
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


REMOTE = ["trainer.placement=remote", "trainer.checkpoint_every=1", "trainer.rollout_deployment=rl-stage/rollout"]


def _run(tmp: str, name: str, spec: dict, env: dict | None = None) -> dict:
    """One run in a fresh process (`--worker`); returns what `worker` wrote."""
    spec = {**spec, "out": f"{tmp}/out-{name}.json"}
    Path(f"{tmp}/spec-{name}.json").write_text(json.dumps(spec))
    # Without a server, each run starts an ephemeral Prefect API: allow it the time busy cores need.
    env = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", **(env or os.environ)}
    subprocess.run([sys.executable, "-m", "benchmarks.bench_async", "--worker", f"{tmp}/spec-{name}.json"],
                   cwd=REPO, check=True, env=env)
    out = json.loads(Path(spec["out"]).read_text())
    print(f"  {name}: {out['wall']:.0f} s", file=sys.stderr, flush=True)
    return out


def _timing_rows(tmp: str, thresholds: list[int], args, placement: str, env: dict | None = None) -> list:
    rows = []
    for s in thresholds:
        root = f"{tmp}/{placement}-{s}"
        extra = REMOTE if placement == "disaggregated" else []
        out = _run(tmp, f"{placement}-{s}", {"root": root, "disaggregated": placement == "disaggregated",
                                             "overrides": [*overrides(root, s, args.iterations, args.response_length),
                                                           *extra]}, env)
        rows.append((placement, s, out, overlap_per_iteration(out["intervals"], s, args.iterations)))
    return rows


def _print_timing(rows: list, iterations: int) -> None:
    print(f"{'placement':>13} {'staleness':>9} {'run s':>7} {'run s/it':>8} {'vs sync':>8} {'overlap s/iter':>15} "
          f"{'val/acc':>8} {'staleness mean':>15}")
    sync_wall = {placement: out["wall"] for placement, s, out, _ in rows if s == 0}
    for placement, s, out, overlap in rows:
        stale = statistics.mean(m.get("async/staleness_mean", 0.0) for m in out["metrics"])
        vs = f"{sync_wall[placement] / out['wall']:>7.2f}x" if placement in sync_wall else f"{'-':>8}"
        print(f"{placement:>13} {s:>9} {out['wall']:>7.1f} {out['wall'] / iterations:>8.2f} {vs} {overlap:>15.2f} "
              f"{out['acc']:>8.3f} {stale:>15.2f}")
    print("run s = the whole `rl_training` call (setup, validation and Prefect start included), as a user waits.")
    sync = next((out for placement, s, out, _ in rows if s == 0 and placement == "colocated"), None)
    if sync is not None:
        gen, update, rest, gain = predicted_gain(sync["metrics"])
        print(f"\ndisaggregated prediction from the colocated sync run's stage times (separate devices, no "
              f"per-stage start-up): t_gen {gen:.2f} s, t_update {update:.2f} s, t_rest {rest:.2f} s -> async "
              f"(s>=1) {gain:.2f}x the sync iteration rate (verl reports 1.2-1.4x for one-step-off).")


def learning_overrides(root: str, threshold: int, seed: int, iterations: int, val_every: int) -> list[str]:
    """The default example as shipped (64 prompts x 8, 6-token answers), at `threshold`; s > 0
    adds what async needs (the trainer's old log-probs, token-level rollout correction)."""
    return [f"root={root}", f"run_id=learn-{threshold}-{seed}", f"data.seed={seed}",
            f"trainer.total_iterations={iterations}", f"trainer.val_every={val_every}",
            f"trainer.checkpoint_every={iterations}", "trainer.tensorboard=false",
            f"async_training.staleness_threshold={threshold}",
            *(["actor.recompute_old_logprobs=true", "algorithm.rollout_correction.rollout_is=token"]
              if threshold else [])]


def _per_sample(tmp: str, seeds: list[int], iterations: int, val_every: int) -> None:
    from flows.config import load_run_config

    cfg = load_run_config(EXAMPLE, learning_overrides(f"{tmp}/x", 0, seeds[0], iterations, val_every))
    per_iter = cfg.data.train_batch_size * cfg.rollout.n
    curves = {}
    for seed in seeds:
        for s in (0, 1):
            root = f"{tmp}/learn-{s}-{seed}"
            curves[(s, seed)] = _run(tmp, f"learn-{s}-{seed}", {
                "root": root, "overrides": learning_overrides(root, s, seed, iterations, val_every)})["val_curve"]
    print(f"\nheld-out exact match (val/acc, {cfg.data.val_size} greedy prompts) after the same number of samples: "
          f"{EXAMPLE.name}, {cfg.data.train_batch_size} prompts x {cfg.rollout.n} = {per_iter} samples per iteration, "
          f"model.seed {cfg.model.seed}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'data.seed':>9} {'staleness':>9} " + " ".join(f"{f'{k * per_iter} smp':>10}" for k, _, _ in
                                                             curves[(0, seeds[0])]))
    for (s, seed), curve in curves.items():
        print(f"{seed:>9} {s:>9} " + " ".join(f"{acc:>10.3f}" for _, _, acc in curve))
    for s in (0, 1):
        final = [curves[(s, seed)][-1][2] for seed in seeds]
        print(f"staleness {s}: final val/acc mean {statistics.mean(final):.3f} over seeds {seeds}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--thresholds", default="0,1,2")
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--disaggregated", action="store_true",
                   help="also run thresholds 0 and 1 through two local process work pools (a real prefect server)")
    p.add_argument("--colocated", action=argparse.BooleanOptionalAction, default=True,
                   help="run the colocated rows (--no-colocated: only the disaggregated or per-sample ones)")
    p.add_argument("--per-sample", action="store_true",
                   help="instead: sync vs s=1 learning on the default example, held-out accuracy per sample")
    p.add_argument("--seeds", default="0", help="--per-sample: data.seed values, comma-separated")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        Path(spec["out"]).write_text(json.dumps(worker(spec)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.per_sample:
            _per_sample(tmp, [int(x) for x in args.seeds.split(",")], iterations=20, val_every=5)
            return
        thresholds = [int(x) for x in args.thresholds.split(",")]
        rows = _timing_rows(tmp, thresholds, args, "colocated") if args.colocated else []
        if args.disaggregated:
            from benchmarks.async_pools import TwoPools

            with TwoPools(Path(tmp) / "pools") as pools:
                rows += _timing_rows(tmp, [0, 1], args, "disaggregated", pools.env)
    print(f"\nasync RL on this box ({os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, load average "
          f"{os.getloadavg()[0]:.1f}): GRPO, built-in model, 32 prompts x 8, {args.response_length}-token responses, "
          f"{args.iterations} iterations")
    _print_timing(rows, args.iterations)


if __name__ == "__main__":
    main()

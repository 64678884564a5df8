"""What orchestration and storage cost per RL iteration (issue 7's `make bench-overhead`).

    .venv/bin/python -m benchmarks.bench_overhead [--iterations 6] [--batches 16,64,256,256x64]

The same GRPO iterations (built-in model and task, same seeds) three ways, side by side:
  memory  the stage math in one loop, nothing written (engine.generate -> score -> advantages
          -> trainer.update -> weight sync): the floor;
  stages  the stage functions (gpu_jobs.stages) called directly: adds Parquet commits with
          manifests, the great-expectations gate, reads back by URI;
  flow    the rl-training Prefect flow (one subflow per iteration, tasks, artifacts) on an
          ephemeral Prefect API: adds Prefect's own cost (~0.3 s per iteration on 2 cores; docs/benchmarks.md);
  flow-sqlite, flow-postgres (--databases)  the same flow against a real `prefect server`
          (tests.servers.LocalPrefect, what `make server [DB=postgres]` starts) on that database.
A batch `PxT` is P prompts whose responses are forced to exactly T tokens (rollout.ignore_eos):
iterations of several seconds, where a fixed per-iteration cost should vanish.
Per-iteration wall time is the median over iterations 2..N (the first warms caches) of
--repeats runs of each mode, run in alternating order. Not a test:
numbers depend on the machine and its load; the ratios within one run are what to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "grpo_arith.yaml"


def overrides(root: str, batch: int, iterations: int, run_id: str, response_tokens: int = 0) -> list[str]:
    """The example's GRPO run at `batch` prompts x 8; `response_tokens` > 0 forces every response
    to that length (0: natural stopping, at most the example's 6 tokens)."""
    forced = ["rollout.ignore_eos=true", f"rollout.max_response_length={response_tokens}"] if response_tokens else []
    return [f"root={root}", f"run_id={run_id}", f"data.train_batch_size={batch}",
            f"actor.ppo_mini_batch_size={max(1, batch // 4)}", f"trainer.total_iterations={iterations}",
            "trainer.val_every=0", f"trainer.checkpoint_every={iterations}", "trainer.tensorboard=false",
            "data.val_size=32", *forced]


def parse_batch(text: str) -> tuple[int, int]:
    """'256' -> (256, 0); '256x64' -> (256, 64): prompts, forced response tokens (0 = natural)."""
    prompts, _, tokens = text.strip().partition("x")
    return int(prompts), int(tokens or 0)


def memory_loop(cfg, iterations: int) -> list[float]:
    """The same computation as the stages, with every table kept in memory."""
    from gpu_jobs.reward import score_batch
    from gpu_jobs.stages import Roles, Run
    from gpu_jobs.stages.advantage_math import batch_advantages
    from gpu_jobs.stages.run import sampling_seed
    from gpu_jobs.stages.samples import sample_table
    from gpu_jobs.data import render_prompt
    import pyarrow as pa

    run = Run.open(cfg)
    roles = Roles.load(run)
    kl_ctrl = cfg.algorithm.kl_ctrl.build()
    times = []
    for k in range(1, iterations + 1):
        t0 = time.perf_counter()
        rows = run.sampler.indices(k - 1)
        prompts = [dict(run.train.iloc[i].to_dict(), row=int(i)) for i in rows]
        ids = [render_prompt(p["prompt"], run.tokenizer) for p in prompts]
        out = roles.rollout.generate(ids, cfg.rollout.n, cfg.rollout.sampling(sampling_seed(cfg.data.seed, k)))
        table = sample_table(out, prompts, k)
        texts = run.tokenizer.batch_decode(table.column("response_ids").to_pylist(), skip_special_tokens=True)
        scores, _, _ = score_batch([{"data_source": d, "solution_str": s, "ground_truth": g}
                                    for d, s, g in zip(table.column("data_source").to_pylist(), texts,
                                                       table.column("ground_truth").to_pylist())], cfg.reward)
        table = table.append_column("score", pa.array(scores, pa.float32()))
        table, _ = batch_advantages(table, cfg, kl_ctrl)
        roles.trainer.update(table)
        roles.sync_rollout()
        times.append(time.perf_counter() - t0)
    return times


def stage_loop(cfg, iterations: int) -> list[float]:
    """The flow's iteration graph with the stages called directly (commits included, no Prefect)."""
    from gpu_jobs.stages import DirectCalls, open_warm, run_iteration

    run, roles = open_warm(cfg)
    times = []
    for k in range(1, iterations + 1):
        t0 = time.perf_counter()
        run_iteration(DirectCalls(run, roles), cfg, k)
        times.append(time.perf_counter() - t0)
    return times


def flow_loop(root: str, batch: int, iterations: int, run_id: str, response_tokens: int = 0) -> list[float]:
    """Per-iteration wall time of the Prefect flow, read from its subflow runs' start/end."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    from flows.training import rl_training

    state = rl_training(config=str(EXAMPLE), overrides=overrides(root, batch, iterations, run_id, response_tokens),
                        return_state=True)
    parent = state.state_details.flow_run_id

    async def subflows():
        async with get_client() as client:
            return await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent])))

    runs = sorted((r for r in asyncio.run(subflows()) if r.name.startswith("iter-")), key=lambda r: r.name)
    # Start to the start of the next iteration: includes the parent flow's per-iteration work.
    starts = [r.start_time for r in runs] + [runs[-1].end_time]
    return [(b - a).total_seconds() for a, b in zip(starts, starts[1:])]


def server_flow_loop(api_url: str, *args) -> list[float]:
    """flow_loop against the Prefect server at `api_url`."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        try:
            return flow_loop(*args)
        finally:  # the workers are bound to this server: send what they hold before it goes away
            EventsWorker.drain_all()
            APILogWorker.drain_all()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--batches", default="16,64,256,256x64",
                   help="prompts per iteration (x 8 samples); PxT forces responses of exactly T tokens")
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating the order")
    p.add_argument("--databases", default="sqlite,postgres",
                   help="also run the flow against a prefect server on each of these databases ('' for none)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    from flows.config import load_run_config

    rows = []
    databases = [d for d in args.databases.split(",") if d]
    modes = ("memory", "stages", "flow", *(f"flow-{d}" for d in databases))
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        from tests.servers import LocalPrefect

        apis = {}
        for db in databases:  # one server per database for the whole benchmark, as a user keeps one
            prefect = servers.enter_context(LocalPrefect(Path(tmp) / f"prefect-{db}", "bench", db=db))  # started
            apis[f"flow-{db}"] = prefect.api
        for batch, tokens in (parse_batch(b) for b in args.batches.split(",")):
            times: dict[str, list[float]] = {m: [] for m in modes}
            for r in range(args.repeats):
                # A/B/C then C/B/A: a slow spell on the shared box hits every mode alike.
                for mode in modes if r % 2 == 0 else modes[::-1]:
                    root, run_id = f"{tmp}/{mode}-{batch}x{tokens}-{r}", f"bench-{mode}-{batch}x{tokens}-{r}"
                    cfg = load_run_config(EXAMPLE, overrides(root, batch, args.iterations, run_id, tokens))
                    flow_args = (root, batch, args.iterations, run_id, tokens)
                    t = {"memory": lambda: memory_loop(cfg, args.iterations),
                         "stages": lambda: stage_loop(cfg, args.iterations),
                         "flow": lambda: flow_loop(*flow_args)}.get(mode, lambda: server_flow_loop(apis[mode], *flow_args))()
                    times[mode] += t[1:]
                    print(f"  batch {batch:4d}x{tokens or '-':<3} {mode:7s} run {r + 1}: {statistics.median(t[1:]):.2f} s/iteration",
                          file=sys.stderr, flush=True)
            rows.append((batch, tokens, {m: statistics.median(v) for m, v in times.items()},
                         {m: max(v) for m, v in times.items()}))

    print(f"\nper-iteration wall time, median of iterations 2..{args.iterations} of {args.repeats} alternating "
          f"run(s) per mode (GRPO, built-in model, n=8, {time.strftime('%Y-%m-%d')}, load average "
          f"{os.getloadavg()[0]:.1f})")
    head = (f"{'prompts':>7} {'samples':>7} {'resp tok':>8} {'memory s':>9} {'stages s':>9} {'flow s':>8} "
            f"{'storage+gate':>13} {'prefect':>9} {'rlmill share':>13} {'total share':>12}")
    print(head)
    for batch, tokens, m, _ in rows:
        storage, prefect = m["stages"] - m["memory"], m["flow"] - m["stages"]
        print(f"{batch:>7} {batch * 8:>7} {tokens or '<=6':>8} {m['memory']:>9.2f} {m['stages']:>9.2f} {m['flow']:>8.2f} "
              f"{storage:>12.2f}s {prefect:>8.2f}s {storage / m['flow']:>12.1%} {(m['flow'] - m['memory']) / m['flow']:>11.1%}")
    print("storage+gate = stages - memory (what rlmill adds: commits, manifests, GX gate, reads);"
          " prefect = flow - stages; shares are of the flow's iteration time.")
    if databases:
        # "slowest": the longest single iteration, where a stall (a subflow's creation waiting ~2 s on
        # SQLite's lock, seen in an earlier release) shows; the medians hide it.
        print("\nthe flow against a prefect server, per database (prefect = flow - stages, per iteration; "
              "slowest = the longest iteration of all runs)")
        print(f"{'prompts':>7} {'resp tok':>8} {'ephemeral s':>12}" + "".join(
            f" {d + ' s':>12} {d + ' prefect':>16} {d + ' slowest':>16}" for d in databases))
        for batch, tokens, m, worst in rows:
            print(f"{batch:>7} {tokens or '<=6':>8} {m['flow']:>12.2f}" + "".join(
                f" {m['flow-' + d]:>12.2f} {m['flow-' + d] - m['stages']:>15.2f}s {worst['flow-' + d]:>15.2f}s"
                for d in databases))


if __name__ == "__main__":
    main()

"""How one RL iteration's cost grows with its size (issue 7's `make bench-scale`).

    .venv/bin/python -m benchmarks.bench_scale [--iterations 4] [--points 4]
        [--sweeps prompts,samples,length,ranks] [--base prompts=32,samples=8,length=16]
        [--ranks 1,2] [--updates 3] [--threads 2]

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

The ranks axis (sweep "ranks", `--ranks 1,2`; trainer.n_gpus_per_node on CPU counts processes):
  update alone  the 16M model (benchmarks.bench_rollout.make_16m_model) in a warm rank group
                (gpu_jobs.train.ranks.trainer.GroupTrainer) on bench_update's batch (8 prompts x 4
                samples, one optimizer step): 1 rank, then 2 ranks at ZeRO-0 and at ZeRO-3;
                seconds per update, tokens/s, and the update's wall time split, from the kernel's
                scheduler statistics of each rank's main thread (/proc/<pid>/task/<pid>/schedstat),
                into on a CPU, waiting for a core (run queue: the contention of a shared
                machine) and blocked (waiting in a collective for the peer rank, or I/O). "comm"
                = blocked minus the 1-rank blocked (which has no collective): the share of the
                update spent waiting for communication. It includes waiting for a peer that was
                itself waiting for a core; the CPU time gloo spends copying and reducing counts
                as "on a CPU", so "comm" is a lower bound of what communication costs.
  memory        after the timed updates, per rank: parameter and optimizer-state elements it
                holds (the group's rank_info: its ZeRO partitions) as fp32 bytes, and peak
                resident memory (VmHWM of the rank's /proc status; it includes the ~0.9 GB that
                torch and DeepSpeed take in every rank on CPU). ZeRO-3 holds about half of the
                parameter and optimizer bytes per rank on 2 ranks.
  iterations    the base point of the sweeps above with trainer.n_gpus_per_node = 1, 2 through
                the stage functions (2 ranks: the warm group, ZeRO-3 by zero_stage auto), with
                the same three-way split of the time the iteration spent in group commands
                (update, agreement log-probs, weight sync; between commands the ranks wait).
Threads: `--threads T` (default min(2, cores)) is the whole budget: the flow process uses T
threads, each of R ranks max(1, T // R), so 1 and 2 ranks share the same cores (with T=1, each
rank gets one thread and 2 ranks use 2 cores).
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
RANKS = "ranks"  # the ranks sweep: not an axis of the workload, a placement of the trainer
# Stage timers during which the trainer's rank group works (the rest of an iteration it idles).
GROUP_TIMERS = ("timing_s/update_actor", "timing_s/old_log_prob", "timing_s/agreement", "timing_s/weight_sync")
# The update-alone configurations of the ranks axis: (ranks, ZeRO stage).
UPDATE_CONFIGS = ((1, 0), (2, 0), (2, 3))


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
                self.seconds[stage.name] = time.perf_counter() - t0

    run, roles = open_warm(cfg)
    calls = TimedCalls(run, roles)
    out = []
    try:
        for k in range(1, iterations + 1):
            calls.seconds = {}
            pids = list(getattr(roles.trainer, "pids", []))  # a rank group's ranks; [] in-process
            sched0, t0 = rank_schedstat(pids), time.perf_counter()
            uris = run_iteration(calls, cfg, k)
            metrics = {**read_manifest(uris["commit"], run.storage).metrics,
                       "timing_s/commit": calls.seconds["commit"], "wall_s": time.perf_counter() - t0}
            if pids and list(roles.trainer.pids) == pids:  # the same processes all along
                deltas = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(sched0, rank_schedstat(pids))]
                metrics["ranks/cpu_s"] = statistics.mean(d[0] for d in deltas)
                metrics["ranks/runq_s"] = statistics.mean(d[1] for d in deltas)
            out.append(with_other(metrics))
    finally:
        roles.close()
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
    return markdown(cols, rows)


def run_sweeps(sweeps: list[str], points: int, iterations: int, base: dict[str, int],
               workdir: str, log=print) -> dict[str, list[dict]]:
    """Every sweep's table rows. A point shared by two sweeps (the base) is measured once."""
    from flows.config import load_run_config

    measured: dict[tuple, dict] = {}
    result = {}
    for sweep in (s for s in sweeps if s != RANKS):
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


# ------------------------------------------------------------------------------ the ranks axis
def rank_threads(threads: int, ranks: int) -> int:
    """Threads per rank when `ranks` ranks share a budget of `threads` (each at least one)."""
    return max(1, threads // ranks)


def parse_schedstat(text: str) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for a CPU) of one thread, from its
    /proc/<pid>/task/<tid>/schedstat line ("<ns on cpu> <ns on the run queue> <timeslices>")."""
    on_cpu, waiting = text.split()[:2]
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def status_kib(status: str, key: str) -> int:
    """A `Key:   123 kB` line of /proc/<pid>/status (VmHWM, VmRSS), in KiB."""
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    raise KeyError(f"{key} is not in this /proc status (a kernel thread, or a process that exited)")


def time_shares(on_cpu_s: float, waiting_s: float, wall_s: float) -> dict[str, float]:
    """A thread's wall time split three ways: on a CPU ("cpu"), runnable but waiting for a core
    the machine's other work holds ("runq"), and the rest: blocked ("blocked"; in a rank during a
    command, that is waiting in a collective for its peer, or for I/O)."""
    if wall_s <= 0:
        raise ValueError(f"need wall_s > 0, got {wall_s}")
    cpu, runq = on_cpu_s / wall_s, waiting_s / wall_s
    return {"cpu": cpu, "runq": runq, "blocked": max(0.0, 1.0 - cpu - runq)}


def rank_schedstat(pids: list[int]) -> list[tuple[float, float]]:
    """parse_schedstat of each rank's main thread: the one that runs the model and calls the
    collectives (gloo's and OpenMP's helper threads are left out)."""
    return [parse_schedstat(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text()) for pid in pids]


def rank_memory_kib(pids: list[int], key: str) -> list[int]:
    return [status_kib(Path(f"/proc/{pid}/status").read_text(), key) for pid in pids]


def measure_update(model_dir: str, ranks: int, zero_stage: int, updates: int, threads: int) -> dict:
    """One warm-up and `updates` timed PolicyTrainer updates in a rank group of `ranks` ranks:
    wall seconds, tokens, each rank's main-thread (on-CPU, run-queue) seconds over the timed
    updates, its threads, the group's rank_info, each rank's peak and current resident KiB."""
    from benchmarks.bench_update import _batch
    from gpu_jobs.train import ActorConfig
    from gpu_jobs.train.ranks.trainer import GroupTrainer

    cfg = ActorConfig(ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=8, lr=1e-5, zero_stage=zero_stage)
    trainer = GroupTrainer(model_dir, cfg, n_ranks=ranks, env={"OMP_NUM_THREADS": str(threads)})
    try:
        trainer.start()
        batch = _batch(trainer.model_config.vocab_size)
        trainer.update(batch)  # warm-up: DeepSpeed's first step allocates the optimizer state
        pids = trainer.pids
        sched0, t0 = rank_schedstat(pids), time.perf_counter()
        metrics = [trainer.update(batch) for _ in range(updates)]
        wall = time.perf_counter() - t0
        sched = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(sched0, rank_schedstat(pids))]
        info = trainer.rank_info()
        peak, rss = rank_memory_kib(pids, "VmHWM"), rank_memory_kib(pids, "VmRSS")
    finally:
        trainer.close()
    return {"ranks": ranks, "zero_stage": info[0]["zero_stage"], "updates": updates, "wall_s": wall,
            "tokens": sum(m["perf/total_num_tokens"] for m in metrics), "sched_s": sched,
            "threads": [i["threads"] for i in info], "info": info, "peak_kib": peak, "rss_kib": rss}


def update_rows(results: list[dict]) -> list[dict]:
    """Per measure_update result: ranks, zero, s/update, tokens/s, the ranks' mean time_shares,
    and comm = blocked minus the 1-rank blocked (None without a 1-rank result, or at 1 rank)."""
    rows, base_blocked = [], None
    for r in results:
        shares = [time_shares(cpu, runq, r["wall_s"]) for cpu, runq in r["sched_s"]]
        row = {"ranks": r["ranks"], "zero": r["zero_stage"], "threads": r["threads"][0],
               "s_update": r["wall_s"] / r["updates"], "tok_s": r["tokens"] / r["wall_s"],
               **{k: statistics.mean(s[k] for s in shares) for k in ("cpu", "runq", "blocked")}, "comm": None}
        if r["ranks"] == 1 and base_blocked is None:
            base_blocked = row["blocked"]
        rows.append(row)
    for row in rows:
        if row["ranks"] > 1 and base_blocked is not None:
            row["comm"] = max(0.0, row["blocked"] - base_blocked)
    return rows


def memory_rows(results: list[dict]) -> list[dict]:
    """One row per rank of each measure_update result: parameter elements it holds (its partition),
    of the full model, and materialized outside an update (ZeRO-3 keeps small parameters whole),
    optimizer elements, weights + Adam's two moments as fp32 MiB, peak and current resident MiB."""
    rows = []
    for r in results:
        for info, peak, rss in zip(r["info"], r["peak_kib"], r["rss_kib"]):
            state = 4 * (info["partition_numel"] + 2 * info["optimizer_numel"])
            rows.append({"ranks": r["ranks"], "zero": r["zero_stage"], "rank": info["rank"],
                         "params_m": info["partition_numel"] / 1e6, "full_m": info["full_numel"] / 1e6,
                         "materialized_m": info["materialized_numel"] / 1e6,
                         "optim_m": info["optimizer_numel"] / 1e6, "state_mib": state / 2 ** 20,
                         "peak_mib": peak / 1024, "rss_mib": rss / 1024})
    return rows


def iteration_rows(ranks: list[int], medians: list[dict], samples: int) -> list[dict]:
    """Whole iterations per rank count: wall, the update, the weight sync, the time in group
    commands and its ranks' time_shares of it (None in-process), tokens/s and wall relative to
    the first row."""
    rows = []
    for r, med in zip(ranks, medians):
        group = sum(med.get(t, 0.0) for t in GROUP_TIMERS)
        shares = (time_shares(med["ranks/cpu_s"], med["ranks/runq_s"], group)
                  if "ranks/cpu_s" in med and group > 0 else dict.fromkeys(("cpu", "runq", "blocked")))
        rows.append({"ranks": r, "wall": med["wall_s"], "gen": med.get("timing_s/gen"),
                     "update": med.get("timing_s/update_actor"), "sync": med.get("timing_s/weight_sync"),
                     "group": group, **shares,
                     "tok_s": samples * med["response_length/mean"] / med["wall_s"],
                     "ratio": med["wall_s"] / medians[0]["wall_s"]})
    return rows


def markdown(cols: list[tuple[str, str, str]], rows: list[dict]) -> str:
    """A markdown table: cols are (header, key, format); None shows as '-'."""
    lines = ["| " + " | ".join(head for head, _, _ in cols) + " |", "|" + "|".join("---:" for _ in cols) + "|"]
    for row in rows:
        lines.append("| " + " | ".join("-" if row[k] is None else f.format(row[k]) for _, k, f in cols) + " |")
    return "\n".join(lines)


UPDATE_COLS = [("ranks", "ranks", "{:d}"), ("zero", "zero", "{:d}"), ("threads/rank", "threads", "{:d}"),
               ("s/update", "s_update", "{:.3f}"), ("tok/s", "tok_s", "{:.0f}"), ("on CPU", "cpu", "{:.0%}"),
               ("run queue", "runq", "{:.0%}"), ("blocked", "blocked", "{:.0%}"), ("comm", "comm", "{:.0%}")]
MEMORY_COLS = [("ranks", "ranks", "{:d}"), ("zero", "zero", "{:d}"), ("rank", "rank", "{:d}"),
               ("params held (M)", "params_m", "{:.2f}"), ("of (M)", "full_m", "{:.2f}"),
               ("gathered now (M)", "materialized_m", "{:.2f}"),
               ("optimizer (M)", "optim_m", "{:.2f}"), ("weights+Adam MiB", "state_mib", "{:.0f}"),
               ("peak RSS MiB", "peak_mib", "{:.0f}"), ("RSS MiB", "rss_mib", "{:.0f}")]
ITERATION_COLS = [("ranks", "ranks", "{:d}"), ("wall s", "wall", "{:.3f}"), ("gen", "gen", "{:.3f}"),
                  ("update", "update", "{:.3f}"), ("sync", "sync", "{:.3f}"), ("group s", "group", "{:.3f}"),
                  ("on CPU", "cpu", "{:.0%}"), ("run queue", "runq", "{:.0%}"), ("blocked", "blocked", "{:.0%}"),
                  ("tok/s", "tok_s", "{:.0f}"),
                  ("x 1st", "ratio", "{:.2f}x")]


def run_ranks(ranks: list[int], iterations: int, updates: int, base: dict[str, int], threads: int,
              workdir: str, log=print) -> dict[str, list[dict]]:
    """The ranks axis: {"update": update_rows, "memory": memory_rows, "iterations": iteration_rows}."""
    from benchmarks.bench_rollout import make_16m_model
    from flows.config import load_run_config

    model = make_16m_model(f"{workdir}/m16")
    results = []
    for n, zero in ((n, z) for n, z in UPDATE_CONFIGS if n in ranks):
        results.append(measure_update(model, n, zero, updates, rank_threads(threads, n)))
        log(f"  update  {n} rank(s) ZeRO-{zero}: {results[-1]['wall_s'] / updates:.3f} s/update")
    point = {**base, "ignore_eos": False}
    medians = []
    for n in ranks:
        run_id = f"scale-ranks{n}"
        overrides = [*point_overrides(point, f"{workdir}/{run_id}", run_id, iterations), f"trainer.n_gpus_per_node={n}"]
        # The group's ranks read OMP_NUM_THREADS from this process's environment when they start.
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(rank_threads(threads, n))
        try:
            medians.append(median_metrics(run_point(load_run_config(EXAMPLE, overrides), iterations)))
        finally:
            os.environ.pop("OMP_NUM_THREADS") if saved is None else os.environ.update(OMP_NUM_THREADS=saved)
        log(f"  ranks   {n}: {medians[-1]['wall_s']:.3f} s/iteration")
    return {"update": update_rows(results), "memory": memory_rows(results),
            "iterations": iteration_rows(ranks, medians, base["prompts"] * base["samples"])}


def print_ranks(tables: dict[str, list[dict]], base: dict[str, int], iterations: int, updates: int) -> None:
    print(f"\nranks, update alone (16M model, 8 prompts x 4 samples, {updates} timed updates after a warm-up; "
          "shares of each rank's main thread's wall time; comm = blocked - the 1-rank blocked):\n"
          + markdown(UPDATE_COLS, tables["update"]))
    print("\nranks, memory per rank after those updates (elements held as the group reports them; "
          "weights+Adam = 4 bytes x (params + 2 x optimizer); peak RSS = VmHWM, includes torch itself):\n"
          + markdown(MEMORY_COLS, tables["memory"]))
    print(f"\nranks, whole iterations ({EXAMPLE.name}, base {base}, trainer.n_gpus_per_node; median of iterations "
          f"2..{iterations}; group s = update + agreement + weight sync timers; shares of group s):\n"
          + markdown(ITERATION_COLS, tables["iterations"]))


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
    p.add_argument("--sweeps", default=",".join([*AXES, RANKS]),
                   help="comma-separated subset of " + ",".join([*AXES, RANKS]))
    p.add_argument("--base", default="", help="base values (default prompts=32,samples=8,length=16)")
    p.add_argument("--ranks", default="1,2", help="rank counts of the ranks sweep (1 and/or 2)")
    p.add_argument("--updates", type=int, default=3, help="timed updates per configuration of the ranks sweep")
    p.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                   help="thread budget: the flow process's threads; each of R ranks gets max(1, threads // R)")
    args = p.parse_args(argv)
    sweeps, base = [s for s in args.sweeps.split(",") if s], parse_base(args.base)
    unknown = sorted(set(sweeps) - {*AXES, RANKS})
    ranks = sorted({int(r) for r in args.ranks.split(",") if r.strip()})
    if unknown:
        raise SystemExit(f"--sweeps: unknown {unknown}; choose from {','.join([*AXES, RANKS])}")
    if args.iterations < 2:
        raise SystemExit("--iterations must be >= 2 (the first one only warms)")
    if RANKS in sweeps and (not ranks or not set(ranks) <= {1, 2} or args.updates < 1 or args.threads < 1):
        raise SystemExit("the ranks sweep needs --ranks from {1,2} (e.g. 1,2), --updates >= 1 and --threads >= 1")
    import torch

    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        tables = run_sweeps(sweeps, args.points, args.iterations, base, tmp, log=log)
        if RANKS in sweeps:
            rank_tables = run_ranks(ranks, args.iterations, args.updates, base, args.threads, tmp, log=log)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}  python -m benchmarks.bench_scale {' '.join(argv or sys.argv[1:])}")
    print(f"load average (1, 5, 15 min) at the start {' '.join(f'{x:.2f}' for x in load)}, at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, on {os.cpu_count()} cores; threads {args.threads}")
    print(f"workload: {EXAMPLE.name} (built-in model, arith, GRPO) through the stage functions; base {base}; "
          f"seconds per iteration, median of iterations 2..{args.iterations}")
    for sweep in (s for s in sweeps if s != RANKS):
        forced = " (rollout.ignore_eos: every response is max_response_length tokens)" if sweep == "length" else ""
        print(f"\n{sweep} ({AXES[sweep]}) doubling{forced}:\n{format_table(sweep, tables[sweep])}")
    if RANKS in sweeps:
        print_ranks(rank_tables, base, args.iterations, args.updates)
    print("\nother = wall - the split (reads by URI, shard and manifest writes); tok/s = samples x resp tok / wall; "
          "the Prefect flow adds a constant per iteration (one subflow run and its task runs; "
          "`make bench-overhead` measures it).")


if __name__ == "__main__":
    main()

"""The reasoning-gym suite (issue 64, `make bench-suite`): tasks peers train on, measured the way
a run of examples/grpo_rg_smollm2.yaml sees them.

    .venv/bin/python -m benchmarks.bench_suite --start [--tasks a,b] [--heldout 200] [--set key=value ...]
    .venv/bin/python -m benchmarks.bench_suite [--tasks a,b] [--minutes 15] [--out table.md]

--start: SmolLM2-135M-Instruct's greedy held-out score on each candidate task, through rlmill's
own validation path: the run's config (the task as data.generate=rg:<task>), its datasets
(reasoning-gym's generator, the held-out split on its own seed), its prompt rendering
(Run.prompts: the config's completion_template or the chat template), the vLLM rollout engine
the config names, and `greedy_evaluate` with the run's reward (the task's own score_answer on the
last <answer>...</answer>, else the whole response). One engine serves every task: the weights
are the same. Printed per task: the start, the share of responses with an <answer> tag, their
mean length, one response.

Without --start: each suite task trains with `rlmill train` for --minutes of wall time (a fresh
process per task, one after another, every validation of the held-out set read from the run's
committed stages as it lands), then the table: task, family, start, after N minutes, best,
minutes to +10, generated tokens/s, peak memory (wait4's maxrss of the run's process tree: the
largest single process). A run stops at the budget, or earlier once it has gained >= 10 points and
its last --patience validations brought no new best (the measured stop rule); SIGTERM stops
`rlmill train` cleanly (docs/guide/stopping.md). Not a test: the numbers depend on the machine
and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "examples" / "grpo_rg_smollm2.yaml"
# Measured with --start on 2026-12-08 (benchmarks/results/2026-12-08-suite.md): 14 tasks from 7 of
# reasoning-gym's families.
CANDIDATES = ("basic_arithmetic", "chain_sum", "leg_counting", "gcd", "letter_counting", "spell_backward",
              "word_sequence_reversal", "number_filtering", "syllogism", "aiw", "family_relationships",
              "simple_equations", "coin_flip", "rectangle_count")
# reasoning-gym's "direct" system prompt, one worked exchange ("What is 12 + 30?" ->
# <answer>42</answer>) and the config's instruction after each question: the model then writes the
# tag (88 % on letter_counting, 40 problems) and letter_counting starts at 22 % instead of 0.6 %;
# on syllogism it argues instead of answering.
ONE_SHOT = ("system\nAnswer the question directly. Provide your answer between <answer> and </answer> tags. "
            "Do not return any preamble, explanation, or reasoning.<|im_end|>\n"
            "<|im_start|>user\nWhat is 12 + 30? Give only the final answer, between <answer> and </answer> "
            "tags.<|im_end|>\n"
            "<|im_start|>assistant\n<answer>42</answer><|im_end|>\n"
            "<|im_start|>user\n{prompt} Give only the final answer, between <answer> and </answer> tags.<|im_end|>\n"
            "<|im_start|>assistant\n")
# The tasks that start between 5 % and 60 % greedy (the results file), each with the overrides it
# trains with on top of the config: three, from two families (the issue asks for six from four).
SUITE: dict[str, tuple[str, ...]] = {
    "syllogism": (),
    "spell_backward": (),
    "letter_counting": (f"data.completion_template={json.dumps(ONE_SHOT)}",),
}
GAIN = 0.10  # the goal: +10 held-out points


def family(task: str) -> str:
    """reasoning-gym's own family of a task: the package its dataset class lives in
    (reasoning_gym.arithmetic, .algorithmic, .logic, ...)."""
    from reasoning_gym.factory import DATASETS

    return DATASETS[task][0].__module__.split(".")[1]


def task_overrides(task: str, root: str, heldout: int, extra=()) -> list[str]:
    return [f"data.generate=rg:{task}", f"root={root}", f"data.val_size={heldout}", *extra]


# ------------------------------------------------------------------------------------ the start
def start_scores(tasks, heldout: int, extra=(), samples: int = 1) -> list[dict]:
    """Greedy held-out score of the config's start model on each task (module doc)."""
    from flows.config import load_run_config
    from gpu_jobs.rollout.data_parallel import build_rollout_engine
    from gpu_jobs.stages.run import Run
    from gpu_jobs.stages.scoring import greedy_evaluate

    out, engine = [], None
    with tempfile.TemporaryDirectory(prefix="suite-start-") as root:
        for task in tasks:
            cfg = load_run_config(CONFIG, task_overrides(task, root, heldout, [f"run_id=start-{task}", *extra]))
            try:
                run = Run.open(cfg)
            except ValueError as exc:  # e.g. OverlongPromptError: the task's prompts do not fit the config
                out.append({"task": task, "family": family(task), "error": str(exc).splitlines()[0]})
                print(json.dumps(out[-1]), flush=True)
                continue
            if engine is None:
                engine = build_rollout_engine(cfg.rollout.engine, run.model_path, cfg.rollout.engine_options,
                                              storage=cfg.storage)
            prompts, ids = run.prompts(run.val, list(range(len(run.val))), None)
            t0 = time.perf_counter()
            table, metrics = greedy_evaluate(engine, run.tokenizer, prompts, ids, cfg.reward,
                                             cfg.rollout.max_response_length)
            texts = table.column("response_text").to_pylist()
            out.append({"task": task, "family": family(task), "start": metrics["val/acc"], "n": len(texts),
                        "tagged": sum("<answer>" in t and "</answer>" in t for t in texts) / len(texts),
                        "mean_tokens": sum(len(run.tokenizer(t)["input_ids"]) for t in texts) / len(texts),
                        "seconds": time.perf_counter() - t0,
                        "examples": [{"response": t, "truth": p["reward_model"]["ground_truth"]}
                                     for t, p in list(zip(texts, prompts))[:samples]]})
            print(json.dumps(out[-1]), flush=True)
    return out


def start_lines(rows: list[dict]) -> list[str]:
    lines = ["| task | family | greedy start | with <answer> tags | mean response tokens | one response (truth) |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['task']} | {r['family']} | not measured: {r['error']} | | | |")
            continue
        ex = r["examples"][0] if r["examples"] else {"response": "", "truth": ""}
        shown = ex["response"].replace("\n", " ").replace("|", "\\|")[:90]
        lines.append(f"| {r['task']} | {r['family']} | {100 * r['start']:.1f} % | {100 * r['tagged']:.0f} % | "
                     f"{r['mean_tokens']:.0f} | `{shown}` ({ex['truth']}) |")
    return lines



# ----------------------------------------------------------------------------------- training
@dataclass
class Curve:
    """One run's held-out curve as it landed: (iteration, wall seconds since the process started,
    score), and the stop decision."""

    points: list[tuple[int, float, float]] = field(default_factory=list)
    stopped_by: str = "budget"

    def best(self) -> float:
        return max(s for _, _, s in self.points)

    def reached(self, gain: float) -> tuple[int, float, float] | None:
        """The first validation at least `gain` above the start (its k, seconds, score)."""
        start = self.points[0][2]
        return next((p for p in self.points[1:] if p[2] >= start + gain - 1e-9), None)

    def should_stop(self, patience: int) -> bool:
        """The measured stop rule: the goal reached and no new best in the last `patience` validations."""
        if self.reached(GAIN) is None or len(self.points) <= patience:
            return False
        before = max(s for _, _, s in self.points[:-patience])
        return max(s for _, _, s in self.points[-patience:]) <= before


def committed_metrics(root: str, run_id: str, stage: str) -> dict[int, dict]:
    """{k: metrics} of every committed `stage` of the run so far."""
    from storage import RunLayout
    from storage.manifest import read_manifest

    layout = RunLayout(root, run_id)
    return {k: read_manifest(uri).metrics for k, s, uri in layout.committed_stages() if s == stage}


def _watch(proc, root: str, run_id: str, budget_s: float, patience: int, curve: Curve, t0: float) -> None:
    """Poll the run's validations; SIGTERM the run at the budget or by the stop rule."""
    seen: set[int] = set()
    while proc.poll() is None:
        try:
            vals = committed_metrics(root, run_id, "validate")
        except Exception:  # noqa: BLE001 - a stage being written: read it on the next pass
            vals = {}
        for k in sorted(set(vals) - seen):
            seen.add(k)
            curve.points.append((k, time.monotonic() - t0, float(vals[k]["val/acc"])))
            print(f"  {run_id}: iteration {k} at {curve.points[-1][1] / 60:.1f} min: held-out "
                  f"{100 * curve.points[-1][2]:.1f} %", flush=True)
        if curve.points and curve.should_stop(patience):
            curve.stopped_by = f"stop rule (+10 reached, no new best in {patience} validations)"
        elif time.monotonic() - t0 < budget_s:
            time.sleep(3)
            continue
        proc.send_signal(signal.SIGTERM)
        return


def train_task(task: str, args) -> dict:
    """One suite task trained for args.minutes of wall time (module doc); its row of the table."""
    run_id = f"suite-{task}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = task_overrides(task, args.root, args.heldout, ["trainer.total_iterations=1000",
                                                               "trainer.checkpoint_every=1000", f"run_id={run_id}",
                                                               *SUITE.get(task, ()), *args.set])
    cmd = [str(Path(sys.executable).parent / "rlmill"), "train", "--config", str(CONFIG), *overrides]
    log = Path(args.root, f"{run_id}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    curve, t0 = Curve(), time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        watcher = threading.Thread(target=_watch, args=(proc, args.root, run_id, 60 * args.minutes, args.patience,
                                                        curve, t0), daemon=True)
        watcher.start()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: its tree's largest process
        proc.returncode = os.waitstatus_to_exitcode(status)
        watcher.join()
    wall = time.monotonic() - t0
    steps = committed_metrics(args.root, run_id, "commit")
    return {"task": task, "family": family(task), "run_id": run_id, "log": str(log), "rc": proc.returncode,
            "wall_s": wall, "points": curve.points, "stopped_by": curve.stopped_by, "iterations": len(steps),
            "gen_tps": _median([m.get("perf/gen_tokens_per_s") for m in steps.values()]),
            "s_iter": _median([m.get("timing_s/step") for m in steps.values()]),
            "rss_peak": usage.ru_maxrss * 1024}


def _median(values) -> float | None:
    import statistics

    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def table_lines(rows: list[dict], minutes: float) -> list[str]:
    lines = [f"| task | family | start | after {minutes:g} min | best | minutes to +10 | iterations | "
             "gen tok/s | s/iteration | peak memory |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = Curve(points=[tuple(p) for p in r["points"]])
        if not c.points:
            lines.append(f"| {r['task']} | {r['family']} | no validation landed (exit {r['rc']}, {r['log']}) "
                         "| | | | | | | |")
            continue
        within = [p for p in c.points if p[1] <= 60 * minutes] or c.points[:1]
        hit = c.reached(GAIN)
        fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
        lines.append(f"| {r['task']} | {r['family']} | {100 * c.points[0][2]:.1f} % | {100 * within[-1][2]:.1f} % "
                     f"(it. {within[-1][0]}) | {100 * c.best():.1f} % | {fmt(hit and hit[1] / 60, '{:.1f}')} | "
                     f"{r['iterations']} | {fmt(r['gen_tps'], '{:.0f}')} | {fmt(r['s_iter'], '{:.1f}')} | "
                     f"{r['rss_peak'] / 2**30:.1f} GB |")
    return lines


def main_train(args) -> None:
    rows = []
    for task in args.tasks:
        print(f"{task}: training for {args.minutes:g} min", flush=True)
        rows.append(train_task(task, args))
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
    print("\n".join(table_lines(rows, args.minutes)))


def main_start(args) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    rows = start_scores(args.tasks, args.heldout, args.set, samples=1)
    print("\n".join(start_lines(rows)))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--start", action="store_true", help="measure the greedy start of each task only")
    p.add_argument("--tasks", type=lambda s: s.split(","), default=None,
                   help="comma-separated reasoning-gym tasks (default: --start CANDIDATES, else SUITE)")
    p.add_argument("--heldout", type=int, default=200, help="held-out problems per task (data.val_size)")
    p.add_argument("--minutes", type=float, default=15.0, help="wall-time budget of each task's training run")
    p.add_argument("--patience", type=int, default=3,
                   help="stop a run early once it gained >= 10 points and this many validations brought no new best")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (repeatable), e.g. --set rollout.max_response_length=64")
    p.add_argument("--root", default=str(Path(tempfile.gettempdir(), "rlmill-suite")),
                   help="where the training runs write (their runs, datasets and logs)")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    args.tasks = args.tasks or list(CANDIDATES if args.start else SUITE)
    return args


if __name__ == "__main__":
    _args = parse_args()
    main_start(_args) if _args.start else main_train(_args)

"""What `make bench-e2e` measures and prints (benchmarks.bench_e2e runs the workloads): token
counts, the shared greedy evaluation, step clocks and summaries, each run's peak resident memory;
the tables (one line per row, ratios to TRL), the issue's goals, footnotes, and the update's
achieved FLOP/s.

    .venv/bin/python -m benchmarks.bench_e2e --workload long128 --model 16m
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import threading

from benchmarks.bench_e2e_long import update_flops


def token_counts(prompt_lens, response_lens) -> tuple[int, int]:
    """(generated, trained) tokens of one step: responses, and prompt + response of every row."""
    gen = sum(int(r) for r in response_lens)
    return gen, gen + sum(int(p) for p in prompt_lens)


def greedy_accuracy(model, tokenizer, problems, max_new_tokens: int, score, batch_size: int = 256) -> float:
    """Mean `score`(greedy answer, truth) over `problems` (prompt text, truth): the share answered
    right for the 0/1 rules (arith_score, last_number_score). Plain transformers `generate`, left
    padded: neither side's generation code."""
    import torch
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model.eval()
    hits = 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        enc = tokenizer([p for p, _ in chunk], return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, generation_config=gen_cfg)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        hits += sum(score(t, truth) for t, (_, truth) in zip(texts, chunk))
    return hits / len(problems)


def evaluate_folder(folder: str, tokenizer, problems, max_new_tokens: int, score) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    return greedy_accuracy(model, tokenizer, problems, max_new_tokens, score)


# ------------------------------------------------------------------------------ peak resident memory
def tree_rss(pid: int) -> int:
    """Resident bytes of process `pid` and all its descendants now (0 once it is gone). Shared
    pages count once per process that maps them, so this is an upper bound of the tree's use."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:  # ended between the listing and the read
            pass
    return total


def run_measured(cmd: list[str], *, cwd, stdout, every: float = 0.5) -> tuple[int, dict]:
    """Run `cmd` to its end; (exit code, {"rss_peak", "rss_tree"} in bytes). rss_peak: the
    kernel's maxrss of the child from wait4, i.e. the largest single process among the child
    and the descendants it waited for (the worker itself, its vLLM engine core or Prefect's
    ephemeral server, whichever peaked highest); exact. rss_tree: the highest sum of resident
    sets over the whole tree (the ephemeral Prefect server is a process of its own), sampled every
    `every` seconds, and never below rss_peak (a sample can miss a peak shorter than `every`)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT)
    ended, highest = threading.Event(), [0]

    def sample():
        while not ended.wait(every):
            highest[0] = max(highest[0], tree_rss(proc.pid))

    sampler = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    sampler.start()
    try:
        # wait4, not Popen.wait: only it returns this child's own rusage (RUSAGE_CHILDREN of this
        # process would be the maximum over every run so far).
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        ended.set()
        sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    peak = usage.ru_maxrss * 1024  # kilobytes on Linux
    return proc.returncode, {"rss_peak": peak, "rss_tree": max(highest[0], peak)}


def after_warmup(step_seconds, skip: int = 1) -> slice:
    """The steps a run is measured on: those after the first `skip` (one-time warm-up), or all
    of them when the run has no more."""
    return slice(skip, None) if len(step_seconds) > skip else slice(None)


def summarize(step_seconds, gen_tokens, train_tokens, skip: int = 1) -> dict:
    """One run's s/step (median of steps after the first `skip`) and tokens/s (mean tokens per
    step of the same steps over that median)."""
    keep = after_warmup(step_seconds, skip)
    s = statistics.median(step_seconds[keep])
    return {"s_step": s, "gen_tps": statistics.mean(gen_tokens[keep]) / s,
            "train_tps": statistics.mean(train_tokens[keep]) / s}


def first_crossing(step_seconds, budget: float, skip: int = 1) -> tuple[int, float]:
    """(steps, clock) at the first step whose cumulative time reaches `budget`, or at the last
    step. The clock starts after the first `skip` steps (one-time warm-up: lazy imports, first
    allocations), whose updates still count as steps."""
    clock = 0.0
    for k, s in enumerate(step_seconds, 1):
        clock += s if k > skip else 0.0
        if k > skip and clock >= budget:
            return k, clock
    return len(step_seconds), clock


def curve_steps(steps: int, every: int) -> list[int]:
    """The steps before `steps` whose weights the per-step curve evaluates: every `every`-th (none
    when every is 0); the last step's are the run's final weights, evaluated anyway."""
    return list(range(every, steps, every)) if every > 0 else []


def seeds_lines(by_seed: dict[int, dict[str, dict]], before: dict[int, float]) -> list[str]:
    """The accuracy phase over seeds: per row, the held-out score at equal training time (mean,
    standard deviation, range), the steps it took, and the per-step curve's mean over the seeds
    that reached each step; under it, each seed's own curve (a mean alone cannot say whether one
    row's curve lies within the other's spread). `by_seed`: seed -> row -> that run's results
    (acc_after, steps, train_seconds, curve: step -> score); `before`: seed -> the start
    checkpoint's score."""
    rows = list(dict.fromkeys(row for results in by_seed.values() for row in results))
    pct = lambda xs: f"{100 * statistics.mean(xs):5.1f} ± {100 * (statistics.stdev(xs) if len(xs) > 1 else 0):4.1f}"
    b = list(before.values())
    out = [f"over seeds {', '.join(map(str, by_seed))}: held-out score before {pct(b)} %",
           f"{'row':<14} {'acc at equal time':>19} {'range':>13} {'steps':>6} {'train s':>8}  per-step curve (mean over seeds)"]
    for row in rows:
        own = {seed: results[row] for seed, results in by_seed.items()
               if results.get(row, {}).get("acc_after") is not None}
        runs = list(own.values())
        if not runs:
            out.append(f"{row:<14} {'-':>19}")
            continue
        acc = [r["acc_after"] for r in runs]
        curve: dict[int, list[float]] = {}
        for r in runs:
            for k, v in r.get("curve", {}).items():
                curve.setdefault(int(k), []).append(v)
        points = "  ".join(f"{k}: {100 * statistics.mean(v):.1f}" + ("" if len(v) == len(runs) else f" ({len(v)})")
                           for k, v in sorted(curve.items()))
        out.append(f"{row:<14} {pct(acc):>17} % {100 * min(acc):5.1f}..{100 * max(acc):5.1f} "
                   f"{statistics.mean(r['steps'] for r in runs):6.1f} {statistics.mean(r['train_seconds'] for r in runs):8.1f}"
                   f"  {points}")
        for seed, r in own.items():
            seed_points = "  ".join(f"{k}: {100 * v:.1f}" for k, v in sorted((int(k), v) for k, v in r.get("curve", {}).items()))
            out.append(f"  seed {seed:<7} {100 * r['acc_after']:17.1f} % {'':>13} {r['steps']:6d} "
                       f"{r['train_seconds']:8.1f}  {seed_points}")
    out.append("  (curve: step -> held-out %; a count in brackets: only that many seeds reached the step)")
    return out


def budget_scores(step_seconds, curve: dict, budgets, skip: int = 1) -> dict[float, float | None]:
    """{budget: the held-out score after the step whose clock first reaches it (first_crossing's
    rule, the one the table's "acc at equal time" uses)}; None where the run's curve did not score
    that step or its last step came before the budget. `curve`: step -> score (JSON keys allowed).

    first_crossing's rule favours the slower side: a run of 30 s steps is scored at 30 s against a
    budget of 15 s, one of 15 s steps at 15 s."""
    scores = {int(k): v for k, v in curve.items()}
    out = {}
    for budget in budgets:
        k, clock = first_crossing(step_seconds, budget, skip)
        out[budget] = scores.get(k) if clock >= budget else None
    return out


def budget_lines(by_seed: dict[int, dict[str, dict]], budgets) -> list[str]:
    """Equal time at every budget of `budgets` (seconds), from the per-step curves of the accuracy
    runs (--eval-every 1 scores every step): per budget, each row's mean held-out score over the
    seeds, and every other row's mean difference from the TRL row with the seeds it leads on. A
    budget is shown for a row only when every seed's run scored its crossing step. `by_seed`: seed
    -> row -> that run's results (step_seconds, curve)."""
    rows = list(dict.fromkeys(row for results in by_seed.values() for row in results))
    ref = reference_row({row: True for row in rows})
    at = {row: {seed: budget_scores(r[row]["step_seconds"], r[row].get("curve", {}), budgets)
                for seed, r in by_seed.items() if r.get(row, {}).get("step_seconds")} for row in rows}

    def mean_at(row, budget):
        scores = [s[budget] for s in at[row].values()]
        return statistics.mean(scores) if scores and None not in scores else None

    others = [row for row in rows if row != ref] if ref in rows else []  # no TRL row: no differences
    out = [f"held-out % at equal time for every budget (mean over seeds {', '.join(map(str, by_seed))}; each run "
           "scored after the step that crosses the budget)",
           f"{'budget s':>9} " + " ".join(f"{row:>17}" for row in rows)
           + "".join(f"  {row[:14] + ' - ' + ref:>26} {'leads':>6}" for row in others)]
    for budget in budgets:
        means = {row: mean_at(row, budget) for row in rows}
        line = f"{budget:9g} " + " ".join(f"{'-' if m is None else f'{100 * m:.1f}':>17}" for m in means.values())
        for row in others:
            if means[row] is None or means[ref] is None:  # else every seed of both scored this budget
                line += f"  {'-':>26} {'':>6}"
                continue
            diff = [at[row][seed][budget] - at[ref][seed][budget] for seed in at[row] if seed in at[ref]]
            line += f"  {100 * statistics.mean(diff):+26.1f} {sum(d > 0 for d in diff):>2} of {len(diff)}"
        out.append(line)
    return out


def budget_steps(budget: float, s_step: float | None, margin: float) -> int:
    """Steps a fixed-length run needs to cross `budget` seconds, with a margin for noise."""
    return math.ceil(budget / (s_step or 1.0) * margin) + 2


def median_summary(runs: list[dict], skip: int = 1) -> dict:
    """Medians over runs of summarize(); the highest `rss_peak` and `rss_tree` of the runs that
    measured them; and, when every run timed its updates, `update_s` (median update seconds of the
    steps after `skip`) and `train_tokens` (mean trained tokens per step)."""
    per_run = [summarize(r["step_seconds"], r["gen_tokens"], r["train_tokens"], skip) for r in runs]
    out = {key: statistics.median(s[key] for s in per_run) for key in per_run[0]}
    for key in ("rss_peak", "rss_tree"):
        if any(key in r for r in runs):
            out[key] = max(r[key] for r in runs if key in r)
    if all(r.get("update_seconds") for r in runs):
        kept = [slice(skip, None) if len(r["update_seconds"]) > skip else slice(None) for r in runs]
        out["update_s"] = statistics.median(statistics.median(r["update_seconds"][k]) for r, k in zip(runs, kept))
        out["train_tokens"] = statistics.median(statistics.mean(r["train_tokens"][k]) for r, k in zip(runs, kept))
    return out


# ------------------------------------------------------------------------------ tables
def reference_row(results: dict[str, dict]) -> str:
    """The row the ratios divide by: `trl`, else the first other TRL row measured (trl-vllm when
    only that one runs)."""
    if results.get("trl"):
        return "trl"
    return next((row for row, r in results.items() if row.startswith("trl") and r), "trl")


def format_table(results: dict[str, dict], acc_before: float | None) -> list[str]:
    """One line per row; ratio columns are row / the reference row (`reference_row`: TRL) for
    every measure (s/step: < 1 is faster). `acc_before` None: a workload without an accuracy phase."""
    ref = reference_row(results)
    trl = results.get(ref, {})

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    def ratio(r, key):
        a, b = r.get(key), trl.get(key)
        return "-" if a is None or not b else f"{a / b:.2f}x"

    def gb(v):
        return "-" if v is None else f"{v / 2**30:.2f}"

    head = (f"{'row':<14}{'s/step':>8}{'gen tok/s':>11}{'train tok/s':>13}{'peak GB':>9}{'tree GB':>9}"
            f"{'acc before':>12}{'acc after':>11}{'steps':>7}{'train s':>9}"
            f"  |{'s/step':>8}{'gen tok/s':>11}{'train tok/s':>13}{'peak GB':>9}{'acc after':>11}")
    lines = [" " * head.index("|") + f"|  rlmill / {ref}", head]
    for row, r in results.items():
        acc = r.get("acc_after")
        lines.append(
            f"{row:<14}{num(r.get('s_step'), '.2f'):>8}{num(r.get('gen_tps'), ',.0f'):>11}"
            f"{num(r.get('train_tps'), ',.0f'):>13}{gb(r.get('rss_peak')):>9}{gb(r.get('rss_tree')):>9}"
            f"{'-' if acc_before is None else f'{100 * acc_before:.1f} %':>12}"
            f"{('-' if acc is None else f'{100 * acc:.1f} %'):>11}{num(r.get('steps'), 'd'):>7}"
            f"{num(r.get('train_seconds'), '.1f'):>9}  |{ratio(r, 's_step'):>8}{ratio(r, 'gen_tps'):>11}"
            f"{ratio(r, 'train_tps'):>13}{ratio(r, 'rss_peak'):>9}{ratio(r, 'acc_after'):>11}")
    return lines


def goal_lines(results: dict[str, dict], goals: dict[str, float]) -> list[str]:
    """Each rlmill row's train tok/s over every TRL row's, judged against its goal in `goals`
    (row -> minimum ratio; a row without one is only measured) over the fastest TRL row: TRL in
    its best configuration. Held-out accuracy is compared with the reference row's (`trl`, else
    the TRL row measured)."""
    trls = {row: r["train_tps"] for row, r in results.items() if row.startswith("trl") and r.get("train_tps")}
    ref = reference_row(results)
    trl, out = results.get(ref, {}), []
    for row, r in results.items():
        if row.startswith("trl") or not trls or r.get("train_tps") is None:
            continue
        x = {ref: r["train_tps"] / tps for ref, tps in trls.items()}
        goal, best = goals.get(row), min(x.values())
        verdict = ("" if goal is None else
                   f" (goal >= {goal:g}x{' the fastest TRL row' if len(x) > 1 else ''}: "
                   f"{'met' if best >= goal else 'not met'})")
        acc = ("" if r.get("acc_after") is None or trl.get("acc_after") is None else
               f"; acc after {100 * r['acc_after']:.1f} % vs {ref} {100 * trl['acc_after']:.1f} % "
               f"({'met' if r['acc_after'] >= trl['acc_after'] else 'not met'})")
        ratios = ", ".join(f"{v:.2f}x {ref}" for ref, v in x.items())
        out.append(f"  {row}: train tok/s {ratios}{verdict}{acc}")
    return out


def check_lines(results: dict[str, dict], acc_before: float, budget: float) -> list[str]:
    """Footnotes: rlmill's own validation of the start checkpoint against the shared function,
    and any run that ran out of steps before the budget."""
    out = [f"check: {row}'s own validation of the start checkpoint {100 * r['own_acc_before']:.1f} %, "
           f"shared function {100 * acc_before:.1f} %" for row, r in results.items() if "own_acc_before" in r]
    out += [f"note: {row} ran out of steps at {r['train_seconds']:.1f} s < {budget:g} s; its accuracy is "
            "from fewer seconds" for row, r in results.items() if r.get("train_seconds", budget) < budget]
    return out


def flops_lines(results: dict[str, dict], params: int, peak: float) -> list[str]:
    """One line per row with an update time: its seconds, achieved GFLOP/s and share of `peak`
    (the cores' measured fp32 matmul FLOP/s)."""
    out = [f"update FLOP/s = 6 x {params / 1e6:.2f}M params x trained tokens / update s; "
           f"fp32 matmul peak of these cores, measured in this run: {peak / 1e9:.0f} GFLOP/s"]
    for row, r in results.items():
        if r.get("update_s") and r.get("train_tokens"):
            f = update_flops(params, r["train_tokens"], r["update_s"])
            out.append(f"  {row:<14} update {r['update_s']:.2f} s for {r['train_tokens']:,.0f} tokens: "
                       f"{f / 1e9:.0f} GFLOP/s = {100 * f / peak:.0f} % of peak")
    return out

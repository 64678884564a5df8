"""What serving costs (issue 25's `make bench-serve`): requests/s and latency of a real `rlmill
serve` process with answer logging on and off, and how long feedback takes to be committed.

    .venv/bin/python -m benchmarks.bench_serve                                  # built-in model, ~2 min
    .venv/bin/python -m benchmarks.bench_serve --model smollm2 --concurrency 1,4 --max-tokens 16
    .venv/bin/python -m benchmarks.bench_serve --seconds 30 --repeats 3 --feedbacks 300      # longer
    .venv/bin/python -m benchmarks.bench_serve --hostile     # /health and good clients under attack (issue 61)

Two `python -m flows.cli serve` processes on the same model: one logging (--redis to a
redis-server started here, with a `feedback consume --follow` process committing the stream to a
local folder), one not (--redis none). At each concurrency level a closed-loop client (asyncio +
httpx: each of C workers sends the next completion when the last returned) measures both, in
alternating order (on/off, then off/on), so a slow spell on the shared box hits both alike;
latencies are pooled over the repeats. Then feedback is posted at a steady rate for answers the
logging server gave, under load at --feedback-load, and each one's latency to committed storage
is the time from the POST to the mtime of the first segment manifest listing its event id.
`--model smollm2` registers the converted SmolLM2-135M-Instruct folder (`rlmill models fetch
smollm2`) as models/smollm2/versions/v1 under a temporary root (a symlink) and serves it with
`--model smollm2 --root <that root>`, as a promoted model is served. Not a test: the numbers depend
on the machine and its load; compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks.chaos.serve_stack import (Client, Proc, RedisServer, ServeProcess, audit_answers, consumer,
                                         published_all, stream_drained, wait_until)

GOAL_RPS, GOAL_LOG_COST, GOAL_FEEDBACK_P99_S = 20.0, 0.10, 10.0


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank.

    >>> percentile([1, 2, 3, 4], 0.5), percentile(list(range(100)), 0.99)
    (2, 98)
    """
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(round(q * len(ordered))) - 1))]


def measure(base: str, concurrency: int, warmup_s: float, seconds: float, max_tokens: int) -> dict:
    """Closed-loop load for `warmup_s` + `seconds`; requests completing inside the window count."""
    client = Client(base, concurrency, max_tokens).start()
    try:
        time.sleep(warmup_s)  # the load runs for a fixed time: that is the measurement, not a wait
        t0 = time.monotonic()
        time.sleep(seconds)
        t1 = time.monotonic()
    finally:
        client.stop()
    window = [a for a in client.answers if t0 <= a.done < t1]
    return {"latencies": [a.latency_s for a in window], "seconds": t1 - t0, "errors": sum(client.errors.values()),
            "ids": client.ids}


def register_model(name: str, root: Path) -> tuple[str, ...]:
    """serve's arguments for `name`: () for the built-in model; smollm2 is registered under `root`."""
    if name == "builtin":
        return ()
    if name != "smollm2":
        sys.exit(f"rlmill: --model {name!r} is not known here: use builtin or smollm2")
    from gpu_jobs.models import ensure_smollm2
    from storage import ModelLayout

    try:
        folder = ensure_smollm2()  # the converted folder; converts once (~30 s) when only the package is there
    except ImportError as exc:  # neither the converted folder nor the package: the message says how
        sys.exit(f"rlmill: {exc}")
    layout = ModelLayout(str(root), name)
    version = Path(layout.version("v1"))
    version.parent.mkdir(parents=True, exist_ok=True)
    version.symlink_to(folder, target_is_directory=True)  # 517 MB: linked, not copied
    layout.promote("v1")
    return ("--model", name, "--root", str(root))


def feedback_latency(base: str, root: Path, model: str, answer_ids: list[str], n: int, rate: float,
                     load: int, max_tokens: int) -> tuple[list[float], list[str]]:
    """Post `n` feedbacks at `rate`/s (with `load` concurrent completions going on); seconds from
    each POST to the mtime of the first committed manifest listing its event id, and the answer
    ids of the completions made meanwhile."""
    import httpx

    posted: dict[str, float] = {}
    client = Client(base, load, max_tokens, seed=7).start() if load else None
    try:
        with httpx.Client(base_url=base, timeout=60) as http:
            for i in range(n):
                t = time.time()
                # one voter per feedback: the server takes one vote per (answer, choice, voter)
                r = http.post("/v1/feedback", json={"answer_id": answer_ids[i % len(answer_ids)],
                                                    "score": (i % 11) / 10, "user": f"bench-{i}"})
                r.raise_for_status()
                posted[r.json()["id"]] = t
                time.sleep(max(0.0, t + 1 / rate - time.time()))  # a steady rate, not a burst
        folder = root / "feedback" / model
        committed: dict[str, float] = {}
        seen: set[Path] = set()

        def all_committed() -> bool:
            for m in folder.rglob("_MANIFEST.json"):
                if m not in seen:
                    seen.add(m)
                    at = m.stat().st_mtime
                    for e in json.loads(m.read_text()).get("event_ids", ()):
                        committed[e] = min(at, committed.get(e, at))
            return posted.keys() <= committed.keys()

        wait_until(f"the {n} feedback events in committed segments", all_committed, 120, step=0.1)
    finally:
        if client is not None:
            client.stop()
    return [committed[e] - t for e, t in posted.items()], client.ids if client is not None else []


def run(args, work: Path) -> str:
    levels = [int(c) for c in args.concurrency.split(",")]
    root = work / "store"
    model, model_args = args.model, register_model(args.model, work / "models")
    with ExitStack() as stack:
        redis = RedisServer(work).start()
        stack.callback(redis.stop)
        on = ServeProcess(work, redis.url, model_args=model_args)
        off = ServeProcess(work, "none", model_args=model_args)
        for s in (on, off):  # one at a time: two model loads at once on 2 cores are slow for both
            stack.callback(s.stop)
            s.start()
        cons: Proc = consumer(work, str(root), redis.url).start()
        stack.callback(cons.stop)
        lat: dict[tuple[int, str], list[float]] = {}
        rps: dict[tuple[int, str], list[float]] = {}
        errors: dict[tuple[int, str], int] = {}
        p50s: dict[tuple[int, str], list[float]] = {}  # per repeat: how far the ratio moves run to run
        answered: list[str] = []
        for i, c in enumerate(levels):
            for r in range(args.repeats):
                order = (("on", on), ("off", off)) if (i + r) % 2 == 0 else (("off", off), ("on", on))
                for mode, serve in order:
                    got = measure(serve.base, c, args.warmup, args.seconds, args.max_tokens)
                    lat.setdefault((c, mode), []).extend(got["latencies"])
                    rps.setdefault((c, mode), []).append(len(got["latencies"]) / got["seconds"])
                    p50s.setdefault((c, mode), []).append(statistics.median(got["latencies"]))
                    errors[(c, mode)] = errors.get((c, mode), 0) + got["errors"]
                    if mode == "on":
                        answered += got["ids"]
                    print(f"  c={c:<3} logging {mode:3s} run {r + 1}: {rps[(c, mode)][-1]:.1f} req/s, "
                          f"p50 {statistics.median(got['latencies']) * 1000:.0f} ms", file=sys.stderr, flush=True)
        fb, more = feedback_latency(on.base, root, model, answered, args.feedbacks, args.feedback_rate,
                                    args.feedback_load, args.max_tokens)
        answered += more
        wait_until("serve's publisher to send every event", lambda: published_all(on), 120, on, step=0.2)
        wait_until("the consumer to commit every stream entry", lambda: stream_drained(redis.url), 120, cons, step=0.2)
        dropped = int(on.metrics().get("rlmill_serve_events_dropped_total", 0))
        audit = audit_answers(str(root), answered, dropped, model)
    return report(args, levels, lat, rps, errors, fb, audit, p50s)


def report(args, levels, lat, rps, errors, fb, audit, p50s=None) -> str:
    """The table; `p50s` (per-repeat p50s) adds the range of the on/off ratio over the repeats:
    on a shared box it is the noise the pooled ratio has to be read against."""
    lines = [f"\nrlmill serve, model {args.model} (hf engine), {time.strftime('%Y-%m-%d')}, load average "
             f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} cores; /v1/completions max_tokens={args.max_tokens}, "
             f"{args.repeats} x {args.seconds:g} s per cell after {args.warmup:g} s warm-up; "
             f"`python -m benchmarks.bench_serve {' '.join(sys.argv[1:])}`".rstrip(),
             "| concurrency | logging | requests | req/s | p50 ms | p99 ms | errors | p50 on/off |",
             "|---|---|---|---|---|---|---|---|"]
    ratios = {}
    for c in levels:
        ratios[c] = statistics.median(lat[(c, "on")]) / statistics.median(lat[(c, "off")])
        for mode in ("off", "on"):
            v = lat[(c, mode)]
            lines.append(f"| {c} | {mode} | {len(v)} | {statistics.mean(rps[(c, mode)]):.1f} | "
                         f"{statistics.median(v) * 1000:.1f} | {percentile(v, 0.99) * 1000:.1f} | "
                         f"{errors[(c, mode)]} | {ratio_cell(c, ratios[c], p50s) if mode == 'on' else ''} |")
    fb_p50, fb_p99 = statistics.median(fb), percentile(fb, 0.99)
    lines.append(f"feedback -> committed ({len(fb)} posted at {args.feedback_rate:g}/s with {args.feedback_load} "
                 f"concurrent completions going on, `feedback consume --follow`): p50 {fb_p50:.2f} s, "
                 f"p99 {fb_p99:.2f} s, max {max(fb):.2f} s")
    lines.append(f"logged answers {audit.line().removeprefix('audit: ')}")
    best = max(statistics.mean(rps[(c, "on")]) for c in levels)
    worst = max(ratios.values())
    lines.append(f"goals: >= {GOAL_RPS:g} req/s with logging on: {best:.1f} "
                 f"({'met' if best >= GOAL_RPS else 'NOT met'}); logging adds <= {GOAL_LOG_COST:.0%} to p50: "
                 f"worst {worst - 1:+.1%} ({'met' if worst <= 1 + GOAL_LOG_COST else 'NOT met'}); "
                 f"feedback committed p99 <= {GOAL_FEEDBACK_P99_S:g} s: {fb_p99:.2f} s "
                 f"({'met' if fb_p99 <= GOAL_FEEDBACK_P99_S else 'NOT met'})")
    return "\n".join(lines)


def ratio_cell(c: int, pooled: float, p50s: dict | None) -> str:
    """'1.031' or, with per-repeat p50s of more than one repeat, '1.031 (0.97-1.12)'."""
    if not p50s or len(p50s[(c, "on")]) < 2:
        return f"{pooled:.3f}"
    each = [a / b for a, b in zip(p50s[(c, "on")], p50s[(c, "off")])]
    return f"{pooled:.3f} ({min(each):.2f}-{max(each):.2f})"


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin", help="builtin (default) or smollm2 (rlmill models fetch smollm2)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrent clients per level")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per level, mode and repeat")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each measurement")
    p.add_argument("--repeats", type=int, default=2, help="measurements of each (level, mode), alternating order")
    p.add_argument("--max-tokens", type=int, default=6, help="max_tokens of each completion")
    p.add_argument("--feedbacks", type=int, default=100, help="feedbacks posted for the commit latency")
    p.add_argument("--feedback-rate", type=float, default=10.0, help="feedbacks posted per second")
    p.add_argument("--feedback-load", type=int, default=4, help="concurrent completions meanwhile (0: idle)")
    p.add_argument("--hostile", action="store_true",
                   help="instead: /health and 4 good clients, clean and while one principal sends the bounded-work "
                        "attacks (benchmarks/bench_serve_hostile.py); --seconds and --warmup per phase")
    args = p.parse_args(argv)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency {args.concurrency!r}: give whole numbers separated by commas, e.g. 1,4,16")
    bad = [(flag, v) for flag, v in (("--concurrency", min(levels)), ("--seconds", args.seconds),
                                     ("--repeats", args.repeats), ("--max-tokens", args.max_tokens),
                                     ("--feedbacks", args.feedbacks), ("--feedback-rate", args.feedback_rate))
           if v <= 0] + [(flag, v) for flag, v in (("--warmup", args.warmup), ("--feedback-load", args.feedback_load))
                         if v < 0]
    if bad:
        p.error(f"{bad[0][0]} {bad[0][1]:g} must be positive" + (" or 0" if bad[0][0] in ("--warmup", "--feedback-load")
                                                                 else ""))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlmill-bench-serve-") as tmp:
        if args.hostile:
            from benchmarks.bench_serve_hostile import run_hostile

            print(run_hostile(args, Path(tmp)))
        else:
            print(run(args, Path(tmp)))


if __name__ == "__main__":
    main()

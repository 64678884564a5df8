"""`rlmill simulate`: simulated users ask a running `rlmill serve` the built-in task's held-out
problems and rate every answer with a hidden preference (correct and short; see
gpu_jobs/online/simulate.py for the formula), posted to /v1/feedback.

    rlmill simulate --url http://127.0.0.1:8000 --requests 64 --users 8 --seed 0
    rlmill simulate --url http://127.0.0.1:8000 --model arith --temperature 0 --thumbs

It prints one table: per version that answered (the response's system_fingerprint, which its
answer event names), the requests, users, mean live reward and share of correct answers.
Wrong numbers or a URL where no server answers are one `rlmill: ...` line each, before any request.
"""

from __future__ import annotations

import math

from flows.user_errors import UserError

__all__ = ["add_simulate_parser", "check_args", "cmd_simulate"]


def add_simulate_parser(sub) -> None:
    """`rlmill simulate` under the command parsers `sub`."""
    p = sub.add_parser("simulate", help="simulated users: ask `rlmill serve`, rate each answer, post the feedback",
                       description="Simulated users (sim-user-<i>) send the built-in task's held-out problems to a "
                                   "serve URL and post a hidden preference's score of each answer to /v1/feedback: "
                                   "score = correct * (1 - min(tokens, L) / (2 L)), L = --max-tokens.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="the model name to ask for (default: whatever the server serves); "
                                                 "another name than the server's is refused")
    p.add_argument("--requests", type=int, default=64, help="requests in all (default 64)")
    p.add_argument("--users", type=int, default=8, help="simulated users sim-user-0..N-1 (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seeds the problems, who asks them and each request's "
                                                       "sampling seed (default 0)")
    p.add_argument("--pool", type=int, default=None, help="draw the requests from this many distinct problems "
                                                          "(users who ask the same things again; default: every "
                                                          "request a new problem)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, 0..2 (default 1.0)")
    p.add_argument("--max-tokens", type=int, default=6, help="max_tokens per answer, and L of the preference "
                                                             "(default 6, the task's response length)")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight at once (default 2)")
    p.add_argument("--thumbs", action="store_true", help="post thumbs up/down (score >= 0.5) beside the score")
    p.set_defaults(fn=cmd_simulate)


def check_args(args) -> None:
    """The first wrong number as a UserError naming the flag and the fix."""
    for flag, value, low in (("--requests", args.requests, 1), ("--users", args.users, 1),
                             ("--max-tokens", args.max_tokens, 1), ("--concurrency", args.concurrency, 1),
                             ("--pool", 1 if args.pool is None else args.pool, 1)):
        if value < low:
            raise UserError(f"{flag} {value} is below {low}: give a positive number")
    if max(args.requests if args.pool is None else 0, args.pool or 0) > 8100:
        flag, n = ("--pool", args.pool) if args.pool else ("--requests", args.requests)
        raise UserError(f"{flag} {n}: the built-in task has 8100 distinct problems; give at most 8100 (or --pool "
                        "to ask some again)")
    if not (math.isfinite(args.temperature) and 0.0 <= args.temperature <= 2.0):
        raise UserError(f"--temperature {args.temperature:g} is outside 0..2 (what the server takes)")


def cmd_simulate(args) -> None:
    check_args(args)
    from gpu_jobs.online.simulate import SimulateError, format_table, plan_requests, served_model, simulate

    try:
        model, version = served_model(args.url, args.model)  # before any work: is a server there?
        print(f"rlmill: {args.requests} requests from {args.users} simulated users to {model} (serving version "
              f"{version}) at {args.url}, seed {args.seed}", flush=True)
        result = simulate(args.url, plan_requests(args.requests, args.users, args.seed, pool=args.pool), model=model,
                          max_tokens=args.max_tokens, temperature=args.temperature, concurrency=args.concurrency,
                          thumbs=args.thumbs)
    except SimulateError as exc:
        raise UserError(str(exc)) from None
    print(format_table(result.table), flush=True)
    lost = sum(not a.feedback_logged for a in result.answers)
    if lost:
        print(f"rlmill: {lost} feedback event(s) were not logged: the server has no broker (--redis none) or "
              "dropped them", flush=True)

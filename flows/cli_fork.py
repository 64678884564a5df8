"""`rlmill train --from RUN@K [--fresh-optimizer]`: the CLI's side of a forked run
(gpu_jobs/stages/fork.py does the checks and the copies).

    rlmill train --config examples/grpo_arith.yaml --from grpo-arith-20261201-093000@10 actor.lr=5e-5

The fork is checked after the run id is decided and before anything is written; it is written
after check_startable, and the run then starts as any named run does: restored from its copy of
checkpoint K, it goes on at iteration K+1. A refused fork is one `rlmill:` line.
"""

from __future__ import annotations

from flows.user_errors import UserError

FROM_HELP = ("start a NEW run from run RUN's committed checkpoint at iteration K (weights, optimizer, data position, "
             "RNG); it goes on at iteration K+1 with this command's config, its differences recorded in run.json")
FRESH_HELP = "with --from: take the parent's weights only; the optimizer's moments start fresh"


def add_fork_arguments(train) -> None:
    """--from and --fresh-optimizer on `rlmill train`'s parser."""
    train.add_argument("--from", dest="from_run", default=None, metavar="RUN@K", help=FROM_HELP)
    train.add_argument("--fresh-optimizer", action="store_true", help=FRESH_HELP)


def fork_plan(cfg, args):
    """The checked fork `args` asks for (None without --from); UserError, one line, otherwise."""
    from gpu_jobs.stages.fork import ForkError, parse_point, plan_fork

    if args.from_run is None:
        if args.fresh_optimizer:
            raise UserError("--fresh-optimizer goes with --from RUN@K (a fork); a run without --from starts "
                            "from the model with a fresh optimizer anyway")
        return None
    try:
        return plan_fork(cfg, parse_point(args.from_run), fresh_optimizer=args.fresh_optimizer)
    except ForkError as exc:
        raise UserError(str(exc)) from None


def make_fork(plan) -> None:
    """Write the checked fork (nothing for None, or a fork that already exists)."""
    from gpu_jobs.stages.fork import ForkError, materialize

    if plan is None:
        return
    try:
        materialize(plan)
    except ForkError as exc:
        raise UserError(str(exc)) from None

"""`rlmill feedback forget` and `rlmill feedback retain`: a party's data deleted on request, and
what is older than the retention removed.

    rlmill feedback forget --root s3://bucket/rl --user ann [--session s-9] [--principal acme] --reason "email"
    rlmill feedback retain --root s3://bucket/rl --older-than 30d [--dry-run]

The work is gpu_jobs/online/governance.py (forget, lineage), forget.py (the rewriting) and
retention.py; this module parses, refuses what a user can get wrong in one `rlmill:` line (no
party named, an empty id, an age that is not one, a broker that does not answer) and prints what
was done.
"""

from __future__ import annotations

import dataclasses

from flows.user_errors import UserError
from gpu_jobs.online.broker import DEFAULT_REDIS

__all__ = ["add_governance_parsers"]


def add_governance_parsers(fsub) -> None:
    """`forget` and `retain` under the `rlmill feedback` command parsers `fsub`."""
    from gpu_jobs.online.forget import PARTY_FIELDS
    from gpu_jobs.online.retention import RetentionPolicy

    forget = fsub.add_parser(
        "forget", help="delete a user's, session's or principal's answers and feedback everywhere",
        description="Delete every row of the party (any row whose user, session_id or principal is one of the ids "
                    "given) from the committed feedback segments and the quarantine (each segment holding some is "
                    "committed again without them, then the old one removed), from every retrain window's training "
                    "file, and from the event stream and its dead letters. The request is recorded create-only under "
                    "<root>/feedback/_forget/ with the versions already trained on their rows (rlmill models "
                    "lineage). After a crash, run the same command again: it finishes the same request.")
    forget.add_argument("--root", required=True, help="storage root (folder or s3://)")
    for row_field, _, flag, _ in PARTY_FIELDS:
        forget.add_argument(flag, dest=flag[2:], action="append", default=[], metavar="ID",
                            help=f"a `{row_field}` the requests carried (repeat for more)")
    forget.add_argument("--redis", default=DEFAULT_REDIS,
                        help=f"event broker URL whose stream and dead letters are cleaned too, or 'none' "
                             f"(default {DEFAULT_REDIS})")
    forget.add_argument("--reason", default=None, help="why (kept in the record)")
    forget.set_defaults(fn=cmd_feedback_forget)

    retain = fsub.add_parser(
        "retain", help="remove raw feedback, quarantine and dead letters older than the retention",
        description="Remove the hour folders of raw feedback events (<root>/feedback/<model>/<hour>/) and of "
                    "quarantined events whose whole hour is older than --older-than, and trim the dead-letter "
                    "stream to the same age. Folders an unfinished retrain window holds are kept and named. The "
                    "rl-retention/daily deployment runs this every day.")
    retain.add_argument("--root", required=True, help="storage root (folder or s3://)")
    default_age = dataclasses.fields(RetentionPolicy)[0]
    retain.add_argument("--older-than", required=True, metavar="AGE",
                        help=f"{default_age.metadata['help']}; e.g. 30d, 12h, 90m, 3600s (the deployment's default: "
                             f"{default_age.default / 86400:g}d)")
    retain.add_argument("--redis", default=DEFAULT_REDIS,
                        help=f"event broker URL whose dead letters are trimmed, or 'none' (default {DEFAULT_REDIS})")
    retain.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    retain.set_defaults(fn=cmd_feedback_retain)


def _broker(url: str) -> str | None:
    """The broker URL, None for 'none'; refuses one that does not answer, before anything changes."""
    if url.lower() == "none":
        return None
    from gpu_jobs.online.broker import BrokerUnreachable, connect, url_password_problem

    if (problem := url_password_problem(url, "--redis")) is not None:
        raise UserError(problem)
    try:
        connect(url)
    except BrokerUnreachable as exc:
        raise UserError(f"{exc}, or --redis none to leave the broker as it is") from None
    return url


def cmd_feedback_forget(args) -> None:
    import getpass

    from gpu_jobs.online.governance import Party, forget
    from storage.errors import InvalidNameError

    try:
        party = Party.of(args.user, args.session, args.principal)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    redis_url = _broker(args.redis)
    try:
        result = forget(args.root, party, requested_by=getpass.getuser(), reason=args.reason, redis_url=redis_url)
    except InvalidNameError as exc:
        raise UserError(str(exc)) from None
    request, who = result.request, ", ".join(repr(x) for x in party.labels)
    rows = ", ".join(f"{n} row(s) of {m}" for m, n in request.rows.items() if n) or "no rows on file"
    print(f"rlmill: {who} forgotten ({request.uri}): {rows} when asked; deleted {result.rows(False)} segment row(s) "
          f"in {sum('/_quarantine/' not in s.old for s in result.segments)} segment(s), {result.rows(True)} "
          f"quarantined row(s), {sum(result.derived.values())} training-file row(s), "
          + ("the broker left as it is" if redis_url is None else
             f"{result.stream} stream entr(ies) and {result.dead} dead letter(s)"), flush=True)
    for model, versions in request.versions.items():
        if versions:
            print(f"rlmill: versions of {model} already trained on their rows: {', '.join(versions)} "
                  "(retrain without them, or roll back: rlmill models rollback)", flush=True)


def cmd_feedback_retain(args) -> None:
    from gpu_jobs.online.retention import RetentionPolicy, retain
    from storage.errors import InvalidNameError

    try:
        policy = RetentionPolicy.parse(args.older_than)
    except ValueError as exc:
        raise UserError(f"--older-than: {exc}") from None
    redis_url = _broker(args.redis)
    try:
        r = retain(args.root, policy, redis_url=redis_url, dry_run=args.dry_run)
    except InvalidNameError as exc:
        raise UserError(str(exc)) from None
    verb = "would remove" if r.dry_run else "removed"
    for url in r.removed:
        print(f"rlmill: {verb} {url}", flush=True)
    for url, why in r.kept.items():
        print(f"rlmill: kept {url}: {why}", flush=True)
    dead = "" if r.dead_letters is None else f" and {r.dead_letters} dead letter(s)"
    print(f"rlmill: retention {args.older_than}: {verb} {len(r.removed)} hour folder(s){dead} older than "
          f"{_utc(r.cutoff)}" + (" (dry run: nothing removed)" if r.dry_run else ""), flush=True)


def _utc(ts: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

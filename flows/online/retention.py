"""Retention as a Prefect flow: `rl-retention`, deployed as 'rl-retention/daily' (deployments/prefect.yaml,
03:30 every day in RLMILL_NIGHTLY_TZ), removes raw feedback events, quarantined events and dead
letters older than `older_than` (gpu_jobs/online/retention.py), with what went -- or, with
dry_run, what would go -- as an artifact.

    prefect deployment run 'rl-retention/daily' -p root=s3://bucket/rl -p older_than=30d
    prefect deployment run 'rl-retention/daily' -p dry_run=true          # only say what would go
    rlmill feedback retain --root ROOT --older-than 30d [--dry-run]        # the same without Prefect

A broker that does not answer leaves the dead letters as they are and the run Completed, with a
warning in its log and artifact: the storage half does not wait for Redis, and the next day's run
trims what is still there. A wrong parameter (an age that is not one, a bad root) fails the run
with one line and the fix, before anything is removed.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from flows.reporting import artifact_key
from gpu_jobs.online.broker import DEFAULT_REDIS
from gpu_jobs.online.retention import RetentionPolicy, RetentionResult, retain

__all__ = ["DEPLOYMENT", "retention_markdown", "rl_retention"]

DEPLOYMENT = "rl-retention/daily"
_SHOWN = 100  # folders listed in the artifact at most (the count is always whole)


def retention_markdown(root: str, older_than: str, r: RetentionResult) -> str:
    """The run's artifact: what went (or would go), what was kept and why, the dead letters.

    >>> r = RetentionResult(0.0, False, ["/r/feedback/arith/2026-01-01-00"], {}, 3)
    >>> print(retention_markdown("/r", "30d", r).splitlines()[0])
    ## Retention 30d under `/r`: 1 hour folder(s) and 3 dead letter(s) removed
    """
    verb = "would be removed (dry run)" if r.dry_run else "removed"
    dead = "" if r.dead_letters is None else f" and {r.dead_letters} dead letter(s)"
    lines = [f"## Retention {older_than} under `{root}`: {len(r.removed)} hour folder(s){dead} {verb}", ""]
    lines += [f"- `{u}`" for u in r.removed[:_SHOWN]]
    if len(r.removed) > _SHOWN:
        lines.append(f"- ... and {len(r.removed) - _SHOWN} more")
    lines += [f"- kept `{u}`: {why}" for u, why in r.kept.items()]
    if r.broker_error:
        lines += ["", f"**Dead letters not trimmed:** {r.broker_error}"]
    return "\n".join(lines) + "\n"


@flow(name="rl-retention", log_prints=True)
def rl_retention(root: str = ".rlmill", older_than: str = "30d", redis_url: str | None = DEFAULT_REDIS,
                 dry_run: bool = False) -> dict[str, Any]:
    """Remove what is older than `older_than` (30d, 12h, ...) under `root` and in `redis_url`'s
    dead letters (None: storage only); `dry_run`: only say what would go."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.states import Failed

    from storage.errors import InvalidNameError

    from gpu_jobs.online.broker import url_password_problem

    try:
        if redis_url is not None and (problem := url_password_problem(redis_url, "redis_url")) is not None:
            raise ValueError(problem)
        policy = RetentionPolicy.parse(older_than)
        result = retain(root, policy, redis_url=redis_url, dry_run=dry_run)
    except (ValueError, InvalidNameError) as exc:
        line = f"older_than={older_than!r}, root={root!r}: {exc}"
        get_run_logger().error("rlmill: %s", line)
        return Failed(message=line)
    logger = get_run_logger()
    for url in result.removed:
        logger.info("%s %s", "would remove" if dry_run else "removed", url)
    if result.broker_error:
        logger.warning("rlmill: dead letters not trimmed: %s", result.broker_error)
    create_markdown_artifact(key=artifact_key("feedback", "retention"),
                             markdown=retention_markdown(root, older_than, result),
                             description=f"Retention {older_than}: {len(result.removed)} hour folder(s)")
    return {"removed": result.removed, "kept": result.kept, "dead_letters": result.dead_letters,
            "dry_run": dry_run, "cutoff": result.cutoff, "broker_error": result.broker_error}

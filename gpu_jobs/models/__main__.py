"""Build the three built-in models into the cache ahead of their first use.

    python -m gpu_jobs.models            # builds what is missing: the built-in policy, then the tool and
                                         # reward models side by side (each starts from the policy)
    python -m gpu_jobs.models --missing  # prints the missing ones, exit 1 when any is missing; builds nothing
    python -m gpu_jobs.models --only NAME   # builds that one (what the side-by-side builds run)

Every model is otherwise built on first use, by whichever run needs it; `make test` runs this
beside the test workers on a machine without the models (scripts/run_tests.sh), so the minutes
of building overlap tests that need no model instead of stalling the workers that do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _builds() -> list[tuple[str, object]]:
    """(cache folder name, build function) in dependency order: the tool and reward models
    start from the built-in policy's weights."""
    from gpu_jobs.models.reward_model import RewardModelRecipe, ensure_arith_reward_model, reward_model_folder
    from gpu_jobs.models.tiny import WarmupRecipe, ensure_builtin_model
    from gpu_jobs.models.tool_model import ToolRecipe, ensure_tool_model

    builtin = f"builtin-{WarmupRecipe().digest()}"
    return [(builtin, ensure_builtin_model),
            (f"builtin-tools-{ToolRecipe().digest()}", ensure_tool_model),
            (reward_model_folder(builtin, RewardModelRecipe()), ensure_arith_reward_model)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpu_jobs.models", description=__doc__.splitlines()[0])
    p.add_argument("--missing", action="store_true", help="list the models not built yet; build nothing")
    p.add_argument("--only", metavar="NAME", default=None, help="build this one (a cache folder name --missing prints)")
    args = p.parse_args(argv)
    from gpu_jobs.models.build import default_cache_dir

    root = default_cache_dir()
    builds = _builds()
    missing = [(name, build) for name, build in builds if not (Path(root) / name / "config.json").exists()]
    if args.missing:
        print("\n".join(name for name, _ in missing))
        return 1 if missing else 0
    if args.only is not None:
        known = dict(builds)
        if args.only not in known:
            p.error(f"--only {args.only!r} is none of {', '.join(known)}")
        known[args.only]()
        return 0
    names = [name for name, _ in missing]
    if names[:1] == [builds[0][0]]:  # the built-in policy first: the others start from its weights
        builds[0][1]()
        names = names[1:]
    return _side_by_side(names)


def _side_by_side(names: list[str]) -> int:
    """Build `names` at once, one process each: every build runs on one thread (build.one_thread_seeded),
    so on 2 cores the tool and reward models take the time of the longer one, not of both; each process
    is its own seeded build, so the weights are those of a build alone."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-m", "gpu_jobs.models", "--only", name]) for name in names]
    return max([proc.wait() for proc in procs], default=0)


if __name__ == "__main__":
    sys.exit(main())

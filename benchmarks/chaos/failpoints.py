"""Failpoints: run `rlmill` with a fault armed at one exact point of one iteration.

    RLMILL_FAILPOINT=before-commit:reward:2 RLMILL_FAILPOINT_MARKER=/tmp/m \\
        python -m benchmarks.chaos.failpoints train --config examples/grpo_arith.yaml ...

When the armed point is reached the process touches the marker file and then blocks, so the
chaos harness can SIGKILL it at exactly that point (a real kill of a real run, not an exception
the code could catch). The points are wrappers installed before the CLI starts; nothing in
rlmill itself knows about them.

  after-commit:<stage>:<k>    a stage's manifest is written (a stage boundary)
  before-commit:<stage>:<k>   the stage computed everything, nothing committed yet (mid-stage)
  before-manifest:<stage>:<k> shards written, the manifest not yet (mid-commit)
  after-train:update:<k>      the trainer applied update k in memory; no checkpoint, no manifest
  after-checkpoint:update:<k> checkpoint k published (LATEST moved), update k's manifest not yet
  in-flight:update:<k>        async (staleness 1): update k trained in memory and the stale rollout
                              of k+1 generated, neither committed: both held until the kill
  run:<moment>                after the last commit (flows/failpoints.py: final validation, report,
                              return, completed): the flow itself holds there, nothing is wrapped
"""

from __future__ import annotations

import os
import sys
import time

from flows.failpoints import POINTS, hold

KINDS = ("after-commit", "before-commit", "before-manifest", "after-train", "after-checkpoint", "in-flight")


def parse(spec: str) -> tuple[str, str, int]:
    """'after-commit:reward:2' -> ('after-commit', 'reward', 2); ValueError names the bad part."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] not in KINDS or not parts[2].isdigit():
        raise ValueError(f"failpoint {spec!r} is not <kind>:<stage>:<iteration> with kind in {KINDS}")
    return parts[0], parts[1], int(parts[2])


def _hit(marker: str) -> None:
    """Touch the marker and hold: until killed (the harness kills the whole process group now), or,
    with RLMILL_FAILPOINT_RELEASE set, until that file exists (a fault elsewhere, then go on)."""
    hold(marker)


def _stage_of(url: str) -> tuple[str, int] | None:
    """'.../iterations/3/reward' or '.../iterations/3/reward/_MANIFEST.json' -> ('reward', 3)."""
    parts = [p for p in url.split("/") if p]
    if parts and parts[-1] == "_MANIFEST.json":
        parts = parts[:-1]
    if len(parts) >= 3 and parts[-3] == "iterations" and parts[-2].isdigit():
        return parts[-1], int(parts[-2])
    return None


def install(spec: str, marker: str) -> None:
    """Wrap the one function the failpoint needs; every other call passes straight through.

    Stage boundaries are found where every stage commits: the commit shell's `write_table`
    (gpu_jobs.stages.shell) and the create-only manifest write inside it (storage.manifest)."""
    import gpu_jobs.stages.iteration as it
    import gpu_jobs.stages.shell as shell
    import storage.manifest as manifest

    if spec in POINTS:
        return  # the flow reaches it itself (flows.failpoints.reach)
    kind, stage, k = parse(spec)
    if kind == "in-flight":
        _install_in_flight(k, marker)
    elif kind in ("after-commit", "before-commit"):
        real_write = shell.write_table

        def write_table(dest, table, *a, **kw):
            armed = _stage_of(dest) == (stage, k)
            if armed and kind == "before-commit":
                _hit(marker)
            uri = real_write(dest, table, *a, **kw)
            if armed:
                _hit(marker)
            return uri

        shell.write_table = write_table
    elif kind == "before-manifest":
        real_create = manifest.create_only

        def create_only(fs, path, data, *, url=None):
            if _stage_of(path) == (stage, k):
                _hit(marker)
            return real_create(fs, path, data, url=url)

        manifest.create_only = create_only
    elif kind == "after-train":
        real_train = it.train_on

        def train_on(run, roles, kk, table, **kw):
            metrics = real_train(run, roles, kk, table, **kw)
            if kk == k:
                _hit(marker)
            return metrics

        it.train_on = train_on
    else:  # after-checkpoint
        real_save = it.save_checkpoint

        def save_checkpoint(run, roles, kk, metrics):
            real_save(run, roles, kk, metrics)
            if kk == k:
                _hit(marker)

        it.save_checkpoint = save_checkpoint


def _install_in_flight(k: int, marker: str) -> None:
    """Hold update k (after training, before its checkpoint or manifest) and the rollout of k+1
    (generated, before its commit) until both got there, then touch the marker: the kill lands
    while the two stages of one-step-off async are in flight together. Each waits for the other,
    so neither can finish first whatever the thread scheduling."""
    import threading

    import gpu_jobs.stages.iteration as it
    import gpu_jobs.stages.shell as shell

    trained, generated = threading.Event(), threading.Event()
    real_write, real_train = shell.write_table, it.train_on

    def write_table(dest, table, *a, **kw):
        if _stage_of(dest) == ("rollout", k + 1):
            generated.set()
            trained.wait()
            while True:  # until the SIGKILL: the rollout must not commit
                time.sleep(0.1)
        return real_write(dest, table, *a, **kw)

    def train_on(run, roles, kk, table, **kw):
        metrics = real_train(run, roles, kk, table, **kw)
        if kk == k:
            trained.set()
            generated.wait()
            _hit(marker)
        return metrics

    shell.write_table, it.train_on = write_table, train_on


def main(argv: list[str]) -> None:
    spec, marker = os.environ.get("RLMILL_FAILPOINT"), os.environ.get("RLMILL_FAILPOINT_MARKER")
    if spec:
        if not marker:
            sys.exit("RLMILL_FAILPOINT needs RLMILL_FAILPOINT_MARKER (the file to touch when it is hit)")
        install(spec, marker)
    from flows.cli import main as cli

    cli(argv)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Check a run's committed data end to end, like `git fsck`, and set damaged stages aside.

    rlmill verify --config run.yaml            # read back every committed table and checkpoint
    rlmill verify --config run.yaml --repair   # then set aside what can be recomputed

Every committed stage, and every checkpoint's trainer and critic state, is checked against its
manifest (size and sha256 of each file) by storage's one verifier. Damage found:
  - a stage of an iteration whose update has not committed yet (the iteration in flight) is
    *repairable*: its folder is copied to `<stage>.damaged-<utc time>`, then uncommitted, and the
    next `rlmill train` recomputes it from its committed inputs (stages are deterministic given
    them), so the run ends as if nothing had happened;
  - a damaged checkpoint needs nothing: restore falls back to an older one and replays updates;
  - anything else (a stage an already-committed update consumed) is reported, never rewritten.
Nothing is deleted: the damaged copy is kept next to the recomputed one for inspection.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from gpu_jobs.stages.run import last_committed
from storage import (INDEX_NAME, MANIFEST_NAME, CorruptShardError, NotCommittedError, RunLayout, committed, join,
                     url_to_fs, verify)
from storage.layout import DAMAGED_MARK


@dataclass
class Damage:
    what: str          # "iteration 3 advantages" or "checkpoint 2 trainer"
    url: str           # the damaged stage's folder or checkpoint's trainer/critic folder
    error: str
    action: str        # what rlmill does about it (or what the user must)
    repairable: bool = False


def _checkpoint_states(layout: RunLayout, k: int) -> list[tuple[str, str]]:
    """(name, folder URL) of checkpoint k's committed resume states: trainer, then critic."""
    folders = (("trainer", layout.trainer(k)), ("critic", join(layout.checkpoint(k), "critic")))
    return [(name, url) for name, url in folders if committed(url, layout.storage)]


def verify_run(layout: RunLayout) -> list[Damage]:
    """Everything damaged in the run's committed data; an empty list when it is intact."""
    in_flight = last_committed(layout, "update") + 1
    found = []
    for k, stage, uri in layout.committed_stages():
        try:
            verify(uri, layout.storage)
        except CorruptShardError as e:
            ok = k >= in_flight and stage != "commit"
            found.append(Damage(f"iteration {k} {stage}", layout.stage(k, stage), str(e),
                                "set aside; the next run recomputes it" if ok else
                                "consumed by a committed update: kept as is; resume from a checkpoint after it",
                                repairable=ok))
    base = layout.fork_base()  # a forked run's checkpoint there is all it has before its own iterations
    for k in range(1, (layout.latest_checkpoint() or 0) + 1):
        for name, url in _checkpoint_states(layout, k) + ([("policy", layout.policy(k))] if k == base else []):
            try:
                verify(url, layout.storage, name=INDEX_NAME if name == "policy" else MANIFEST_NAME)
            except (CorruptShardError, NotCommittedError) as e:  # not committed: only a fork point's policy
                found.append(Damage(f"checkpoint {k} {name}", url, str(e),
                                    "none needed: restore falls back to an older checkpoint and replays updates")
                             if k != base else Damage(f"fork point: checkpoint {k} {name}", url, str(e), _REFORK))
    if base and not committed(layout.trainer(base), layout.storage):
        found.append(Damage(f"fork point: checkpoint {base} trainer", layout.trainer(base), "not committed", _REFORK))
    return found


# A forked run restores from its fork point's checkpoint or not at all (gpu_jobs/stages/fork.py).
_REFORK = "the run cannot resume without it: fork the parent again (rlmill train --from RUN@K)"


def set_aside(layout: RunLayout, damage: Damage) -> str:
    """Copy a damaged stage folder aside, then uncommit it (manifest first); returns the copy's URL.

    Crash-safe in any order of failure: until the manifest is deleted the stage is still committed
    (and still damaged: run repair again); after, it is uncommitted and its leftover shards are
    orphans that `gc_uncommitted` removes.
    """
    if not damage.repairable:
        raise ValueError(f"{damage.what} cannot be recomputed: {damage.action}")
    fs, src = url_to_fs(damage.url, layout.storage)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    dest = f"{src}{DAMAGED_MARK}{stamp}"
    for path in fs.find(src):
        fs.copy(path, dest + path[len(src):])
    fs.rm(join(src, MANIFEST_NAME))  # the un-commit point
    for path in fs.find(src):
        fs.rm(path)
    return f"{damage.url}{DAMAGED_MARK}{stamp}"

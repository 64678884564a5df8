"""Check a run's committed data end to end, like `git fsck`, and set damaged stages aside.

    rlmill verify --config run.yaml            # read back every committed table and checkpoint
    rlmill verify --config run.yaml --repair   # then set aside what can be recomputed

Every committed stage table is read back against its manifest (size and sha256 of each shard),
and every trainer checkpoint against the checksums its save recorded. Damage found:
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
import json
import posixpath
from dataclasses import dataclass

from gpu_jobs.stages.context import last_committed
from storage import CorruptShardError, RunLayout, join, read_table, url_to_fs
from storage.tables import MANIFEST_NAME


@dataclass
class Damage:
    what: str          # "iteration 3 advantages" or "checkpoint 2"
    url: str           # the damaged stage's folder or checkpoint's trainer folder
    error: str
    action: str        # what rlmill does about it (or what the user must)
    repairable: bool = False


def _stage_folders(layout: RunLayout) -> list[tuple[int, str, str]]:
    """(k, stage, folder URL) of every committed stage, in iteration order."""
    fs, root = url_to_fs(join(layout.root, "iterations"), layout.storage)
    if not fs.exists(root):
        return []
    out = []
    for path in fs.find(root):
        parts = path[len(root.rstrip("/")) + 1:].split("/")
        if len(parts) == 3 and parts[2] == MANIFEST_NAME and parts[0].isdigit() and "." not in parts[1]:
            out.append((int(parts[0]), parts[1], join(layout.root, "iterations", parts[0], parts[1])))
    return sorted(out)


def _check_checkpoint(layout: RunLayout, k: int) -> str | None:
    """The damage of checkpoint k's trainer state, or None when every file matches its checksum."""
    import hashlib

    from gpu_jobs.train.checkpoint import STATE_FILE

    fs, root = url_to_fs(join(layout.trainer(k), "trainer"), layout.storage)
    state = json.loads(fs.cat_file(posixpath.join(root, STATE_FILE)))
    for rel, want in state.get("checksums", {}).items():
        try:
            data = fs.cat_file(posixpath.join(root, rel))
        except FileNotFoundError:
            return f"{rel} is missing"
        if len(data) != want["size"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
            return f"{rel} does not match its checksum"
    return None


def verify_run(layout: RunLayout) -> list[Damage]:
    """Everything damaged in the run's committed data; an empty list when it is intact."""
    from gpu_jobs.train.checkpoint import STATE_FILE

    in_flight = last_committed(layout, "update") + 1
    found = []
    for k, stage, url in _stage_folders(layout):
        try:
            read_table(url, storage=layout.storage)
        except CorruptShardError as e:
            ok = k >= in_flight and stage != "commit"
            found.append(Damage(f"iteration {k} {stage}", url, str(e),
                                "set aside; the next run recomputes it" if ok else
                                "consumed by a committed update: kept as is; resume from a checkpoint after it",
                                repairable=ok))
    latest = layout.latest_checkpoint() or 0
    for k in range(1, latest + 1):
        fs, path = url_to_fs(join(layout.trainer(k), "trainer", STATE_FILE), layout.storage)
        if fs.exists(path) and (err := _check_checkpoint(layout, k)):
            found.append(Damage(f"checkpoint {k}", layout.trainer(k), err,
                                "none needed: restore falls back to an older checkpoint and replays updates"))
    return found


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
    dest = f"{src}.damaged-{stamp}"
    for path in fs.find(src):
        fs.copy(path, dest + path[len(src):])
    fs.rm(posixpath.join(src, MANIFEST_NAME))  # the un-commit point
    for path in fs.find(src):
        fs.rm(path)
    return f"{damage.url}.damaged-{stamp}"

"""Where things live under a storage root (any URL `url_to_fs` accepts).

    runs/<run_id>/run.json                      frozen config, written once
    runs/<run_id>/iterations/<k>/<stage>/       _MANIFEST.json + part-*.parquet
    runs/<run_id>/checkpoints/<k>/policy/       HF folder (index.json written last)
    runs/<run_id>/checkpoints/<k>/trainer/      optimizer/engine state (_MANIFEST.json last)
    runs/<run_id>/checkpoints/LATEST            "<k>", written after the checkpoint
    models/<name>/versions/<v>/ , models/<name>/CURRENT
    models/<name>/history/<seq>.json            one record per move of CURRENT, created once

Names are checked so that no run id, stage or model name can escape its folder.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import operator
import re
from typing import Any

from .config import StorageConfig
from .errors import InvalidNameError
from .errors import ObjectExistsError
from .fs import join, read_pointer, url_to_fs, write_once, write_pointer

__all__ = ["RunLayout", "ModelLayout", "check_name", "check_root", "DAMAGED_MARK"]

# `rlmill verify --repair` copies a damaged stage folder to <stage>.damaged-<utc time>: a copy kept
# for inspection, never a stage of the run.
DAMAGED_MARK = ".damaged-"

# Letters, digits, '.', '_', '-'; must start with a letter or digit (so no '.', '..', hidden
# files or option-looking names) and is at most 128 characters.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

log = logging.getLogger("rlmill")


def check_name(name: Any, what: str = "name") -> str:
    """Return `name` if it is a safe single path segment, else raise InvalidNameError.

    >>> check_name("rollout", "stage")
    'rollout'
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidNameError(
            f"invalid {what} {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..' or '/'"
        )
    return name


def check_root(root_url: Any) -> str:
    """Return `root_url` if it can hold runs, else raise InvalidNameError.

    An empty root would put runs at `/runs/...` (join("", "runs") is "/runs"), and a control
    character (NUL, newline) is never part of a real folder or bucket name.
    """
    if not isinstance(root_url, str) or not root_url.strip() or any(ord(c) < 32 for c in root_url):
        raise InvalidNameError(f"invalid storage root {root_url!r}: use a folder, file://, memory:// or "
                               "s3://bucket/prefix URL without control characters")
    return root_url


def _check_index(k: Any, what: str = "iteration") -> int:
    # operator.index accepts numpy integers but not floats or strings ("3" would be a typo).
    try:
        value = operator.index(k) if not isinstance(k, bool) else -1
    except TypeError:
        value = -1
    if value < 0:
        raise InvalidNameError(f"invalid {what} {k!r}: use a non-negative int")
    return value


class RunLayout:
    """URLs of one run's files, plus the run.json and LATEST helpers.

    Example:
        >>> layout = RunLayout("s3://bucket/rl", "run-1")
        >>> layout.stage(3, "rollout")
        's3://bucket/rl/runs/run-1/iterations/3/rollout'
        >>> layout.policy(3), layout.latest
        ('s3://bucket/rl/runs/run-1/checkpoints/3/policy', 's3://bucket/rl/runs/run-1/checkpoints/LATEST')
    """

    def __init__(self, root_url: str, run_id: str, storage: StorageConfig | None = None):
        self.root_url = check_root(root_url)
        self.run_id = check_name(run_id, "run id")
        self.storage = storage
        self.root = join(root_url, "runs", self.run_id)
        self._fork_base: int | None = None  # read from run.json once it exists (it is written once)

    def __repr__(self) -> str:
        return f"RunLayout({self.root_url!r}, {self.run_id!r})"

    def fork_base(self) -> int:
        """The iteration of another run this run was forked at (run.json's `forked_from`, written
        by gpu_jobs/stages/fork.py): its own iterations start after it, its checkpoint there is a
        copy of the parent's. 0 for a run that was not forked or has no run.json yet. One read of
        run.json per layout, once it exists."""
        if self._fork_base is None:
            frozen = self.read_run_json()
            if frozen is None:
                return 0
            forked = frozen.get("forked_from") if isinstance(frozen, dict) else None
            self._fork_base = _check_index(forked.get("iteration", 0) if isinstance(forked, dict) else 0,
                                           "fork iteration")
        return self._fork_base

    @property
    def run_json(self) -> str:
        return join(self.root, "run.json")

    def iteration(self, k: int) -> str:
        return join(self.root, "iterations", str(_check_index(k)))

    def stage(self, k: int, stage: str) -> str:
        """Folder of stage `stage` of iteration `k` (write_table's dest_url)."""
        return join(self.iteration(k), check_name(stage, "stage name"))

    def checkpoint(self, k: int) -> str:
        """Folder holding iteration k's checkpoint: `policy/` and `trainer/` live inside it."""
        return join(self.root, "checkpoints", str(_check_index(k)))

    def policy(self, k: int) -> str:
        """HF folder of the policy weights saved after iteration k (save_checkpoint's dest_url)."""
        return join(self.checkpoint(k), "policy")

    def trainer(self, k: int) -> str:
        """Folder of the trainer/optimizer state saved after iteration k."""
        return join(self.checkpoint(k), "trainer")

    @property
    def latest(self) -> str:
        return join(self.root, "checkpoints", "LATEST")

    def committed_stages(self) -> list[tuple[int, str, str]]:
        """(k, stage, manifest URI) of every committed stage, in iteration order. A stage set aside
        by `rlmill verify --repair` (<stage>.damaged-<time>) is not one. Costs one recursive
        listing of iterations/ (every shard's name)."""
        from .manifest import MANIFEST_NAME

        base = join(self.root, "iterations")
        fs, root = url_to_fs(base, self.storage)
        if not fs.exists(root):
            return []
        out = []
        root = root.rstrip("/")
        for path in fs.find(root):
            parts = path[len(root) + 1:].split("/")
            if (len(parts) == 3 and parts[2] == MANIFEST_NAME and parts[0].isdigit()
                    and DAMAGED_MARK not in parts[1]):
                out.append((int(parts[0]), parts[1], join(base, *parts)))
        return sorted(out)

    def write_run_json(self, config: dict[str, Any]) -> str:
        """Freeze the run's config; raises ObjectExistsError if run.json already exists."""
        data = json.dumps(config, indent=2, sort_keys=True, default=str)
        return write_once(self.run_json, data, self.storage)

    def read_run_json(self) -> dict[str, Any] | None:
        fs, path = url_to_fs(self.run_json, self.storage)
        try:
            return json.loads(fs.cat_file(path))
        except FileNotFoundError:
            return None

    def set_latest(self, k: int) -> None:
        """Point LATEST at checkpoint k: call only after that checkpoint committed."""
        write_pointer(self.latest, str(_check_index(k)), self.storage)

    def latest_checkpoint(self) -> int | None:
        """The iteration LATEST points at, or None when no checkpoint was published."""
        text = read_pointer(self.latest, self.storage)
        return int(text) if text else None


class ModelLayout:
    """Promoted model versions: models/<name>/versions/<v>/ and the CURRENT pointer.

    Example:
        >>> m = ModelLayout("memory://rlmill-doc", "arith")
        >>> m.version("v1")
        'memory://rlmill-doc/models/arith/versions/v1'
        >>> m.promote("v1"); m.current_version()
        'v1'
    """

    def __init__(self, root_url: str, name: str, storage: StorageConfig | None = None):
        self.root_url = check_root(root_url)
        self.name = check_name(name, "model name")
        self.storage = storage
        self.root = join(root_url, "models", self.name)

    def __repr__(self) -> str:
        return f"ModelLayout({self.root_url!r}, {self.name!r})"

    def version(self, v: str) -> str:
        return join(self.root, "versions", check_name(str(v), "model version"))

    @property
    def current(self) -> str:
        return join(self.root, "CURRENT")

    def promote(self, v: str, *, by: str = "api", reason: str | None = None, user: str | None = None) -> None:
        """Point CURRENT at version v (the version folder must already be committed), then, when
        CURRENT named another version before, append a record of the move to history/ (see
        `record_move`; `by` says what moved it: "promote"/"rollback" from `rlmill models`,
        "nightly", "api" for any other caller).

        CURRENT is written first: a crash between the two writes leaves a move without its record,
        which `previous_version` still handles (it knows CURRENT moved when the last record does
        not end at it); the other order could leave a record of a move that never happened."""
        v = check_name(str(v), "model version")
        before = self.current_version()
        write_pointer(self.current, v, self.storage)
        if before != v:
            self.record_move(before, v, by=by, reason=reason, user=user)

    def current_version(self) -> str | None:
        return read_pointer(self.current, self.storage)

    def current_url(self) -> str | None:
        v = self.current_version()
        return self.version(v) if v else None

    # ------------------------------------------------------------------ versions and history
    def version_names(self) -> list[str]:
        """Names of the folders under versions/, committed or not, sorted by name (one listing)."""
        fs, path = url_to_fs(join(self.root, "versions"), self.storage)
        if not fs.exists(path):
            return []
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
        return sorted(n for n in names if _NAME_RE.fullmatch(n))

    @property
    def history_dir(self) -> str:
        return join(self.root, "history")

    def _history_paths(self) -> tuple[Any, list[tuple[int, str]]]:
        fs, path = url_to_fs(self.history_dir, self.storage)
        if not fs.exists(path):
            return fs, []
        out = []
        for p in fs.ls(path, detail=False):
            stem = p.rstrip("/").rsplit("/", 1)[-1].removesuffix(".json")
            if stem.isdigit():
                out.append((int(stem), p))
        return fs, sorted(out)

    def record_move(self, before: str | None, after: str, *, by: str, reason: str | None = None,
                    user: str | None = None) -> dict[str, Any]:
        """Append one record of CURRENT moving `before` -> `after` as history/<seq>.json; returns it.

        Each record is its own object, created once (create-only: os.link locally, If-None-Match
        on S3), so a crash or a racing writer never damages a committed record. The next seq is
        1 + the highest listed; two writers that pick the same one are told apart by the
        create-only write, and the loser takes the next. Costs one listing and one PUT."""
        if not isinstance(by, str) or not by.strip():
            raise ValueError(f"record_move: by={by!r}; say what moved CURRENT, e.g. 'promote'")
        fs, taken = self._history_paths()
        seq = taken[-1][0] + 1 if taken else 1
        while True:
            record = {"seq": seq, "by": by, "from": before, "to": after,
                      "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                      "reason": reason, "user": user}
            try:
                write_once(join(self.history_dir, f"{seq:08d}.json"), json.dumps(record, sort_keys=True), self.storage)
                return record
            except ObjectExistsError:
                seq += 1

    def history(self) -> list[dict[str, Any]]:
        """Every move of CURRENT on record, oldest first (one listing, then one GET per record,
        concurrent on S3). A record that does not parse is skipped with a warning: records are
        created whole, so one can only be a file someone else put there."""
        fs, taken = self._history_paths()
        if not taken:
            return []
        blobs = fs.cat([p for _, p in taken])
        out = []
        for seq, p in taken:
            try:
                record = json.loads(blobs[p])
                if not isinstance(record, dict) or not isinstance(record.get("to"), str):
                    raise ValueError("no 'to' version")
            except ValueError as exc:
                log.warning("skipping %s: not a history record (%s)", p, exc)
                continue
            out.append({**record, "seq": seq})
        return out

    @staticmethod
    def promotion_stack(history: list[dict[str, Any]]) -> list[str]:
        """The versions CURRENT went through, with what a rollback undid taken off: the last is
        the version CURRENT named at the last record, the one before it what a rollback returns to.

        A move pushes its target; a rollback to a version on the stack pops back to it (so two
        rollbacks in a row go two steps back, not back and forth); the first record's `from`
        (CURRENT before any record) is the bottom.

        >>> moves = [(None, "v1", "nightly"), ("v1", "v2", "nightly"), ("v2", "v3", "promote"),
        ...          ("v3", "v2", "rollback")]
        >>> ModelLayout.promotion_stack([{"from": f, "to": t, "by": b} for f, t, b in moves])
        ['v1', 'v2']
        """
        stack: list[str] = []
        for record in history:
            if not stack and record.get("from"):
                stack.append(record["from"])
            to = record["to"]
            if record.get("by") == "rollback" and to in stack:
                del stack[len(stack) - stack[::-1].index(to):]
            elif not stack or stack[-1] != to:
                stack.append(to)
        return stack

    def previous_version(self, history: list[dict[str, Any]] | None = None) -> str | None:
        """The version CURRENT named before the present one (what `rlmill models rollback`
        returns to), or None when nothing earlier is on record.

        When CURRENT is not where the last record left it (moved by a plain write, or a crash
        between the pointer and its record), the last recorded version is the one before it."""
        current = self.current_version()
        stack = self.promotion_stack(self.history() if history is None else history)
        if stack and stack[-1] != current:
            return stack[-1]
        return stack[-2] if len(stack) >= 2 else None

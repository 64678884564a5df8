"""Where things live under a storage root (any URL `url_to_fs` accepts).

    runs/<run_id>/run.json                      frozen config, written once
    runs/<run_id>/iterations/<k>/<stage>/       _MANIFEST.json + part-*.parquet
    runs/<run_id>/checkpoints/<k>/policy/       HF folder (index.json written last)
    runs/<run_id>/checkpoints/<k>/trainer/      optimizer/engine state (_MANIFEST.json last)
    runs/<run_id>/checkpoints/LATEST            "<k>", written after the checkpoint
    models/<name>/versions/<v>/ , models/<name>/CURRENT

Names are checked so that no run id, stage or model name can escape its folder.
"""

from __future__ import annotations

import json
import operator
import re
from typing import Any

from .config import StorageConfig
from .errors import InvalidNameError
from .fs import join, read_pointer, url_to_fs, write_once, write_pointer

__all__ = ["RunLayout", "ModelLayout", "check_name", "check_root", "DAMAGED_MARK"]

# `rlmill verify --repair` copies a damaged stage folder to <stage>.damaged-<utc time>: a copy kept
# for inspection, never a stage of the run.
DAMAGED_MARK = ".damaged-"

# Letters, digits, '.', '_', '-'; must start with a letter or digit (so no '.', '..', hidden
# files or option-looking names) and is at most 128 characters.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


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

    def __repr__(self) -> str:
        return f"RunLayout({self.root_url!r}, {self.run_id!r})"

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

    def promote(self, v: str) -> None:
        """Point CURRENT at version v (the version folder must already be committed)."""
        write_pointer(self.current, check_name(str(v), "model version"), self.storage)

    def current_version(self) -> str | None:
        return read_pointer(self.current, self.storage)

    def current_url(self) -> str | None:
        v = self.current_version()
        return self.version(v) if v else None

"""The nightly flow's own records: which new training files landed under a prefix, the state file
recording which of them a model has already trained on (models/<name>/nightly_state.json), and
which run a night trains as. Used by flows/nightly.py (and `rlmill models list`).

Example:
    >>> from storage import ModelLayout
    >>> import fsspec; fsspec.filesystem("memory").pipe("/rlmill-doc/in/a.parquet", b"123")
    >>> state = read_state(state_url(ModelLayout("memory://rlmill-doc", "arith")))
    >>> [f.rel for f in list_new_files("memory://rlmill-doc/in", state["processed"])]
    ['a.parquet']
    >>> pick_run_id("20260101", {"processed": {}, "history": []}, ["s3://in/a.parquet"], "memory://rlmill-doc")
    'nightly-20260101'

These are the flow's rules, not storage's: storage gives the bytes (a pointer file replaced
atomically, a listing) and the run layout; what a processed file is and how a night is named live
here.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from storage import ModelLayout, RunLayout, StorageConfig, join, read_pointer, url_to_fs, write_pointer

__all__ = ["NewFile", "list_new_files", "state_url", "read_state", "write_state", "record_success", "pick_run_id",
           "STATE_NAME", "HISTORY_KEPT"]

STATE_NAME = "nightly_state.json"
HISTORY_KEPT = 60  # nights remembered in the state file (the Prefect artifacts keep the rest)


@dataclass(frozen=True)
class NewFile:
    url: str
    rel: str  # path under the prefix: the key in state["processed"]
    size: int


def list_new_files(prefix: str, processed: dict[str, int], storage: StorageConfig | None = None) -> list[NewFile]:
    """Parquet files under `prefix` that are not in `processed` (or whose size changed), by path.

    Files are matched by name, not by modification time: object-store clocks and local clocks
    disagree, and a file re-uploaded under the same name with new content is new again.
    Hidden names ('.x', '_x') are skipped: write_prompts stages '.name.tmp-*' files. So is
    `test.parquet`: a folder made by `rlmill data make` holds a held-out split beside its
    training data, and held-out rows must never be trained on.
    """
    fs, root = url_to_fs(prefix, storage)
    if not fs.exists(root):
        return []
    root = root.rstrip("/")
    out = []
    for path, info in sorted(fs.find(root, detail=True).items()):
        rel = path[len(root):].lstrip("/")
        if not rel.endswith(".parquet") or any(p.startswith((".", "_")) for p in rel.split("/")):
            continue
        if rel.rsplit("/", 1)[-1] == "test.parquet":
            continue
        size = int(info.get("size") or 0)
        if processed.get(rel) != size:
            out.append(NewFile(join(prefix, rel), rel, size))
    return out


# ------------------------------------------------------------------------------------ state file
def state_url(models: ModelLayout) -> str:
    return join(models.root, STATE_NAME)


def read_state(url: str, storage: StorageConfig | None = None) -> dict[str, Any]:
    """The state file, or an empty state before the first successful night."""
    text = read_pointer(url, storage)
    state = json.loads(text) if text else {}
    state.setdefault("processed", {})
    state.setdefault("history", [])
    return state


def write_state(url: str, state: dict[str, Any], storage: StorageConfig | None = None) -> None:
    """Atomically replace the state (os.replace locally, one PUT on S3)."""
    state = {**state, "history": state["history"][-HISTORY_KEPT:]}
    write_pointer(url, json.dumps(state, indent=1, sort_keys=True), storage)


def record_success(url: str, state: dict[str, Any], new: list[NewFile], record: dict[str, Any],
                   storage: StorageConfig | None = None) -> None:
    """A night's last step: its files count as processed from now on, whatever the decision
    (retraining on them tomorrow would repeat tonight's run). A night that fails never gets here,
    so the next one sees the same files again."""
    record["finished_at"] = dt.datetime.now(dt.timezone.utc).isoformat()
    state["processed"].update({f.rel: f.size for f in new})
    state["history"].append(record)
    state["last_success"] = {"night": record["night"], "run_id": record["run_id"], "finished_at": record["finished_at"]}
    write_state(url, state, storage)


# ------------------------------------------------------------------------------------ run id
def pick_run_id(night: str, state: dict[str, Any], train_files: list[str], root: str,
                storage: StorageConfig | None = None) -> str:
    """nightly-<night>, or -2, -3 ... when that id already finished or trained on other files: the
    state file's history and the frozen run.json's `data.train_files` tell a failed night (same
    files: it keeps its id, so it resumes) from a finished one.
    """
    done = {h.get("run_id") for h in state["history"]}
    for n in range(1, 100):
        run_id = f"nightly-{night}" + (f"-{n}" if n > 1 else "")
        if run_id in done:
            continue
        frozen = RunLayout(root, run_id, storage).read_run_json()
        if frozen is None or frozen["config"]["data"]["train_files"] == train_files:
            return run_id
    raise RuntimeError(f"more than 99 nightly runs on {night}: clean up {root}/runs/nightly-{night}*")

"""Which run a night trains as: `nightly-<night>`, or `-2`, `-3` ... when that id is taken.

    >>> pick_run_id("20260101", {"processed": {}, "history": []}, ["s3://in/a.parquet"], "memory://rlmill-doc")
    'nightly-20260101'

Run naming is the nightly flow's rule, not storage's: it reads the state file's history and the
frozen run.json's `data.train_files` to tell a failed night to resume from a finished one.
"""

from __future__ import annotations

from typing import Any

from storage import RunLayout, StorageConfig

__all__ = ["pick_run_id"]


def pick_run_id(night: str, state: dict[str, Any], train_files: list[str], root: str,
                storage: StorageConfig | None = None) -> str:
    """nightly-<night>, or -2, -3 ... when that id already finished or trained on other files.

    A run that failed on this date with the same files keeps its id, so it resumes.
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

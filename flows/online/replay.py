"""Replay for retraining on arrival: beside a feedback window, rows from older windows
("feedback") and from the user's cold-start data ("cold_start", the files in
"cold_start_files"), each as a share of the window's rows, so an incremental update also sees what
it learnt before (the online loop's cold-start/online mix). Used by flows/online/retrain.py.

    replay = {"feedback": 0.2, "cold_start": 0.1, "cold_start_files": ["s3://bucket/data/train.parquet"]}
    check_replay(replay)             # None, or the one line that refuses it
    replay_counts(40, replay)        # {'feedback': 8, 'cold_start': 4}
"""

from __future__ import annotations

from typing import Any

from storage import ModelLayout, join, url_to_fs
from gpu_jobs.online.windows import Piece, Window, WindowLog, current_uris

__all__ = ["REPLAY_SOURCES", "check_replay", "replay_counts", "sample_rows", "older_rows", "cold_start_rows"]

REPLAY_SOURCES = ("feedback", "cold_start")


def check_replay(replay: Any) -> str | None:
    """Why `replay` cannot be used, as one line with the fix; None when it can.

    >>> check_replay({"feedback": 0.2}) is None, check_replay({"cold_start": 0.5})
    (True, "replay['cold_start'] needs replay['cold_start_files']: the cold-start data files (verl prompt files; preference files for a preference run)")
    """
    if replay is None:
        return None
    example = "e.g. {'feedback': 0.2, 'cold_start': 0.1, 'cold_start_files': ['s3://bucket/data/train.parquet']}"
    if not isinstance(replay, dict) or set(replay) - {*REPLAY_SOURCES, "cold_start_files"}:
        return (f"replay={replay!r}: give the rows replayed per window row for each source ({', '.join(REPLAY_SOURCES)}: "
                f"older windows' feedback, cold-start files), {example}")
    for k in REPLAY_SOURCES:
        v = replay.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 10:
            return f"replay[{k!r}]={v!r}: a share between 0 and 10 (rows replayed per window row)"
    files = replay.get("cold_start_files") or []
    if replay.get("cold_start") and not (isinstance(files, list) and files and all(isinstance(f, str) for f in files)):
        return ("replay['cold_start'] needs replay['cold_start_files']: the cold-start data files (verl prompt files; "
                "preference files for a preference run)")
    return None


def replay_counts(n_window: int, replay: dict[str, Any] | None) -> dict[str, int]:
    """Rows to replay per source for a window of `n_window` training rows.

    >>> replay_counts(40, {"feedback": 0.25, "cold_start": 0.1, "cold_start_files": ["a.parquet"]})
    {'feedback': 10, 'cold_start': 4}
    """
    return {k: int(round(n_window * float(replay[k]))) for k in REPLAY_SOURCES if (replay or {}).get(k)}


def sample_rows(rows: list[Any], k: int, seed: int) -> list[Any]:
    """`k` of `rows` without replacement, the same ones for the same seed (all of them when k >= len).

    >>> sample_rows([1, 2, 3], 5, 0), len(sample_rows(list(range(10)), 4, 7)), sample_rows([1, 2, 3, 4], 2, 1) == sample_rows([1, 2, 3, 4], 2, 1)
    ([1, 2, 3], 4, True)
    """
    import random

    return list(rows) if k >= len(rows) else random.Random(seed).sample(list(rows), k)



def older_rows(root: str, model: str, window: Window, storage: Any) -> list[dict[str, Any]]:
    """The training rows of every window before `window` (each with its own ratings)."""
    from gpu_jobs.online.dataset import training_rows

    uris = [u for w in WindowLog(ModelLayout(root, model, storage)).windows() if w.seq < window.seq for u in w.uris]
    if not uris:
        return []
    from gpu_jobs.online.consumer import FEEDBACK_DIR, segment_manifests

    pieces = [Piece(m.uri, aliases=tuple(m.extra.get("replaces", ())))  # a segment rewritten by a forget
              for m in segment_manifests(join(root, FEEDBACK_DIR, model), storage)]
    return training_rows(root, model, storage, feedback_from=current_uris(uris, pieces))


def cold_start_rows(files: list[str], preference: str | None, storage: Any) -> list[dict[str, Any]]:
    if preference is None:
        from storage.datasets import read_prompts

        return read_prompts(files, storage=storage).to_dict("records")
    import pyarrow.parquet as pq

    rows = []
    for url in files:
        fs, path = url_to_fs(url, storage)
        with fs.open(path, "rb") as f:
            rows += pq.read_table(f).to_pylist()
    return rows

"""Answers the server no longer holds in memory (a restart, an evicted id), found where they were
logged: the event stream, else the committed feedback log.

    recall = AnswerRecall(redis_url="redis://127.0.0.1:6379/0", root="s3://bucket/rl", model="arith")
    recall.find("chatcmpl-01a2...")     # KnownAnswer(...) or None

An answer id carries its creation time (answers.id_time), so neither place is scanned whole: in
the stream, the entries from a minute before that time to SCAN_AFTER_S after it (the event is
added once the answer is generated, or later when the broker was down), at most SCAN_MAX of them;
in storage, the segments of the two hour folders the consumer files it in (the hour of the
request's start, which is at most the id's time, and the hour before). The consumer trims
committed entries from the stream, so the two together cover the retention window.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from gpu_jobs.online.answers import KnownAnswer, id_time

__all__ = ["AnswerRecall", "SCAN_AFTER_S", "SCAN_MAX"]

log = logging.getLogger("rlmill.serve")

SCAN_BEFORE_S = 60.0
SCAN_AFTER_S = 900.0
SCAN_MAX = 20_000


@dataclass
class AnswerRecall:
    """Looks an answer up in the stream (`redis_url`, `stream`) and under `root` for `model`;
    either may be None (not looked in). Any failure of a store is logged and counts as not found."""

    redis_url: str | None
    root: str | None
    model: str
    stream: str = "rlmill:events"
    storage: Any = None
    event_key: bytes | None = None  # with serve's signing key, an entry it did not sign is not recalled

    def find(self, answer_id: str) -> KnownAnswer | None:
        born = id_time(answer_id)
        if born is None:
            return None
        for where in (self._in_stream, self._in_storage):
            try:
                if (found := where(answer_id, born)) is not None:
                    return found
            except Exception as exc:  # noqa: BLE001 -- a store that is down answers "not found"
                log.warning("rlmill serve: looking up answer %s in %s failed: %s", answer_id, where.__name__[4:],
                            " ".join(str(exc).split())[:200])
        return None

    def _in_stream(self, answer_id: str, born: float) -> KnownAnswer | None:
        if self.redis_url is None:
            return None
        from gpu_jobs.online.broker import connect
        from gpu_jobs.online.events import decode

        client = connect(self.redis_url, check=False)
        start, end = int((born - SCAN_BEFORE_S) * 1000), int((born + SCAN_AFTER_S) * 1000)
        for _, fields in client.xrange(self.stream, min=f"{max(0, start)}-0", max=f"{end}-0", count=SCAN_MAX):
            e = decode(fields, self.event_key)
            if isinstance(e, dict) and e.get("kind") == "answer" and e.get("answer_id") == answer_id \
                    and isinstance(e.get("choices"), list) and isinstance(e.get("created"), (int, float)):
                return KnownAnswer(answer_id, float(e["created"]), str(e["model"]), str(e["version"]),
                                   len(e["choices"]))
        return None

    def _in_storage(self, answer_id: str, born: float) -> KnownAnswer | None:
        if self.root is None:
            return None
        from gpu_jobs.online.consumer import FEEDBACK_DIR, hour_of, manifest_rows, segment_manifests
        from storage import check_name, join

        for hour in (hour_of(born), hour_of(born - 3600)):
            folder = join(self.root, FEEDBACK_DIR, check_name(self.model, "model name"), hour)
            for m in segment_manifests(folder, self.storage):
                if answer_id not in m.extra.get("answer_ids", ()):
                    continue
                files = [f for f in m.files if f.path.startswith("answers-")]
                rows = [r for r in manifest_rows(m, files, self.storage) if r["answer_id"] == answer_id]
                if rows:
                    return KnownAnswer(answer_id, float(rows[0]["created"]), rows[0]["model"], rows[0]["version"],
                                       len(rows))
        return None

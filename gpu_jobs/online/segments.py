"""The consumer's committed segments: their layout, their manifests, writing one, and the index
of the event and answer ids (and each answer's version) they hold.

    segment_manifests("s3://b/rl/feedback/arith/2026-12-07-23")   # committed manifests, oldest name first
    manifest_rows(manifest)                                         # their Parquet rows, verified on read
    index = CommittedIds(); index.folder(url).events                # what is committed there
    index.version_of(url, "chatcmpl-...")                           # the committed answer's version, or None

Layout: <root>/feedback/<model>/<yyyy-mm-dd-hh>/segment-<first event id>/ holds answers-*.parquet
(one row per choice) and feedback-*.parquet, published by a `_MANIFEST.json` (kind
"feedback-segment") whose extra lists the segment's event ids, answer ids and each answer's
version ("answer_versions"; segments written before it are read for it when asked). Quarantined
entries go to <root>/feedback/_quarantine/<yyyy-mm-dd-hh>/segment-<first stream id>/ (kind
"feedback-quarantine").
"""

from __future__ import annotations

import datetime as dt
import io
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FEEDBACK_DIR", "QUARANTINE_DIR", "QUARANTINE_KIND", "SEGMENT_KIND", "CommittedIds", "Folder", "Segment",
           "commit_segment", "hour_of", "manifest_rows", "segment_manifests"]

FEEDBACK_DIR = "feedback"
QUARANTINE_DIR = "_quarantine"  # not a valid model name (check_name), so it never collides with one
SEGMENT_KIND = "feedback-segment"
QUARANTINE_KIND = "feedback-quarantine"


@dataclass(frozen=True)
class Segment:
    """One segment, right after its manifest was committed (what `on_segment` receives)."""

    uri: str  # its _MANIFEST.json
    kind: str  # SEGMENT_KIND (answers + feedback of one model and hour) or QUARANTINE_KIND
    model: str | None  # None for a quarantine segment (its events may name no valid model)
    hour: str  # the yyyy-mm-dd-hh folder it is in
    answers: int = 0
    feedback: int = 0
    quarantined: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # quarantine reason -> count


def hour_of(ts: float) -> str:
    """The UTC hour folder name of a Unix time.

    >>> hour_of(0.0)
    '1970-01-01-00'
    """
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d-%H")


@dataclass
class Folder:
    """What the committed segments of one hour folder hold."""

    events: set[str] = field(default_factory=set)
    answers: set[str] = field(default_factory=set)
    versions: dict[str, str] = field(default_factory=dict)  # answer id -> the version that answered
    unversioned: list = field(default_factory=list)  # manifests older than "answer_versions": read if asked


class CommittedIds:
    """Event ids, answer ids and answer versions of committed segments, per hour folder, read from
    the manifests once per folder per process (then kept up to date by the consumer)."""

    def __init__(self, storage=None):
        self.storage = storage
        self._folders: dict[str, Folder] = {}

    def folder(self, url: str) -> Folder:
        if url not in self._folders:
            f = Folder()
            for m in segment_manifests(url, self.storage):
                f.events.update(m.extra.get("event_ids", ()))
                f.answers.update(m.extra.get("answer_ids", ()))
                if isinstance(m.extra.get("answer_versions"), dict):
                    f.versions.update(m.extra["answer_versions"])
                elif m.extra.get("answer_ids"):
                    f.unversioned.append(m)
            self._folders[url] = f
        return self._folders[url]

    def version_of(self, url: str, answer_id: str) -> str | None:
        """The version of committed answer `answer_id` in folder `url`, or None when it is not there."""
        f = self.folder(url)
        if answer_id not in f.answers:
            return None
        if answer_id not in f.versions and f.unversioned:  # old segments: their answers' rows, once
            for m in f.unversioned:
                files = [x for x in m.files if x.path.startswith("answers-")]
                f.versions.update({r["answer_id"]: r["version"] for r in manifest_rows(m, files, self.storage)})
            f.unversioned = []
        return f.versions.get(answer_id)


def segment_manifests(folder_url: str, storage=None) -> list:
    """The committed segment manifests under `folder_url` (recursively), oldest name first; one
    that a later segment `replaces` (rlmill feedback forget's rewrite, committed before the old
    folder is removed: gpu_jobs/online/forget.py) is left out, so no reader sees a row twice."""
    from storage import read_manifest, url_to_fs
    from storage.manifest import MANIFEST_NAME

    fs, path = url_to_fs(folder_url, storage)
    if not fs.exists(path):
        return []
    found = sorted(p for p in fs.find(path) if p.endswith("/" + MANIFEST_NAME) and "/segment-" in p)
    prefix = folder_url.rstrip("/")
    manifests = [read_manifest(prefix + p[len(path.rstrip("/")):], storage) for p in found]
    replaced = {_tail(u) for m in manifests for u in m.extra.get("replaces", ())}
    return [m for m in manifests if _tail(m.uri) not in replaced]


def _tail(uri: str) -> str:
    """<hour>/<segment>/_MANIFEST.json of a segment's URI: the same whatever spelling of the root."""
    return "/".join(uri.rsplit("/", 3)[-3:])


def manifest_rows(manifest, files=None, storage=None) -> list[dict]:
    """The rows of a committed manifest's Parquet `files` (default: all it lists), verified on read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from storage.manifest import read_files

    files = manifest.files if files is None else files
    return [r for data in read_files(manifest, files, storage=storage)
            for r in pq.read_table(pa.BufferReader(data), use_threads=False).to_pylist()]


def _parquet(table) -> bytes:
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(table, sink, use_dictionary=False)
    return sink.getvalue()


def commit_segment(dest: str, tables: dict[str, Any], kind: str, extra: dict, storage=None) -> str:
    """Write the tables under fresh names and commit them; an existing commit with the same
    event ids (a re-commit of the same batch) is returned as it is."""
    from storage import committed, read_manifest, write_files
    from storage import commit as commit_files
    from storage.errors import ManifestExistsError

    if (uri := committed(dest, storage)) is not None and _same_ids(read_manifest(uri, storage), extra):
        return uri
    attempt = uuid.uuid4().hex[:12]
    blobs = {f"{name}-{attempt}.parquet": _parquet(t) for name, t in tables.items()}
    rows = {f"{name}-{attempt}.parquet": t.num_rows for name, t in tables.items()}
    files = write_files(dest, blobs, storage, rows=rows)
    metrics = {name: t.num_rows for name, t in tables.items()}
    try:
        return commit_files(dest, files, kind=kind, metrics=metrics, extra=extra, storage=storage)
    except ManifestExistsError:
        uri = committed(dest, storage)
        if uri is not None and _same_ids(read_manifest(uri, storage), extra):
            return uri
        raise


def _same_ids(manifest, extra: dict) -> bool:
    return set(extra["event_ids"]) <= set(manifest.extra.get("event_ids", ()))

"""Deleting one party's rows: committed segments rewritten without them, derived training files
filtered, their stream and dead-letter entries deleted. The request and its records are
governance.py's (`rlmill feedback forget`); this module does the rewriting.

    party = Party.of(users=["ann"], sessions=["s-9"])
    party.matches({"user": "bob", "session_id": "s-9"})                  # True: one of its ids
    rewrite_segment(manifest, party, "f1a2b3c4")                          # SegmentRewrite, or None: none of theirs
    filter_derived(url, party, answer_ids, prompts)                       # rows dropped from one Parquet file
    forget_in_stream(client, "rlmill:events", party)                      # XDEL'd entry count (".. :dead" too)

A party is the union of its ids: a row is theirs when its `user`, `session_id` or `principal` is
one of them (PARTY_FIELDS, one registry for the CLI flags, the match and the labels).

Why a segment is rewritten the way it is (crash-safe, create-only):
- The new segment is committed through storage's primitive beside the old one, under
  `<old name>.forget-<request id>` (fresh file names, manifest last, create-only), so a crash before
  its manifest leaves the old segment whole, and one after it leaves both committed: the new
  manifest's `replaces` names the old one, every reader of segments
  (consumer.segment_manifests) leaves a replaced manifest out, and a retrain window that holds the
  old URI holds the new one (windows.Piece.aliases). Only then is the old folder removed.
- The new manifest keeps every event id of the old one (`event_ids`) and lists the removed ones in
  `forgotten_event_ids`: the consumer's committed-ids index still skips a redelivery of a
  forgotten event. Removed answers leave `answer_ids` (`forgotten_answer_ids`), so feedback on
  them is not taken as feedback on a logged answer.
- The new name is a function of the request, so running the request again finds its own commit
  and finishes the job (removing what is left of the old).

Quarantined and dead-lettered entries may not parse: they match on their fields when they are
JSON objects, and on the raw text otherwise (`"user": "ann"`, escaped or not).
"""

from __future__ import annotations

import io
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

__all__ = ["PARTY_FIELDS", "FORGET_MARK", "Party", "SegmentRewrite", "filter_derived", "forget_in_stream",
           "prompt_keys", "rewrite_segment", "successor_name"]

# (row field, Party attribute, CLI flag, label prefix) -- one registry for every place a party's ids are read.
PARTY_FIELDS = (("user", "users", "--user", ""), ("session_id", "sessions", "--session", "session:"),
                ("principal", "principals", "--principal", "principal:"))
FORGET_MARK = ".forget-"  # a rewritten segment's folder: <old name>.forget-<request id>
MAX_ID_CHARS = 128
_SCAN = 1000  # stream entries read per XRANGE


@dataclass(frozen=True)
class Party:
    """Whose rows are forgotten: any row carrying one of these users, sessions or principals."""

    users: frozenset[str] = frozenset()
    sessions: frozenset[str] = frozenset()
    principals: frozenset[str] = frozenset()

    @classmethod
    def of(cls, users: Iterable[str] = (), sessions: Iterable[str] = (), principals: Iterable[str] = ()) -> "Party":
        """The party of these ids; ValueError naming the flag of an empty or too long one, or none at all."""
        given = {"users": list(users or ()), "sessions": list(sessions or ()), "principals": list(principals or ())}
        for _, attr, flag, _ in PARTY_FIELDS:
            for v in given[attr]:
                if not isinstance(v, str) or not v.strip() or len(v) > MAX_ID_CHARS:
                    raise ValueError(f"{flag} {v!r}: give the id the requests carried (1-{MAX_ID_CHARS} characters)")
        if not any(given.values()):
            raise ValueError("say whose data to forget: --user, --session or --principal (one or more)")
        return cls(**{k: frozenset(v) for k, v in given.items()})

    def ids(self, attr: str) -> frozenset[str]:
        return getattr(self, attr)

    @property
    def labels(self) -> list[str]:
        """'ann', 'session:s-9', 'principal:acme': how lineage and messages name the party."""
        return [prefix + v for _, attr, _, prefix in PARTY_FIELDS for v in sorted(self.ids(attr))]

    def matches(self, row: Any) -> bool:
        """A row (or an event) is theirs: one of its party fields holds one of the ids."""
        if not isinstance(row, Mapping):
            return False
        return any(isinstance(row.get(f), str) and row.get(f) in self.ids(attr) for f, attr, _, _ in PARTY_FIELDS)

    def matches_text(self, text: str) -> bool:
        """Raw text (an entry that does not parse) names one of the ids in a party field."""
        return bool(self._pattern().search(text))

    def matches_entry(self, text: str) -> bool:
        """A stored entry: its JSON object's fields (the event's too, or a dead letter's event
        field), else its raw text."""
        try:
            body = json.loads(text)
        except (ValueError, RecursionError):
            body = None
        if isinstance(body, Mapping):
            inner = [body, body.get("event")] if isinstance(body.get("event"), Mapping) else [body]
            if any(self.matches(b) for b in inner):
                return True
        return self.matches_text(text)

    def _pattern(self) -> re.Pattern:
        alts = []
        for f, attr, _, _ in PARTY_FIELDS:
            for v in self.ids(attr):
                quoted = re.escape(json.dumps(v)[1:-1])
                alts.append(rf'{f}\\*"\s*:\s*\\*"{quoted}\\*"')
        return re.compile(r'\\*"(?:' + "|".join(alts) + ")")


# ------------------------------------------------------------------------------------ segments
@dataclass(frozen=True)
class SegmentRewrite:
    """One segment rewritten: the old manifest, the new one, what left."""

    old: str
    new: str
    rows: int  # the party's rows removed
    event_ids: list[str] = field(default_factory=list)
    answer_ids: list[str] = field(default_factory=list)


def successor_name(folder_name: str, request_id: str) -> str:
    """The rewritten segment's folder name.

    >>> successor_name("segment-evt-1.forget-aaaa", "bbbb")
    'segment-evt-1.forget-bbbb'
    """
    return folder_name.split(FORGET_MARK, 1)[0] + FORGET_MARK + request_id


def _table(data: bytes):
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(data), use_threads=False)


def _parquet(table) -> bytes:
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(table, sink, use_dictionary=False)
    return sink.getvalue()


def _row_matches(party: Party, row: Mapping, quarantine: bool) -> bool:
    if quarantine:  # the entry kept whole as JSON text: it may not parse
        return party.matches(row) or party.matches_entry(str(row.get("event") or ""))
    return party.matches(row)


def rewrite_segment(manifest, party: Party, request_id: str, storage: Any = None,
                    after_commit: Callable[[], None] | None = None) -> SegmentRewrite | None:
    """Commit `manifest`'s segment again without `party`'s rows and remove the old folder (see
    the module docstring); None when it holds none of their rows. Safe to run again;
    `after_commit` runs between the new commit and the old folder's removal (a test dies there)."""
    import pyarrow as pa

    from storage import committed, join, read_manifest, url_to_fs
    from storage.manifest import read_files

    from gpu_jobs.online.consumer import QUARANTINE_KIND

    quarantine = manifest.kind == QUARANTINE_KIND
    tables, gone, removed = {}, {"event_ids": [], "answer_ids": []}, 0
    for f, data in zip(manifest.files, read_files(manifest, storage=storage)):
        t = _table(data)
        rows = t.to_pylist()
        keep = [not _row_matches(party, r, quarantine) for r in rows]
        removed += keep.count(False)
        for r, k in zip(rows, keep):
            if not k:  # the keys the committed-ids index holds: a quarantined entry's is its stream id
                gone["event_ids"].append(f"stream:{r.get('stream_id')}" if quarantine else str(r.get("event_id")))
                if f.path.startswith("answers-") and r.get("answer_id"):
                    gone["answer_ids"].append(r["answer_id"])
        tables[f.path.rsplit("-", 1)[0]] = t.filter(pa.array(keep, pa.bool_()))
    if not gone["event_ids"]:
        return None
    gone = {k: sorted(set(v)) for k, v in gone.items()}  # an answer has a row per choice
    folder = manifest.folder
    dest = join(folder.rsplit("/", 1)[0], successor_name(folder.rsplit("/", 1)[-1], request_id))
    uri = committed(dest, storage) or _commit(dest, tables, manifest, gone, request_id, storage)
    read_manifest(uri, storage)  # the new one is there before the old one goes
    if after_commit is not None:
        after_commit()
    fs, path = url_to_fs(folder, storage)
    fs.rm(path, recursive=True)
    return SegmentRewrite(manifest.uri, uri, removed, gone["event_ids"], gone["answer_ids"])


def _commit(dest: str, tables: dict[str, Any], old, gone: dict[str, list[str]], request_id: str,
            storage: Any) -> str:
    from storage import commit, url_to_fs, write_files

    fs, path = url_to_fs(dest, storage)
    if fs.exists(path):  # files of an attempt that died before its manifest: this request's, never committed
        fs.rm(path, recursive=True)
    attempt = uuid.uuid4().hex[:12]
    blobs = {f"{name}-{attempt}.parquet": _parquet(t) for name, t in tables.items()}
    rows = {f"{name}-{attempt}.parquet": t.num_rows for name, t in tables.items()}
    files = write_files(dest, blobs, storage, rows=rows)
    answers = [a for a in old.extra.get("answer_ids", ()) if a not in set(gone["answer_ids"])]
    extra = {**old.extra, "answer_ids": answers, "forget_request": request_id,
             "replaces": [old.uri, *old.extra.get("replaces", ())],
             "forgotten_event_ids": sorted({*old.extra.get("forgotten_event_ids", ()), *gone["event_ids"]}),
             "forgotten_answer_ids": sorted({*old.extra.get("forgotten_answer_ids", ()), *gone["answer_ids"]})}
    metrics = {**old.metrics, **{name: t.num_rows for name, t in tables.items()}}
    return commit(dest, files, kind=old.kind, inputs=[old.uri], metrics=metrics, extra=extra, storage=storage)


# ------------------------------------------------------------------------------------ derived files
def _derived_matches(row: Mapping, party: Party, answer_ids: set[str], prompts: set[str]) -> bool:
    """A training-file row built from the party's rows: its answer is theirs, they rated it, or
    (a preference row carries no id) its prompt is one of their prompts."""
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), Mapping) else {}
    if extra.get("answer_id") in answer_ids:
        return True
    if set(extra.get("users") or ()) & party.users:
        return True
    return "prompt" in row and _canonical(row["prompt"]) in prompts


def _canonical(prompt: Any) -> str:
    """A prompt as one comparable text: chat messages (role, content) or a completion's text."""
    if isinstance(prompt, str):
        try:
            prompt = json.loads(prompt)
        except ValueError:
            pass
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        prompt = [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, Mapping) else m
                  for m in prompt]
    return json.dumps(prompt, sort_keys=True, default=str)


def prompt_keys(answer_rows: Iterable[Mapping]) -> set[str]:
    """The canonical prompts of answer rows (what a derived row's prompt is compared with)."""
    return {_canonical(r.get("prompt")) for r in answer_rows if r.get("prompt") is not None}


def filter_derived(url: str, party: Party, answer_ids: set[str], prompts: set[str], storage: Any = None) -> int:
    """Rewrite the plain Parquet file at `url` (a retrain window's training rows) without the
    rows built from `party`'s (replaced whole: readers see the old file or the new); returns the
    rows removed."""
    import pyarrow as pa

    from storage import url_to_fs
    from storage.fs import overwrite

    fs, path = url_to_fs(url, storage)
    table = _table(fs.cat_file(path))
    keep = [not _derived_matches(r, party, answer_ids, prompts) for r in table.to_pylist()]
    if all(keep):
        return 0
    overwrite(url, _parquet(table.filter(pa.array(keep, pa.bool_()))), storage)
    return keep.count(False)


# ------------------------------------------------------------------------------------ the broker
def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def forget_in_stream(client: Any, stream: str, party: Party) -> int:
    """XDEL every entry of `stream` that is the party's (its fields' JSON or raw text), and XACK
    them in each consumer group first, so none is delivered again as an empty entry. Returns how
    many were deleted."""
    import redis

    start, doomed = "-", []
    while True:
        rows = client.xrange(stream, min=start, count=_SCAN)
        for sid, fields in rows:
            values = [_text(v) for v in (fields or {}).values()]
            if any(party.matches_entry(v) for v in values) or party.matches_text(" ".join(values)):
                doomed.append(_text(sid))
        if len(rows) < _SCAN:
            break
        start = "(" + _text(rows[-1][0])
    if not doomed:
        return 0
    try:
        groups = [_text(g["name"]) for g in client.xinfo_groups(stream)]
    except redis.ResponseError:
        groups = []
    for group in groups:
        client.xack(stream, group, *doomed)
    return int(client.xdel(stream, *doomed))

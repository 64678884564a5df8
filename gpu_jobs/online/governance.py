"""What users' feedback trained, and forgetting a party: the records a data-protection request needs.

    forget(root, Party.of(users=["ann"]), requested_by="ops", redis_url="redis://127.0.0.1:6379/0")
    forget_requests(root)                  # [ForgetRequest(...)]: every request, with its done record
    forgotten_users(root)                  # {"ann"}: readers of segments drop their rows from then on
    lineage(root, "arith")                 # [VersionLineage(version="v3", windows=[...]), ...]

Forgetting deletes. `forget` first records the request (create-only,
`<root>/feedback/_forget/<utc time>-<id>.json`: whose rows, who asked, why, and -- read before anything
changes -- which retrain windows already hold their rows and the versions those trained), then:
1. the broker: their entries in the event stream and the dead-letter stream `<stream>:dead` are
   deleted (XDEL, acknowledged first), so the consumer commits none of them later;
2. derived files: each retrain window's training rows (models/<name>/retrain/<run id>/*.parquet)
   are rewritten without the rows built from theirs, trained or not;
3. the segments: every committed segment of every model and of the quarantine that holds their
   rows is committed again without them and the old one removed (gpu_jobs/online/forget.py: new
   segment first, then the old folder, so a crash never loses another party's row);
4. a done record `<same name>.done.json`: what was rewritten and removed.
A crash anywhere leaves the request without its done record; running the same forget again finds
it, redoes each step (every one is idempotent) and finishes. Rows that arrive after the request
(the party keeps using the service) are left out by every reader of segments
(gpu_jobs.online.dataset.read_segments) until the request is run again to delete them.

What no request can undo -- versions already trained on the party's rows -- the request names,
and `lineage` lists under each window (`forgotten_reached`).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from gpu_jobs.online.forget import PARTY_FIELDS, Party, SegmentRewrite, filter_derived, prompt_keys, rewrite_segment

__all__ = ["FORGET_DIR", "ForgetRequest", "ForgetResult", "Party", "VersionLineage", "WindowLineage", "forget",
           "forget_requests", "forget_user", "forgotten_users", "lineage", "trained_version"]

FORGET_DIR = "_forget"  # under <root>/feedback/; not a valid model name, so never a model's folder
_DONE = ".done.json"


@dataclass(frozen=True)
class ForgetRequest:
    id: str
    party: Party
    requested_at: str  # ISO 8601, UTC
    requested_by: str | None
    reason: str | None
    uri: str = ""
    rows: dict[str, int] = field(default_factory=dict)  # model -> the party's rows on file when asked
    reached: dict[str, dict[str, list]] = field(default_factory=dict)  # model -> {windows: [seq], versions: [v]}
    done: dict[str, Any] | None = None  # the done record; None: not finished (run the request again)

    @property
    def user(self) -> str | None:
        return min(self.party.users) if self.party.users else None

    @property
    def versions(self) -> dict[str, list[str]]:
        return {m: list(r.get("versions", ())) for m, r in self.reached.items()}


@dataclass
class ForgetResult:
    """What one `forget` did (this run; a resumed request counts what was left)."""

    request: ForgetRequest
    segments: list[SegmentRewrite] = field(default_factory=list)
    derived: dict[str, int] = field(default_factory=dict)  # training file -> rows removed
    stream: int = 0  # stream entries deleted
    dead: int = 0  # dead letters deleted

    def rows(self, quarantine: bool) -> int:
        return sum(s.rows for s in self.segments if ("/_quarantine/" in s.old) == quarantine)


@dataclass(frozen=True)
class WindowLineage:
    seq: int
    run_id: str
    decision: str | None
    segments: int
    feedback_rows: int
    users: int  # distinct voters whose feedback the window's segments hold now
    forgotten_reached: list[str]  # forgotten parties whose rows this window trained on (asked after it)


@dataclass(frozen=True)
class VersionLineage:
    version: str
    windows: list[WindowLineage]

    @property
    def forgotten_reached(self) -> list[str]:
        return sorted({u for w in self.windows for u in w.forgotten_reached})


# ------------------------------------------------------------------------------------ records
def _forget_dir(root: str) -> str:
    from gpu_jobs.online.consumer import FEEDBACK_DIR
    from storage import join

    return join(root, FEEDBACK_DIR, FORGET_DIR)


def _party_of(body: dict) -> Party:
    ids = {attr: body.get(attr) or () for _, attr, _, _ in PARTY_FIELDS}
    if body.get("user") and not ids["users"]:  # a record of the first format: one user
        ids["users"] = [body["user"]]
    return Party(**{k: frozenset(v) for k, v in ids.items()})


def forget_requests(root: str, storage: Any = None) -> list[ForgetRequest]:
    """Every recorded forget request with its done record (None: unfinished), oldest first."""
    from storage import url_to_fs

    fs, path = url_to_fs(_forget_dir(root), storage)
    if not fs.exists(path):
        return []
    names = sorted(p for p in fs.ls(path, detail=False) if p.endswith(".json"))
    done = {p[:-len(_DONE)]: json.loads(fs.cat_file(p)) for p in names if p.endswith(_DONE)}
    out = []
    for p in names:
        if p.endswith(_DONE):
            continue
        body = json.loads(fs.cat_file(p))
        out.append(ForgetRequest(body.get("id") or p.rsplit("-", 1)[-1][:-5], _party_of(body), body["requested_at"],
                                 body.get("requested_by"), body.get("reason"), p, body.get("rows") or {},
                                 body.get("reached") or {}, done.get(p[:-len(".json")])))
    return out


def forgotten_users(root: str, storage: Any = None) -> set[str]:
    return {u for r in forget_requests(root, storage) for u in r.party.users}


def _models(root: str, storage: Any) -> list[str]:
    """The models with committed feedback under `root`."""
    from gpu_jobs.online.consumer import FEEDBACK_DIR
    from storage import join, url_to_fs

    fs, path = url_to_fs(join(root, FEEDBACK_DIR), storage)
    if not fs.exists(path):
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)
                  if not p.rstrip("/").rsplit("/", 1)[-1].startswith("_") and fs.isdir(p))


def _live(root: str, folder: str, storage: Any) -> list:
    from gpu_jobs.online.consumer import FEEDBACK_DIR, segment_manifests
    from storage import join

    return segment_manifests(join(root, FEEDBACK_DIR, folder), storage)


def _rows(manifest, storage: Any) -> list[dict[str, Any]]:
    from gpu_jobs.online.consumer import manifest_rows

    return manifest_rows(manifest, storage=storage)


def _by_alias(manifests: list) -> dict[str, Any]:
    """Each segment URI a window may hold -> the live manifest that holds it now."""
    return {u: m for m in manifests for u in (m.uri, *m.extra.get("replaces", ()))}


def trained_version(done: dict[str, Any]) -> str | None:
    """The version a finished window's run made: the one it promoted, else -- it passed the gate
    and was published for a canary (flows.nightly.train_and_gate) -- its run id; None: refused.

    >>> trained_version({"decision": "promote", "promoted_version": None, "run_id": "retrain-a-w2", "canary": "c1"})
    'retrain-a-w2'
    """
    if done.get("promoted_version"):
        return str(done["promoted_version"])
    return str(done["run_id"]) if done.get("decision") == "promote" and done.get("run_id") else None


def _reached(root: str, model: str, party: Party, manifests: list, storage: Any) -> dict[str, list]:
    """The windows of `model` whose segments hold the party's rows, and the versions they promoted."""
    from storage.layout import ModelLayout

    from gpu_jobs.online.windows import WindowLog

    windows, done = WindowLog(ModelLayout(root, model, storage)).read()
    theirs = {m.uri for m in manifests if any(party.matches(r) for r in _rows(m, storage))}
    by_alias = _by_alias(manifests)
    seqs = [w.seq for w in windows if any(by_alias.get(u) is not None and by_alias[u].uri in theirs for u in w.uris)]
    versions = sorted({v for s in seqs if (v := trained_version(done.get(s, {}))) is not None})
    return {"windows": seqs, "versions": versions}


def _record(root: str, party: Party, requested_by: str | None, reason: str | None, storage: Any) -> ForgetRequest:
    """The request's record, written create-only before anything is deleted; an unfinished
    request for the same party is taken up again instead (its id names its rewrites)."""
    from storage import join, write_once

    for r in forget_requests(root, storage):
        if r.done is None and r.party == party:
            return r
    now = dt.datetime.now(dt.timezone.utc)
    rid = uuid.uuid4().hex[:8]
    rows, reached = {}, {}
    for model in _models(root, storage):
        manifests = _live(root, model, storage)
        rows[model] = sum(party.matches(r) for m in manifests for r in _rows(m, storage))
        reached[model] = _reached(root, model, party, manifests, storage)
    body = {"id": rid, "user": min(party.users) if party.users else None,
            **{attr: sorted(party.ids(attr)) for _, attr, _, _ in PARTY_FIELDS},
            "requested_at": now.isoformat(timespec="seconds"), "requested_by": requested_by, "reason": reason,
            "rows": rows, "reached": reached}
    uri = join(_forget_dir(root), f"{now.strftime('%Y%m%dT%H%M%S')}-{rid}.json")
    write_once(uri, json.dumps(body, sort_keys=True), storage)
    return ForgetRequest(rid, party, body["requested_at"], requested_by, reason, uri, rows, reached)


# ------------------------------------------------------------------------------------ forgetting
def forget(root: str, party: Party, *, requested_by: str | None = None, reason: str | None = None,
           redis_url: str | None = None, stream: str | None = None, storage: Any = None,
           between: Callable[[str], None] | None = None) -> ForgetResult:
    """Delete `party`'s rows everywhere under `root` and, with `redis_url`, in the broker's
    stream and dead letters (the steps of the module docstring); `between(step)` runs after each
    step (a test fails there). Running it again after a crash finishes the same request."""
    from storage import write_once
    from storage.layout import check_root

    from gpu_jobs.online.broker import STREAM

    check_root(root)
    request = _record(root, party, requested_by, reason, storage)
    result = ForgetResult(request)
    if redis_url is not None:
        result.stream, result.dead = _forget_in_broker(redis_url, stream or STREAM, party)
    _step(between, "broker")
    for model in _models(root, storage):
        result.derived.update(_forget_derived(root, model, party, storage))
    _step(between, "derived")
    for folder in [*_models(root, storage), _quarantine_dir()]:
        for m in _live(root, folder, storage):
            _remove_replaced(m, storage)  # a crash after a rewrite's commit, before its old folder went
            if (done := rewrite_segment(m, party, request.id, storage,
                                        after_commit=lambda: _step(between, "committed"))) is not None:
                result.segments.append(done)
                _step(between, "segment")
    done = {"finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "segments": {s.old: s.new for s in result.segments}, "rows": result.rows(False),
            "quarantined_rows": result.rows(True), "derived": result.derived, "stream": result.stream,
            "dead_letters": result.dead}
    write_once(request.uri[:-len(".json")] + _DONE, json.dumps(done, sort_keys=True), storage)
    return result


def forget_user(root: str, user: str, **kwargs: Any) -> ForgetResult:
    """`forget` of one user (the first form of the request)."""
    return forget(root, Party.of(users=[user]), **kwargs)


def _step(between: Callable[[str], None] | None, name: str) -> None:
    if between is not None:
        between(name)


def _quarantine_dir() -> str:
    from gpu_jobs.online.consumer import QUARANTINE_DIR

    return QUARANTINE_DIR


def _forget_in_broker(redis_url: str, stream: str, party: Party) -> tuple[int, int]:
    from gpu_jobs.online.broker import connect
    from gpu_jobs.online.deliveries import DEAD_SUFFIX
    from gpu_jobs.online.forget import forget_in_stream

    client = connect(redis_url)
    return forget_in_stream(client, stream, party), forget_in_stream(client, stream + DEAD_SUFFIX, party)


def _forget_derived(root: str, model: str, party: Party, storage: Any) -> dict[str, int]:
    """Every Parquet file under models/<model>/retrain/ without the rows built from the party's:
    their answers (ids from the segments still holding them and from earlier rewrites), their
    ratings, their prompts."""
    from storage import join, url_to_fs
    from storage.layout import ModelLayout

    fs, path = url_to_fs(join(ModelLayout(root, model, storage).root, "retrain"), storage)
    files = sorted(p for p in fs.find(path) if p.endswith(".parquet")) if fs.exists(path) else []
    if not files:
        return {}
    manifests = _live(root, model, storage)
    answers = [r for m in manifests for f in m.files if f.path.startswith("answers-")
               for r in _answer_rows(m, f, storage) if party.matches(r)]
    ids = {r["answer_id"] for r in answers} | {a for m in manifests for a in m.extra.get("forgotten_answer_ids", ())}
    prompts = prompt_keys(answers)
    out = {}
    for p in files:
        url = fs.unstrip_protocol(p) if "://" in root else p
        if (n := filter_derived(url, party, ids, prompts, storage)):
            out[url] = n
    return out


def _answer_rows(manifest, f, storage: Any) -> list[dict[str, Any]]:
    from gpu_jobs.online.consumer import manifest_rows

    return manifest_rows(manifest, [f], storage)


def _remove_replaced(manifest, storage: Any) -> None:
    from storage import url_to_fs

    for old in manifest.extra.get("replaces", ()):
        fs, path = url_to_fs(old.rsplit("/", 1)[0], storage)
        if fs.exists(path):
            fs.rm(path, recursive=True)


# ------------------------------------------------------------------------------------ lineage
def lineage(root: str, model: str, version: str | None = None, storage: Any = None) -> list[VersionLineage]:
    """For each version the retrain windows promoted or published for a canary (or `version` only): the windows it was
    trained on, their segments, feedback rows, distinct voters, and the forgotten parties whose
    rows they trained on (as each forget request recorded them). Oldest version first."""
    from storage.layout import ModelLayout

    from gpu_jobs.online.windows import WindowLog

    requests = forget_requests(root, storage)
    windows, done = WindowLog(ModelLayout(root, model, storage)).read()
    by_alias = _by_alias(_live(root, model, storage))
    by_version: dict[str, list[WindowLineage]] = {}
    for w in windows:
        record = done.get(w.seq, {})
        promoted = trained_version(record)
        if promoted is None or (version is not None and promoted != version):
            continue
        held = {by_alias[u].uri: by_alias[u] for u in w.uris if u in by_alias}  # gone: removed by retention
        rows = [r for m in held.values() for r in _rows(m, storage)]
        reached = {label for r in requests if w.seq in (r.reached.get(model) or {}).get("windows", ())
                   for label in r.party.labels}
        reached |= _legacy_reached(requests, w, rows)
        by_version.setdefault(str(promoted), []).append(WindowLineage(
            w.seq, w.run_id, record.get("decision"), len(w.uris), w.rows("feedback"), _voters(rows), sorted(reached)))
    return [VersionLineage(v, ws) for v, ws in by_version.items()]


def _voters(rows: list[dict[str, Any]]) -> int:
    from gpu_jobs.online.canary_stats import voter

    return len({who for r in rows if "score" in r and (who := voter(r)) is not None})


def _legacy_reached(requests: list[ForgetRequest], window, rows: list[dict[str, Any]]) -> set[str]:
    """Parties of requests recorded before forgetting deleted (no `reached`), read from the rows
    still on file: those asked after the window was opened."""
    opened = dt.datetime.fromisoformat(window.created_at) if window.created_at else None
    return {label for r in requests if not r.reached and any(r.party.matches(row) for row in rows)
            and (opened is None or dt.datetime.fromisoformat(r.requested_at) > opened) for label in r.party.labels}

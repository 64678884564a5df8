"""What users' feedback trained, and forgetting a user: the records a data-protection request needs.

    forget_user(root, "ann", requested_by="ops")      # ForgetRequest: ann's rows trained nothing from now on
    forgotten_users(root)                              # {"ann"}: every reader of feedback segments drops them
    lineage(root, "arith")                             # [VersionLineage(version="v3", windows=[...]), ...]

Committed feedback segments are immutable (create-only manifests), so forgetting is a record, not
an edit: `<root>/feedback/_forget/<utc time>-<id>.json`, written create-only, names the user. Every
reader of segments (gpu_jobs.online.dataset.read_segments: training rows, retrain windows, replay,
the feedback dataset, the canary's arms) leaves out the answers and feedback of a forgotten user,
so no window trained after the request sees them. The bytes stay in the segments until retention
removes the hour folders; what the request could not undo -- versions already trained on the
user's rows -- `forget_user` reports and `lineage` lists (`forgotten_reached`).

Lineage reads the retrain windows (gpu_jobs.online.windows): each window's done record names its run, its
segments and the version it promoted; the segments name their rows, their users and their times.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FORGET_DIR", "ForgetRequest", "VersionLineage", "WindowLineage", "forget_user", "forget_requests",
           "forgotten_users", "lineage"]

FORGET_DIR = "_forget"  # under <root>/feedback/; not a valid model name, so never a model's folder
MAX_USER_CHARS = 128


@dataclass(frozen=True)
class ForgetRequest:
    user: str
    requested_at: str  # ISO 8601, UTC
    requested_by: str | None
    reason: str | None
    uri: str = ""
    rows: dict[str, int] = field(default_factory=dict)  # model -> the user's answer and feedback rows on file
    reached: dict[str, list[str]] = field(default_factory=dict)  # model -> versions already trained on them


@dataclass(frozen=True)
class WindowLineage:
    seq: int
    run_id: str
    decision: str | None
    segments: int
    feedback_rows: int
    users: int  # distinct users (or principals) whose feedback the window holds
    forgotten_reached: list[str]  # forgotten users whose rows this window trained on (asked after it)


@dataclass(frozen=True)
class VersionLineage:
    version: str
    windows: list[WindowLineage]

    @property
    def forgotten_reached(self) -> list[str]:
        return sorted({u for w in self.windows for u in w.forgotten_reached})


def _forget_dir(root: str) -> str:
    from gpu_jobs.online.consumer import FEEDBACK_DIR
    from storage import join

    return join(root, FEEDBACK_DIR, FORGET_DIR)


def forget_requests(root: str, storage: Any = None) -> list[ForgetRequest]:
    """Every recorded forget request, oldest first."""
    from storage import url_to_fs

    fs, path = url_to_fs(_forget_dir(root), storage)
    if not fs.exists(path):
        return []
    out = []
    for p in sorted(fs.ls(path, detail=False)):
        if p.endswith(".json"):
            body = json.loads(fs.cat_file(p))
            out.append(ForgetRequest(body["user"], body["requested_at"], body.get("requested_by"),
                                     body.get("reason"), p))
    return out


def forgotten_users(root: str, storage: Any = None) -> set[str]:
    return {r.user for r in forget_requests(root, storage)}


def forget_user(root: str, user: str, *, requested_by: str | None = None, reason: str | None = None,
                storage: Any = None) -> ForgetRequest:
    """Record that `user`'s answers and feedback must train nothing from now on (create-only), and
    report what is on file of theirs and which versions already trained on it."""
    from storage import write_once

    if not isinstance(user, str) or not user.strip() or len(user) > MAX_USER_CHARS:
        raise ValueError(f"user {user!r}: give the user id the requests carried (1-{MAX_USER_CHARS} characters)")
    now = dt.datetime.now(dt.timezone.utc)
    body = {"user": user, "requested_at": now.isoformat(timespec="seconds"), "requested_by": requested_by,
            "reason": reason}
    from storage import join

    uri = join(_forget_dir(root), f"{now.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}.json")
    rows, reached = {}, {}
    for model in _models(root, storage):
        rows[model] = _user_rows(root, model, user, storage)
        reached[model] = sorted({v.version for v in lineage(root, model, storage=storage, extra_forgotten={user: now})
                                 if user in v.forgotten_reached})
    write_once(uri, json.dumps(body, sort_keys=True), storage)
    return ForgetRequest(user, body["requested_at"], requested_by, reason, uri, rows, reached)


def _models(root: str, storage: Any) -> list[str]:
    """The models with committed feedback under `root`."""
    from gpu_jobs.online.consumer import FEEDBACK_DIR
    from storage import join, url_to_fs

    fs, path = url_to_fs(join(root, FEEDBACK_DIR), storage)
    if not fs.exists(path):
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)
                  if not p.rstrip("/").rsplit("/", 1)[-1].startswith("_") and fs.isdir(p))


def _segment_rows(uri: str, storage: Any) -> list[dict[str, Any]]:
    """Answer and feedback rows of one committed segment (verified on read)."""
    from gpu_jobs.online.consumer import manifest_rows
    from storage import read_manifest

    return manifest_rows(read_manifest(uri, storage), storage=storage)


def _user_rows(root: str, model: str, user: str, storage: Any) -> int:
    from gpu_jobs.online.consumer import FEEDBACK_DIR, segment_manifests
    from storage import join

    return sum(1 for m in segment_manifests(join(root, FEEDBACK_DIR, model), storage)
               for r in _segment_rows(m.uri, storage) if r.get("user") == user)


def lineage(root: str, model: str, version: str | None = None, storage: Any = None,
            extra_forgotten: dict[str, dt.datetime] | None = None) -> list[VersionLineage]:
    """For each version the retrain windows promoted (or `version` only): the windows it was
    trained on, their segments, feedback rows, distinct users, and the forgotten users whose rows
    they trained on (a forget asked after the window was opened). Oldest version first."""
    from gpu_jobs.online.canary_stats import voter
    from storage.layout import ModelLayout
    from gpu_jobs.online.windows import WindowLog

    asked = {r.user: dt.datetime.fromisoformat(r.requested_at) for r in forget_requests(root, storage)}
    asked.update(extra_forgotten or {})
    windows, done = WindowLog(ModelLayout(root, model, storage)).read()
    by_version: dict[str, list[WindowLineage]] = {}
    for w in windows:
        record = done.get(w.seq, {})
        promoted = record.get("promoted_version")
        if promoted is None or (version is not None and promoted != version):
            continue
        opened = dt.datetime.fromisoformat(w.created_at) if w.created_at else None
        users: set[str] = set()
        reached: set[str] = set()
        for uri in w.uris:
            for r in _segment_rows(uri, storage):
                if "score" in r and (who := voter(r)) is not None:  # a feedback row and who gave it
                    users.add(who)
                if r.get("user") in asked and (opened is None or asked[r["user"]] > opened):
                    reached.add(r["user"])
        by_version.setdefault(str(promoted), []).append(WindowLineage(
            w.seq, w.run_id, record.get("decision"), len(w.uris), w.rows("feedback"), len(users), sorted(reached)))
    return [VersionLineage(v, ws) for v, ws in by_version.items()]


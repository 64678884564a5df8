"""The canary record: a candidate version takes a sticky share of live traffic until a stated test
promotes it or rolls it back.

    models = ModelLayout(root, "arith")
    c = start_canary(models, "retrain-arith-w3", share=0.1)   # CANARY names candidate and baseline (CURRENT)
    read_canary(models)                                        # the running Canary, or None
    c.routes_to_candidate("user:alice")                        # True for ~share of the ids, always the same ones
    end_canary(models, c, "rollback", {"n_candidate": 120, ...})   # the outcome record, committed once
    remove_canary(models, c)                                   # then CANARY goes
    read_outcome(models, c.id)                                 # what ended it, with its numbers

Layout: models/<name>/CANARY (JSON, one running canary at most) and models/<name>/canaries/<id>.json
(one outcome record per ended canary). Both are written create-only (storage's `write_once`:
os.link locally, If-None-Match on S3), as history records are: a second start while one runs is
refused, and two deciders racing on one canary write one outcome, the loser reads it. CANARY is
removed (one delete) only after its outcome is committed, so a crash between the two leaves an
outcome that the next decider finds and finishes, never a decision taken twice.

The split is a keyed hash of a request's voter (`routes_to_candidate`): HMAC-SHA256 with the
canary's secret of "<canary id>:<voter>", read as a number in [0, 1), below `share` ->
candidate. The voter is who the server counts the caller as (app.py: the API key's principal,
or "<principal>/<user>" for a key marked asserts_users), never a `user` a caller picks, so a
caller can neither choose its arm nor compute it: the secret (`canary_secret`) is
$RLMILL_CANARY_SECRET when set, else a random one generated with the canary and kept at
models/<name>/canary-keys/<id> (create-only), which the servers read and nothing serves: not
the record, /health, /metrics, the outcome or the decider's artifacts. A request with no voter
(a server without keys) gets an arm of its own, drawn per request. A server restart, or a
second server, routes every voter to the same arm, and the arms' numbers come from the
committed feedback log, so neither the split nor the counts live in a process.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import math
import os
import secrets
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from gpu_jobs.online.canary_stats import METHODS
from storage.errors import ObjectExistsError
from storage.fs import join, url_to_fs, write_once
from storage.layout import ModelLayout, check_name

__all__ = ["Canary", "CanaryPolicy", "CanaryRunning", "CANARY_NAME", "OUTCOMES_DIR", "SECRET_ENV", "canary_secret",
           "canary_url", "end_canary", "last_outcome", "read_canary", "read_outcome", "remove_canary", "start_canary",
           "split_point"]

CANARY_NAME = "CANARY"
OUTCOMES_DIR = "canaries"
SECRETS_DIR = "canary-keys"  # one routing secret per canary id; read by the servers, shown nowhere
SECRET_ENV = "RLMILL_CANARY_SECRET"  # set: one secret for every canary (servers that share no storage writes)
OUTCOMES = ("promote", "rollback")  # what the stated test decides; a person's end is "rollback" too
CANARY_METHODS = tuple(METHODS)  # the stated tests canary_stats.py registers


class CanaryRunning(ValueError):
    """A canary with another candidate runs already: one at a time per model."""


@dataclass(frozen=True)
class CanaryPolicy:
    """How much traffic a candidate gets and what the stated test needs (canary_stats.py).

    >>> CanaryPolicy(share=0.1).min_samples, CanaryPolicy(share=0.1).margin
    (100, 0.05)
    """

    share: float  # fraction of ids (users or sessions) routed to the candidate, in (0, 1)
    min_samples: int = 100  # distinct voters each arm needs before the test may decide (canary_stats.py)
    confidence: float = 0.95  # one-sided confidence of the interval on candidate - baseline
    margin: float = 0.05  # non-inferiority margin: candidate may be this much worse (mean score) and pass
    max_duration_s: float = 86400.0  # after this, the canary ends: promote if the test passes, else roll back
    # msprt: an always-valid sequential test that may decide at any look after min_samples and
    # rolls back once the candidate is shown worse; welch: a fixed-sample t-test at min_samples,
    # which promotes a bad candidate far above its rate when looked at on every segment
    # (canary_stats.METHODS; docs/guide/online.md has both measured)
    method: str = "msprt"

    def __post_init__(self):
        if (line := self.problem()) is not None:
            raise ValueError(line)

    def problem(self) -> str | None:
        """What is wrong with these settings, as one line with the fix; None when nothing is."""
        def num(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not num(self.share) or not 0 < self.share < 1:
            return f"canary share {self.share!r}: give the fraction of users sent to the candidate, 0 < share < 1"
        if isinstance(self.min_samples, bool) or not isinstance(self.min_samples, int) or self.min_samples < 2:
            return f"canary min_samples {self.min_samples!r}: give the rated answers each arm needs, an int >= 2"
        if not num(self.confidence) or not 0.5 <= self.confidence < 1:
            return f"canary confidence {self.confidence!r}: give a one-sided confidence in [0.5, 1), e.g. 0.95"
        if not num(self.margin) or not 0 <= self.margin < 1:
            return f"canary margin {self.margin!r}: give how much worse (mean score) still passes, 0 <= margin < 1"
        if not num(self.max_duration_s) or self.max_duration_s <= 0:
            return f"canary max_duration_s {self.max_duration_s!r}: give the seconds before it must end, > 0"
        if self.method not in CANARY_METHODS:
            return f"canary method {self.method!r}: give one of {', '.join(CANARY_METHODS)}"
        return None


@dataclass(frozen=True)
class Canary:
    """One running canary, as models/<name>/CANARY holds it."""

    id: str  # the salt of the split, and the name of its outcome record
    model: str
    candidate: str
    baseline: str  # CURRENT when it started
    share: float
    min_samples: int
    confidence: float
    margin: float
    max_duration_s: float
    started: str  # ISO time, UTC
    by: str = "api"  # what started it: "retrain", "nightly", "api"
    method: str = "welch"  # CanaryPolicy.method (records written before it existed are welch)

    @property
    def policy(self) -> CanaryPolicy:
        return CanaryPolicy(self.share, self.min_samples, self.confidence, self.margin, self.max_duration_s,
                            self.method)

    @property
    def started_ts(self) -> float:
        return dt.datetime.fromisoformat(self.started).timestamp()

    def routes_to_candidate(self, voter: str | None, secret: bytes) -> bool:
        """Whether a request of `voter` goes to the candidate: the same voter always the same arm;
        no voter (an anonymous caller) -> an arm drawn for this request alone."""
        point = secrets.randbits(64) / 2.0 ** 64 if voter is None else split_point(secret, self.id, voter)
        return point < self.share

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Canary":
        return cls(**json.loads(text))


def split_point(secret: bytes, canary_id: str, voter: str) -> float:
    """The voter's place in [0, 1): the first 8 bytes of HMAC-SHA256(secret, "<canary id>:<voter>")
    / 2**64. Without the secret nobody can tell a voter's arm; a new canary reshuffles who is in
    the candidate's share; the same one never does.

    >>> split_point(b"k" * 32, "c1", "web/alice") == split_point(b"k" * 32, "c1", "web/alice")
    True
    >>> split_point(b"k" * 32, "c1", "web/alice") != split_point(b"j" * 32, "c1", "web/alice")
    True
    """
    digest = hmac.new(secret, f"{canary_id}:{voter}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def _secret_url(models: ModelLayout, canary_id: str) -> str:
    return join(models.root, SECRETS_DIR, check_name(canary_id, "canary id"))


def canary_secret(models: ModelLayout, canary: "Canary") -> bytes:
    """The routing secret of `canary`: $RLMILL_CANARY_SECRET (at least 16 characters) when set,
    else models/<name>/canary-keys/<id>, created (create-only, 32 random bytes as hex) when the
    canary has none yet -- a canary started before secrets existed, or a racing first read: the
    loser reads the winner's."""
    if (env := os.environ.get(SECRET_ENV)) is not None:
        if len(env) < 16:
            raise ValueError(f"${SECRET_ENV} has {len(env)} characters: give at least 16 random ones "
                             "(`python -c 'import secrets; print(secrets.token_hex(32))'`), or unset it")
        return env.encode()
    fs, path = url_to_fs(_secret_url(models, canary.id), models.storage)
    try:
        return fs.cat_file(path).strip()
    except FileNotFoundError:
        pass
    try:
        write_once(_secret_url(models, canary.id), secrets.token_hex(32), models.storage)
    except ObjectExistsError:
        pass
    return fs.cat_file(path).strip()


def canary_url(models: ModelLayout) -> str:
    return join(models.root, CANARY_NAME)


def _outcome_url(models: ModelLayout, canary_id: str) -> str:
    return join(models.root, OUTCOMES_DIR, f"{check_name(canary_id, 'canary id')}.json")


def read_canary(models: ModelLayout) -> Canary | None:
    """The running canary of `models`, or None (one GET)."""
    fs, path = url_to_fs(canary_url(models), models.storage)
    try:
        return Canary.from_json(fs.cat_file(path))
    except FileNotFoundError:
        return None


def start_canary(models: ModelLayout, candidate: str, policy: CanaryPolicy, *, by: str = "api",
                 now: dt.datetime | None = None) -> Canary:
    """Start sending `policy.share` of ids to version `candidate`, against CURRENT; returns the record.

    The same candidate against the same baseline already running is returned as it is (a retried
    start); another one running raises CanaryRunning. ValueError when there is no CURRENT or the
    candidate is CURRENT. The caller has committed the candidate's version folder."""
    candidate = check_name(str(candidate), "model version")
    baseline = models.current_version()
    if baseline is None:
        raise ValueError(f"model {models.name!r} has no CURRENT version to compare a canary with: promote one first")
    if candidate == baseline:
        raise ValueError(f"{candidate} is CURRENT already: a canary compares another version with it")
    running = read_canary(models)
    if running is not None:
        if (running.candidate, running.baseline) == (candidate, baseline):
            return running
        raise CanaryRunning(f"a canary of {models.name!r} runs already ({running.candidate} against "
                            f"{running.baseline}, since {running.started}): wait for rl-canary to decide, or end it "
                            f"with `rlmill models rollback {models.name} --root {models.root_url}`")
    now = now or dt.datetime.now(dt.timezone.utc)
    record = Canary(id=f"{candidate}-{uuid.uuid4().hex[:8]}", model=models.name, candidate=candidate,
                    baseline=baseline, share=policy.share, min_samples=policy.min_samples,
                    confidence=policy.confidence, margin=policy.margin, max_duration_s=policy.max_duration_s,
                    started=now.isoformat(timespec="seconds"), by=by, method=policy.method)
    try:
        write_once(canary_url(models), record.to_json(), models.storage)
    except ObjectExistsError:  # a racing start: whoever won is the canary
        return start_canary(models, candidate, policy, by=by, now=now)
    canary_secret(models, record)  # the routing secret, before any server reads the record
    return record


def end_canary(models: ModelLayout, canary: Canary, outcome: str, numbers: dict[str, Any],
               by: str = "rl-canary") -> dict[str, Any]:
    """Commit the outcome of `canary` (models/<name>/canaries/<id>.json, create-only); returns the
    outcome record -- the one already committed when another decider got there first (its
    decision stands, whatever `outcome` says here). The caller then applies it (moves CURRENT on a
    promote) and calls remove_canary (flows/online/canary.py)."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome {outcome!r}: one of {', '.join(OUTCOMES)}")
    record = {"canary": asdict(canary), "outcome": outcome, "by": by, "numbers": numbers,
              "ended": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    try:
        write_once(_outcome_url(models, canary.id), json.dumps(record, sort_keys=True, default=str), models.storage)
    except ObjectExistsError:
        record = read_outcome(models, canary.id) or record
    return record


def remove_canary(models: ModelLayout, canary: Canary) -> bool:
    """Remove CANARY if it still holds `canary` (its outcome committed first: end_canary); returns
    whether it did. Another canary started since is left alone."""
    running = read_canary(models)
    if running is None or running.id != canary.id:
        return False
    fs, path = url_to_fs(canary_url(models), models.storage)
    try:
        fs.rm_file(path)
    except FileNotFoundError:  # a racing decider removed it
        return False
    return True


def read_outcome(models: ModelLayout, canary_id: str) -> dict[str, Any] | None:
    """The committed outcome of canary `canary_id`, or None while it has none."""
    fs, path = url_to_fs(_outcome_url(models, canary_id), models.storage)
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None


def last_outcome(models: ModelLayout) -> dict[str, Any] | None:
    """The most recently ended canary's outcome record (by its `ended` time), or None."""
    fs, path = url_to_fs(join(models.root, OUTCOMES_DIR), models.storage)
    if not fs.exists(path):
        return None
    found = [p for p in fs.ls(path, detail=False) if p.endswith(".json")]
    records = [json.loads(blob) for blob in fs.cat(found).values()] if found else []
    return max(records, key=lambda r: r.get("ended", ""), default=None)

"""API keys: who is calling (`principal`), what they may do (roles), and whether they vouch for
their own users (`asserts_users`), from a keys file.

    >>> keys = ApiKeys.parse({"sk-Zt4q9LmW2xVb7RkP1cYh8NfJ": {"principal": "alice", "roles": ["query", "feedback"]}})
    >>> alice = keys.lookup("sk-Zt4q9LmW2xVb7RkP1cYh8NfJ")
    >>> alice.name, sorted(alice.roles), alice.asserts_users, keys.lookup("sk-wrong")
    ('alice', ['feedback', 'query'], False, None)

The file (`rlmill serve --api-keys FILE`, or the path in $RLMILL_API_KEYS) is YAML or JSON: a
mapping from each key -- or `sha256:<its hex digest>`, so the file need not hold the key itself
-- to its principal and roles; several keys may name one principal (rotation):

    sha256:3f0c...9a1e: {principal: chat-frontend, roles: [query, feedback], asserts_users: true}
    sk-Zt4q9LmW2xVb7RkP1cYh8NfJ...: {principal: grafana, roles: [metrics]}

Roles: `query` (POST /v1/completions, /v1/chat/completions, GET /v1/models), `feedback`
(POST /v1/feedback), `metrics` (GET /metrics, and the canary's details on /health). GET /health
needs no key. `asserts_users: true` marks a frontend that authenticates its own users: the
`user` it sends names one of them, and each is a voter of its own ("<principal>/<user>"); any
other key is one voter, its principal, whatever `user` it sends (app.py, canary_stats.py).
Every key of one principal must agree on it.

Refused at load, with the fix: a file that group or others may read or write (chmod 600), a key
shorter than MIN_KEY_CHARS, with fewer than MIN_DISTINCT_CHARS distinct characters or a run of
RUN_CHARS consecutive characters ("01234567", "abcdefgh": a placeholder, not a secret), and the
docs' example keys (as keys or as digests). Clients send the key as the OpenAI clients do,
`Authorization: Bearer <key>`. Keys are kept only as SHA-256 digests and a token is compared
against every one of them with hmac.compare_digest, so the time a lookup takes says nothing
about which key, or how much of one, was guessed. Events record the principal, never the key.

    python -m gpu_jobs.online.auth chat-frontend query feedback --asserts-users --key-out frontend.key >> keys.yaml
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["ROLES", "ApiKeys", "ApiKeysError", "Principal", "new_key_line", "request_voter", "role_of", "weakness"]

ROLES = ("query", "feedback", "metrics")
MIN_KEY_CHARS = 24  # shorter is guessable; refused at load
MIN_DISTINCT_CHARS = 10
RUN_CHARS = 8  # this many consecutive characters in a row ("01234567") is a placeholder
PRINCIPAL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$")  # it lands in every event: a plain name
DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
# The keys docs/guide/serving.md once showed: copied as they are, anyone who read the page holds them.
EXAMPLE_KEYS = ("sk-frontend-0123456789abcdef0123456789abcdef", "sk-grafana-0123456789abcdef0123456789abcdef")
NEW_KEY = "python -m gpu_jobs.online.auth <principal> <roles...> --key-out <file> >> <keys file>"

# The role each path needs; any other path (an unknown route) needs a valid key with any role.
_ROLE_OF = {"/v1/completions": "query", "/v1/chat/completions": "query", "/v1/models": "query",
            "/v1/feedback": "feedback", "/metrics": "metrics"}
OPEN_PATHS = ("/health",)


def role_of(path: str) -> str | None:
    """The role `path` needs (None: any valid key).

    >>> role_of("/v1/chat/completions"), role_of("/v1/feedback"), role_of("/nope")
    ('query', 'feedback', None)
    """
    return _ROLE_OF.get(path.rstrip("/") or "/")


class ApiKeysError(ValueError):
    """A keys file that cannot be used; the message names the entry (by position, never the key)."""


@dataclass(frozen=True)
class Principal:
    name: str
    roles: frozenset[str]
    asserts_users: bool = False  # a frontend that authenticates its users: each `user` it names is a voter


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def weakness(key: str) -> str | None:
    """Why `key` is too weak to be an API key, or None.

    >>> weakness("sk-alice-0123456789abcdef"), weakness("sk-Zt4q9LmW2xVb7RkP1cYh8NfJ") is None
    ('it has a run of 8 consecutive characters (a placeholder, not a secret)', True)
    """
    if key in EXAMPLE_KEYS:
        return "it is an example key from the docs (anyone who read them holds it)"
    if len(key) < MIN_KEY_CHARS:
        return f"it has {len(key)} characters, fewer than {MIN_KEY_CHARS}"
    if len(set(key)) < MIN_DISTINCT_CHARS:
        return f"it has {len(set(key))} distinct characters, fewer than {MIN_DISTINCT_CHARS}"
    run = 1
    for a, b in zip(key, key[1:]):
        run = run + 1 if ord(b) == ord(a) + 1 else 1
        if run >= RUN_CHARS:
            return f"it has a run of {RUN_CHARS} consecutive characters (a placeholder, not a secret)"
    return None


_EXAMPLE_DIGESTS = frozenset(_digest(k) for k in EXAMPLE_KEYS)


def _entry_digest(key: Any, what: str) -> bytes:
    """The digest an entry's key (or its `sha256:<hex>`) stands for; ApiKeysError when unusable."""
    fix = f"generate one with `{NEW_KEY}`"
    if not isinstance(key, str) or key != key.strip():
        raise ApiKeysError(f"{what}: a key must be a string without surrounding spaces; {fix}")
    if key.startswith("sha256:"):
        if (m := DIGEST.match(key)) is None:
            raise ApiKeysError(f"{what}: a digest is `sha256:` and 64 lowercase hex digits (`printf %s \"$KEY\" | "
                               "sha256sum`)")
        digest = bytes.fromhex(m.group(1))
        if digest in _EXAMPLE_DIGESTS:
            raise ApiKeysError(f"{what}: the digest of an example key from the docs (anyone who read them holds "
                               f"it); {fix}")
        return digest
    if (why := weakness(key)) is not None:
        raise ApiKeysError(f"{what}: this key is refused: {why}; {fix}")
    return _digest(key)


def _principal(spec: Any, what: str) -> Principal:
    if not isinstance(spec, dict) or set(spec) - {"principal", "roles", "asserts_users"}:
        raise ApiKeysError(f"{what}: give {{principal: <name>, roles: [...]}} (and optionally asserts_users: true) "
                           "and nothing else")
    name, roles, asserts = spec.get("principal"), spec.get("roles"), spec.get("asserts_users", False)
    if not isinstance(name, str) or not PRINCIPAL.match(name):
        raise ApiKeysError(f"{what}: principal {name!r} must be 1-128 letters, digits or ._@:- "
                           "(it is written into every event)")
    if not isinstance(roles, list) or not roles or any(r not in ROLES for r in roles):
        raise ApiKeysError(f"{what} ({name}): roles {roles!r} must be a non-empty list of {', '.join(ROLES)}")
    if not isinstance(asserts, bool):
        raise ApiKeysError(f"{what} ({name}): asserts_users {asserts!r} must be true or false")
    return Principal(name, frozenset(roles), asserts)


class ApiKeys:
    """Key digests -> principals; see the module docstring."""

    def __init__(self, entries: list[tuple[bytes, Principal]]):
        if not entries:
            raise ApiKeysError("the keys file names no key: add `<key>: {principal: <name>, roles: [query]}`")
        vouching: dict[str, bool] = {}
        for _, p in entries:
            if vouching.setdefault(p.name, p.asserts_users) != p.asserts_users:
                raise ApiKeysError(f"the keys of principal {p.name!r} disagree on asserts_users: give every one "
                                   "of them the same value")
        self._entries, self._vouching = entries, vouching

    @classmethod
    def parse(cls, data: Any, where: str = "the keys file") -> "ApiKeys":
        """Keys from the parsed file (a mapping key or sha256:<hex> -> {principal, roles[, asserts_users]})."""
        if not isinstance(data, dict):
            raise ApiKeysError(f"{where} must be a mapping of each key to {{principal, roles}}, "
                               f"not a {type(data).__name__}")
        entries = []
        for i, (key, spec) in enumerate(data.items(), 1):
            what = f"{where}, entry {i}"
            entries.append((_entry_digest(key, what), _principal(spec, what)))
        return cls(entries)

    @classmethod
    def from_file(cls, path: str) -> "ApiKeys":
        """Keys from a YAML or JSON file (JSON is YAML) that only its owner may read."""
        import os
        import stat

        import yaml

        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
            if mode & 0o077:
                raise ApiKeysError(f"the keys file {path} may be read or written by group or others (mode "
                                   f"{mode:04o}): `chmod 600 {path}`")
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as exc:
            raise ApiKeysError(f"cannot read the keys file {path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" (line {where.line + 1})" if where is not None else ""
            raise ApiKeysError(f"the keys file {path} is not valid YAML or JSON{at}") from None
        return cls.parse(data, f"the keys file {path}")

    def lookup(self, token: str) -> Principal | None:
        """The principal of `token`, or None; compares against every key (constant time in the
        token's content: the loop never stops early)."""
        digest, found = _digest(token), None
        for key_digest, principal in self._entries:
            if hmac.compare_digest(digest, key_digest):
                found = principal
        return found

    def asserts_users(self, name: str | None) -> bool:
        """Whether principal `name`'s keys are marked asserts_users (False for None or unknown)."""
        return self._vouching.get(name or "", False)

    def principals(self) -> list[str]:
        return sorted({p.name for _, p in self._entries})

    def __len__(self) -> int:
        return len(self._entries)


MAX_USER_CHARS = 128  # a vouched-for user's name at most (the voter "<principal>/<user>" lands in every event)


def request_voter(keys: "ApiKeys | None", principal: str | None, user: str | None) -> str | None:
    """Who the server counts a request as (its canary arm and its vote, canary_stats.py): without
    keys nobody (None: anonymous); a key marked asserts_users that names a `user`,
    "<principal>/<user>"; any other key, its principal, whatever `user` it sends. ValueError (a
    ParamError, 400 naming `user`) for a vouched-for user that cannot be a voter's name.

    >>> keys = ApiKeys.parse({"sk-Zt4q9LmW2xVb7RkP1cYh8NfJ": {"principal": "web", "roles": ["query"],
    ...                                                          "asserts_users": True},
    ...                       "sk-Qw8e7RtY6uI5oP4aS3dF2gH1": {"principal": "bot", "roles": ["query"]}})
    >>> request_voter(keys, "web", "alice"), request_voter(keys, "web", None), request_voter(keys, "bot", "alice")
    ('web/alice', 'web', 'bot')
    >>> request_voter(None, None, "alice") is None
    True
    """
    if keys is None or principal is None:
        return None
    if not user or not keys.asserts_users(principal):
        return principal
    if len(user) > MAX_USER_CHARS or not user.isprintable():
        from gpu_jobs.online.protocol import ParamError

        raise ParamError("user", f"user {user[:40]!r}: a user this key vouches for (asserts_users) must be "
                                 f"printable text of at most {MAX_USER_CHARS} characters")
    return f"{principal}/{user}"


def has_role(keys: "ApiKeys | None", scope: dict, role: str) -> bool:
    """Whether the request's `Authorization: Bearer <key>` has `role` -- any request when there
    are no keys (every path is open then). For an open path, which the Gate lets through
    unchecked: /health shows the canary to the metrics role only (app.py)."""
    if keys is None:
        return True
    header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), "")
    scheme, _, token = header.strip().partition(" ")
    principal = keys.lookup(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
    return principal is not None and role in principal.roles


def new_key_line(principal: str, roles: list[str], asserts_users: bool = False) -> tuple[str, str]:
    """(a new random key, the keys-file line naming it by its digest)."""
    import json
    import secrets

    spec = _principal({"principal": principal, "roles": list(roles), "asserts_users": asserts_users}, "the key")
    key = "sk-" + secrets.token_urlsafe(32)
    while weakness(key) is not None:  # a random run of 8 is astronomically rare; never hand one out
        key = "sk-" + secrets.token_urlsafe(32)
    extra = ", asserts_users: true" if spec.asserts_users else ""
    roles = json.dumps(sorted(spec.roles))
    return key, f"sha256:{_digest(key).hex()}: {{principal: {spec.name}, roles: {roles}{extra}}}"


def main(argv: list[str] | None = None) -> None:
    """Write a new key to --key-out (mode 0600: give it to the client) and print its keys-file line."""
    import argparse
    import os

    p = argparse.ArgumentParser(prog="python -m gpu_jobs.online.auth",
                                description="a new API key, written to --key-out; prints the keys-file line that "
                                            "names it by its digest (append it to the keys file)")
    p.add_argument("principal")
    p.add_argument("roles", nargs="+", choices=ROLES)
    p.add_argument("--key-out", required=True, help="where the key goes (a new file, mode 0600)")
    p.add_argument("--asserts-users", action="store_true",
                   help="the key is a frontend that authenticates its own users (each `user` it names is a voter)")
    p.add_argument("--keys-file", default=None,
                   help="append the digest line to this keys file (created with mode 0600; an existing one that "
                        "group or others may read is refused) instead of printing it")
    a = p.parse_args(argv)
    try:
        key, line = new_key_line(a.principal, a.roles, a.asserts_users)
        if a.keys_file is not None and os.path.exists(a.keys_file) and os.stat(a.keys_file).st_mode & 0o077:
            raise ApiKeysError(f"{a.keys_file} may be read by group or others: chmod 600 {a.keys_file}")
        fd = os.open(a.key_out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except ApiKeysError as exc:
        raise SystemExit(f"rlmill: {exc}") from None
    except OSError as exc:
        raise SystemExit(f"rlmill: cannot create {a.key_out} ({exc.strerror}): give a new file") from None
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    if a.keys_file is None:
        print(line)
        return
    with os.fdopen(os.open(a.keys_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as f:
        f.write(line + "\n")
    print(f"rlmill: key in {a.key_out}, its digest line appended to {a.keys_file}")


if __name__ == "__main__":
    main()

"""API keys: who is calling (`principal`) and what they may do (roles), from a keys file.

    >>> keys = ApiKeys.parse({"sk-alice-0123456789": {"principal": "alice", "roles": ["query", "feedback"]}})
    >>> alice = keys.lookup("sk-alice-0123456789")
    >>> alice.name, sorted(alice.roles), keys.lookup("sk-wrong")
    ('alice', ['feedback', 'query'], None)

The file (`rlmill serve --api-keys FILE`, or the path in $RLMILL_API_KEYS) is YAML or JSON: a
mapping from each key to its principal and roles; several keys may name one principal (rotation):

    sk-frontend-2f9c1e...: {principal: chat-frontend, roles: [query, feedback]}
    sk-grafana-77ab04...:  {principal: grafana, roles: [metrics]}

Roles: `query` (POST /v1/completions, /v1/chat/completions, GET /v1/models), `feedback`
(POST /v1/feedback), `metrics` (GET /metrics). GET /health needs no key. Clients send the key as
the OpenAI clients do, `Authorization: Bearer <key>`. Keys are kept only as SHA-256 digests and a
token is compared against every one of them with hmac.compare_digest, so the time a lookup takes
says nothing about which key, or how much of one, was guessed. Events record the principal, never
the key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["ROLES", "ApiKeys", "ApiKeysError", "Principal", "role_of"]

ROLES = ("query", "feedback", "metrics")
MIN_KEY_CHARS = 16  # a shorter key is guessable; refused at load
PRINCIPAL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$")  # it lands in every event: a plain name

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


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """Key digests -> principals; see the module docstring."""

    def __init__(self, entries: list[tuple[bytes, Principal]]):
        if not entries:
            raise ApiKeysError("the keys file names no key: add `<key>: {principal: <name>, roles: [query]}`")
        self._entries = entries

    @classmethod
    def parse(cls, data: Any, where: str = "the keys file") -> "ApiKeys":
        """Keys from the parsed file (a mapping key -> {principal, roles})."""
        if not isinstance(data, dict):
            raise ApiKeysError(f"{where} must be a mapping of each key to {{principal, roles}}, "
                               f"not a {type(data).__name__}")
        entries = []
        for i, (key, spec) in enumerate(data.items(), 1):
            what = f"{where}, entry {i}"
            if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or key != key.strip():
                raise ApiKeysError(f"{what}: a key must be a string of at least {MIN_KEY_CHARS} characters without "
                                   "surrounding spaces (e.g. `python -c 'import secrets; print(\"sk-\" + "
                                   "secrets.token_urlsafe(32))'`)")
            if not isinstance(spec, dict) or set(spec) - {"principal", "roles"}:
                raise ApiKeysError(f"{what}: give {{principal: <name>, roles: [...]}} and nothing else")
            name, roles = spec.get("principal"), spec.get("roles")
            if not isinstance(name, str) or not PRINCIPAL.match(name):
                raise ApiKeysError(f"{what}: principal {name!r} must be 1-128 letters, digits or ._@:- "
                                   "(it is written into every event)")
            if not isinstance(roles, list) or not roles or any(r not in ROLES for r in roles):
                raise ApiKeysError(f"{what} ({name}): roles {roles!r} must be a non-empty list of "
                                   f"{', '.join(ROLES)}")
            entries.append((_digest(key), Principal(name, frozenset(roles))))
        return cls(entries)

    @classmethod
    def from_file(cls, path: str) -> "ApiKeys":
        """Keys from a YAML or JSON file (JSON is YAML)."""
        import yaml

        try:
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

    def principals(self) -> list[str]:
        return sorted({p.name for _, p in self._entries})

    def __len__(self) -> int:
        return len(self._entries)

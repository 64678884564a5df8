"""Signed stream entries: serve signs every event, the consumer refuses what it did not sign.

    key = event_key()                       # bytes from $RLMILL_EVENT_KEY or $RLMILL_EVENT_KEY_FILE, or None
    sig = sign(key, data)                   # hex HMAC-SHA256 of the exact event JSON bytes
    verified(key, data, sig)                # True / False (constant time)
    write_key_file(path)                    # a fresh 32-byte key, hex, mode 0600 (what `make serve` does)

Why: anything that can reach the broker's port can XADD. Without a signature the consumer cannot
tell serve's events from an attacker's (forged feedback on any answer, a made-up answer to vote
on). With a key on both sides (the same one: one environment variable, or one file both
processes can read), an entry is {"event": <json>, "sig": <hex>}; the consumer quarantines an
entry without "sig" ("unsigned entry") or whose "sig" is not the HMAC of the event's exact bytes
("signature does not match"), counted by reason. The HMAC is over the bytes Redis holds, so
nothing is re-serialised before it is checked (the JSON is parsed only once it verified).

What it does not do: a key that leaks (it sits in the environment of serve and of the consumer)
signs anything; replaying a signed entry lands nothing twice (the consumer dedupes by event id).
Without a key, both sides work as before and each says once that events are unsigned
(UNSIGNED_WARNING).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

__all__ = ["KEY_ENV", "KEY_FILE_ENV", "MIN_KEY_BYTES", "SigningKeyError", "UNSIGNED_WARNING", "event_key",
           "sign", "verified", "write_key_file"]

KEY_ENV = "RLMILL_EVENT_KEY"
KEY_FILE_ENV = "RLMILL_EVENT_KEY_FILE"
MIN_KEY_BYTES = 32  # HMAC-SHA256's own block of strength: a shorter key is guessable sooner than the hash
UNSIGNED_WARNING = (f"events are unsigned: anything that can reach the broker can forge them; set {KEY_FILE_ENV} to "
                    f"a 0600 file holding at least {MIN_KEY_BYTES} bytes (python -m gpu_jobs.online.signing new "
                    f"FILE writes one), or {KEY_ENV}, the same for serve and the consumer")


class SigningKeyError(ValueError):
    """The configured key cannot be used; the message names the variable, the problem and the fix."""


def event_key(environ: dict[str, str] | None = None) -> bytes | None:
    """The signing key: $RLMILL_EVENT_KEY (its UTF-8 bytes), else the contents of the file named
    by $RLMILL_EVENT_KEY_FILE (surrounding whitespace stripped), else None (unsigned). Refuses a
    key shorter than MIN_KEY_BYTES, both variables set, and a key file that its group or others
    can read (SigningKeyError)."""
    env = os.environ if environ is None else environ
    value, path = env.get(KEY_ENV) or None, env.get(KEY_FILE_ENV) or None
    if value is not None and path is not None:
        raise SigningKeyError(f"both {KEY_ENV} and {KEY_FILE_ENV} are set: keep one (the file keeps the key out of "
                              "process listings and Prefect parameters)")
    if path is not None:
        key, where = _read_key_file(Path(path)), f"{KEY_FILE_ENV}={path}"
    elif value is not None:
        key, where = value.strip().encode("utf-8"), KEY_ENV
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise SigningKeyError(f"the event key in {where} is {len(key)} bytes: give at least {MIN_KEY_BYTES} (python -m "
                              "gpu_jobs.online.signing new FILE writes a fresh one)")
    return key


def _read_key_file(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise SigningKeyError(f"{KEY_FILE_ENV}={path}: cannot read it ({exc.strerror or exc})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SigningKeyError(f"{KEY_FILE_ENV}={path} is readable by its group or others (mode "
                              f"{stat.S_IMODE(mode):04o}): chmod 600 {path}")
    try:
        return path.read_bytes().strip()
    except OSError as exc:
        raise SigningKeyError(f"{KEY_FILE_ENV}={path}: cannot read it ({exc.strerror or exc})") from None


def sign(key: bytes, data: bytes) -> str:
    """The hex HMAC-SHA256 of `data` (the event's exact JSON bytes) under `key`.

    >>> sign(b"k" * 32, b'{"kind":"answer"}')[:16]
    '1540ad546f6ce3fd'
    """
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def verified(key: bytes, data: bytes, sig: bytes | str) -> bool:
    """Whether `sig` is sign(key, data), compared in constant time; any malformed `sig` is False."""
    try:
        given = sig.decode("ascii") if isinstance(sig, bytes) else str(sig)
    except UnicodeDecodeError:
        return False
    return hmac.compare_digest(sign(key, data), given)


def write_key_file(path: str | Path) -> Path:
    """A fresh random key (32 bytes, as 64 hex characters) in a new file readable by its owner
    only; an existing file is kept as it is (serve and the consumer keep agreeing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(MIN_KEY_BYTES) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m gpu_jobs.online.signing",
                                description="write a fresh event-signing key file (mode 0600; kept if it exists)")
    p.add_argument("command", choices=("new",))
    p.add_argument("file")
    a = p.parse_args(argv)
    print(f"rlmill: event key in {write_key_file(a.file)}; give serve and the consumer {KEY_FILE_ENV}={a.file}",
          flush=True)


if __name__ == "__main__":
    main()

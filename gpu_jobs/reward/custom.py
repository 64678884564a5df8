"""Load a verl user's reward function (or tool, or environment) from the file the config names.

    >>> fn = load_custom_reward_function("my_reward.py", "compute_score")
    >>> fn("my/source", "response text", "ground truth", {"split": "train"})

The file is executed as a module from exactly that path (never found on sys.path), so the same
file verl's `custom_reward_function.path` points at works unchanged.

A `s3://...` (any storage URL) file is fetched once per process into a directory of its own
made by tempfile.mkdtemp (mode 0700: no other user can read or swap it) and its sha256 is
recorded. Every later use reads the copy's bytes, hashes them against that record and runs
exactly the bytes it hashed; a copy that changed is refused (`ChangedCopyError`) instead of
run. Sandbox workers get the parent's records through their environment (`SHARED_ENV`), so a
worker never needs storage credentials: it runs the copy the parent fetched, checked the same
way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable

__all__ = ["ChangedCopyError", "SHARED_ENV", "fetched_copies", "load_custom_reward_function", "local_source"]

SHARED_ENV = "RLMILL_SANDBOX_FILES"  # url -> [local copy, sha256], set for sandbox workers
_FETCHED: dict[str, tuple[str, str]] = {}
_LOCK = threading.Lock()


class ChangedCopyError(RuntimeError):
    """The local copy of a fetched file no longer has the bytes it was fetched with."""


def fetched_copies() -> dict[str, tuple[str, str]]:
    """url -> (local copy, sha256) of every file this process fetched (and inherited)."""
    return {**_inherited(), **_FETCHED}


def _inherited() -> dict[str, tuple[str, str]]:
    raw = os.environ.get(SHARED_ENV)
    return {url: (local, digest) for url, (local, digest) in json.loads(raw).items()} if raw else {}


def local_source(path: str, storage=None) -> tuple[str, str | None]:
    """(local path, sha256 to check it against) of `path`: a local file as it is (None), a
    storage URL fetched once into a private directory."""
    if "://" not in path or path.startswith("file://"):
        return path.removeprefix("file://"), None
    known = fetched_copies().get(path)
    if known is not None:
        return known
    from storage import url_to_fs

    fs, remote = url_to_fs(path, storage)
    data = fs.cat_file(remote)
    with _LOCK:
        if path not in _FETCHED:
            folder = tempfile.mkdtemp(prefix="rlmill-reward-")  # 0700, a name nobody can predict
            local = os.path.join(folder, os.path.basename(remote) or "reward.py")
            fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            _FETCHED[path] = (local, hashlib.sha256(data).hexdigest())
        return _FETCHED[path]


def _checked_bytes(path: str, local: str, sha256: str | None) -> bytes:
    if not os.path.isfile(local):
        raise FileNotFoundError(f"reward function file not found: {path}")
    with open(local, "rb") as f:
        data = f.read()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise ChangedCopyError(
            f"the local copy {local} of {path} no longer matches the sha256 recorded when it was fetched "
            f"({sha256[:16]}...): something changed it after the fetch, so it is not run; find what wrote "
            "there, then start again to fetch a fresh copy")
    return data


def load_custom_reward_function(path: str, name: str = "compute_score", storage=None) -> Callable:
    """The function `name` defined in the Python file at `path`.

    Raises FileNotFoundError if the file does not exist, ChangedCopyError if the local copy
    of a fetched file changed since the fetch, and AttributeError naming the functions the
    file does define if `name` is not one of them.
    """
    local, sha256 = local_source(path, storage)
    data = _checked_bytes(path, local, sha256)
    # A unique module name per file, registered in sys.modules so dataclasses/pickling inside
    # the user's module work; two different files never collide.
    module_name = "rlmill_custom_reward_" + hashlib.sha1(os.path.abspath(local).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, local)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:  # the bytes hashed above, not a second read of the file
        exec(compile(data, local, "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"reward function {name!r} not found in {path}; it defines {defined}")
    return fn

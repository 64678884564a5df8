"""Load a verl user's reward function from the file the config names.

    >>> fn = load_custom_reward_function("my_reward.py", "compute_score")
    >>> fn("my/source", "response text", "ground truth", {"split": "train"})

The file is executed as a module from exactly that path (never found on sys.path), so the same
file verl's `custom_reward_function.path` points at works unchanged. A `s3://...` URL is fetched
to a local temporary file first.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable

__all__ = ["load_custom_reward_function"]


def _local_copy(path: str, storage=None) -> str:
    if "://" not in path or path.startswith("file://"):
        return path.removeprefix("file://")
    from storage import url_to_fs

    fs, remote = url_to_fs(path, storage)
    data = fs.cat_file(remote)
    digest = hashlib.sha256(data).hexdigest()[:16]
    local = os.path.join(tempfile.gettempdir(), f"rlmill-reward-{digest}.py")
    if not os.path.exists(local):
        tmp = f"{local}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, local)
    return local


def load_custom_reward_function(path: str, name: str = "compute_score", storage=None) -> Callable:
    """The function `name` defined in the Python file at `path`.

    Raises FileNotFoundError if the file does not exist and AttributeError naming the
    functions the file does define if `name` is not one of them.
    """
    local = _local_copy(path, storage)
    if not os.path.isfile(local):
        raise FileNotFoundError(f"reward function file not found: {path}")
    # A unique module name per file, registered in sys.modules so dataclasses/pickling inside
    # the user's module work; two different files never collide.
    module_name = "rlmill_custom_reward_" + hashlib.sha1(os.path.abspath(local).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, local)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"reward function {name!r} not found in {path}; it defines {defined}")
    return fn

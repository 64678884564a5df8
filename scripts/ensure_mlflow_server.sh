#!/usr/bin/env bash
# The MLflow tracking server, web UI included, in a virtual environment of its own: a team runs
# its tracking server as a service beside the training machines, not as a library inside the
# training environment (the full `mlflow` wheel pins pyarrow<26; rlmill's stack has 26.0.1, and
# .venv holds only mlflow-skinny, the client, which has no UI). Built once per machine, like the
# Debian packages scripts/ensure_test_tools.sh installs:
#
#   mlflow=$(bash scripts/ensure_mlflow_server.sh | tail -1)      # the path of its `mlflow`
#   "$mlflow" server --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///$PWD/mlflow.db \
#       --artifacts-destination $PWD/mlartifacts
#
# Where: ${RLMILL_CACHE_DIR:-~/.cache/rlmill}/tools/mlflow-<version>. Version: RLMILL_MLFLOW_VERSION
# (default 3.17.2: the newest whose mlflow, mlflow-skinny and mlflow-tracing all are on the
# registry, checked 2026-12-02; 3.18.0's skinny is not, and the client in .venv is
# mlflow-skinny==3.17.2, pyproject.toml's `test` extra). Its other packages are whatever the
# registry resolves for that pin the day it is built; the built environment's `pip freeze` is
# kept beside it (freeze.txt).
#
# Atomic: built in a temporary folder beside the destination and renamed into place last, after
# the UI's files were found in it, so a killed build leaves no half environment to be reused (its
# temporary folder is removed at exit, or by the next build). Concurrent callers (pytest-xdist
# workers) wait on one lock and share one build. Logs go to stderr; stdout is the one path.
set -euo pipefail
VERSION=${RLMILL_MLFLOW_VERSION:-3.17.2}
PY=${PYTHON:-python3}
TOOLS=${RLMILL_CACHE_DIR:-$HOME/.cache/rlmill}/tools
DEST="$TOOLS/mlflow-$VERSION"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
say() { echo "[rlmill] $*" >&2; }

ui_built() { [ -f "$1/.ui-checked" ] && [ -x "$1/bin/mlflow" ]; }
if ui_built "$DEST"; then
    echo "$DEST/bin/mlflow"
    exit 0
fi

mkdir -p "$TOOLS"
exec 9>"$TOOLS/.mlflow-$VERSION.lock"
if ! flock -n 9; then
    say "waiting for another process building $DEST (one lock, one build)"
    flock 9
fi
if ui_built "$DEST"; then  # built by the process we waited for
    echo "$DEST/bin/mlflow"
    exit 0
fi
rm -rf "$TOOLS/.mlflow-$VERSION.build."*  # a killed build's leftovers (we hold the lock)
[ -e "$DEST" ] && rm -rf "$DEST"          # not ui_built: an older layout or a hand-made folder
BUILD=$(mktemp -d "$TOOLS/.mlflow-$VERSION.build.XXXXXX")
trap 'rm -rf "$BUILD"' EXIT

say "building the MLflow $VERSION tracking server (with its web UI) in $DEST:"
say "  ~90 packages (about 850 MB); usually ~50 s on 2 cores with uv, minutes with pip; once per machine"
from=$(date +%s)
"$PY" -m venv --prompt "mlflow-$VERSION" "$BUILD"
# uv (from PyPI) installs the packages in parallel where pip does one at a time; it gets pip's
# index settings (scripts/uv_args.py), as scripts/ensure_venv.sh does. pip is the fallback.
say "  [1/3] installer: uv 0.13.8 into the new environment"
if "$BUILD/bin/pip" install -q "uv==0.13.8" >&2 && UV_ARGS=$("$BUILD/bin/python" "$REPO/scripts/uv_args.py"); then
    # shellcheck disable=SC2086  # UV_ARGS is a list of flags, one word each
    INSTALL=("$BUILD/bin/uv" pip install -q --python "$BUILD/bin/python" --no-cache --compile-bytecode $UV_ARGS)
else
    say "  uv is not installable here: installing with pip (slower)"
    INSTALL=("$BUILD/bin/pip" install -q)
fi
say "  [2/3] mlflow==$VERSION and its dependencies"
# The installers print nothing while they download and unpack: a line every 10 s says it runs.
( while sleep 10; do say "  ... installing ($(( $(date +%s) - from )) s; usually ~50 s)"; done ) &
ticker=$!
trap 'kill "$ticker" 2>/dev/null || true; rm -rf "$BUILD"' EXIT
if ! "${INSTALL[@]}" "mlflow==$VERSION" >&2; then
    echo "rlmill: could not install mlflow==$VERSION (the installer's error is above): is the package" \
        "registry reachable, and does it have that version? RLMILL_MLFLOW_VERSION picks another." >&2
    exit 1
fi
kill "$ticker" 2>/dev/null || true
"$BUILD/bin/pip" uninstall -q -y uv >&2 || true  # an installer, not part of the service
"$BUILD/bin/pip" freeze > "$BUILD/freeze.txt"

say "  [3/3] checking the web UI is there and moving the environment into place"
if ! "$BUILD/bin/python" - <<'PYEOF'
import pathlib, sys
import mlflow.server
ui = pathlib.Path(mlflow.server.__file__).parent / "js" / "build" / "index.html"
sys.exit(0 if ui.is_file() else f"{ui} is missing")
PYEOF
then
    echo "rlmill: the mlflow==$VERSION just installed does not start or has no web UI (above);" \
        "RLMILL_MLFLOW_VERSION picks another version" >&2
    exit 1
fi
# A venv's commands name its Python by absolute path (their #! line, activate's VIRTUAL_ENV):
# point them at the destination before the rename, so they work where the environment will be.
grep -rlI --null -F "$BUILD" "$BUILD/bin" "$BUILD/pyvenv.cfg" | xargs -0 -r sed -i "s|$BUILD|$DEST|g"
touch "$BUILD/.ui-checked"
mv -T "$BUILD" "$DEST"
trap - EXIT
say "built $DEST in $(( $(date +%s) - from )) s"
echo "$DEST/bin/mlflow"

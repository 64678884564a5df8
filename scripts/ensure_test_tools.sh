#!/usr/bin/env bash
# System tools the tests use beyond the Python environment: Debian's chromium for the headless
# checks of the Prefect UI and the docs site's home page (tests/test_docs_site.py),
# Debian's redis-server (Redis Streams) for the broker between
# `rlmill serve` and `rlmill feedback consume` (tests/serve/ start their own on a free port),
# Debian's podman for the container image's checks (tests/test_image.py), and Debian's postgresql
# for Prefect on PostgreSQL (scripts/postgres_local.sh; tests/test_prefect_postgres.py starts a
# throwaway cluster on a free port). Installed once per machine (CI runs as root with
# Debian's registry).
set -euo pipefail
can_install() { [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; }
install() {  # install <debian package> <what it is for>
    echo "[rlmill] installing Debian $1 for $2"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
}
ensure() {  # ensure <command> <debian package> <what it is for>
    if ! command -v "$1" >/dev/null 2>&1; then
        if can_install; then
            install "$2" "$3"
        else
            echo "[rlmill] $2 is missing and cannot be installed here: $3 will be skipped"
        fi
    fi
}
ensure chromium chromium "the UI and docs-site tests"
ensure redis-server redis-server "the serve/feedback tests (tests/serve)"
ensure podman podman "the container image's refusal test (tests/test_image.py; building the image is make image)"

# PostgreSQL: Debian keeps initdb off PATH (/usr/lib/postgresql/<version>/bin), so the check is
# scripts/postgres_local.sh's own preflight. As root the cluster runs as the `postgres` account
# (PostgreSQL refuses root); Debian's package creates it, a PostgreSQL from elsewhere may not.
pg_for="the Prefect-on-PostgreSQL tests (tests/test_prefect_postgres.py)"
postgres_local="$(dirname "$0")/postgres_local.sh"
if ! bash "$postgres_local" check >/dev/null 2>&1; then
    if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
        if can_install; then
            install postgresql "$pg_for"
        else
            echo "[rlmill] postgresql is missing and cannot be installed here: $pg_for will be skipped"
        fi
    fi
    if [ "$(id -u)" = "0" ] && ! id -u "${RLMILL_PG_USER:-postgres}" >/dev/null 2>&1; then
        echo "[rlmill] creating the system account ${RLMILL_PG_USER:-postgres} to run PostgreSQL (it refuses root)"
        useradd --system --user-group --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin \
            "${RLMILL_PG_USER:-postgres}"
    fi
fi

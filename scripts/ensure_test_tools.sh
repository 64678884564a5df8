#!/usr/bin/env bash
# System tools the tests use beyond the Python environment: Debian's chromium for the headless
# check of the Prefect UI, and Debian's redis-server (Redis Streams) for the broker between
# `rlmill serve` and `rlmill feedback consume` (tests/serve/ start their own on a free port).
# Installed once per machine (CI runs as root with Debian's registry).
set -euo pipefail
ensure() {  # ensure <command> <debian package> <what it is for>
    if ! command -v "$1" >/dev/null 2>&1; then
        if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
            echo "[rlmill] installing Debian $2 for $3"
            apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null
        else
            echo "[rlmill] $2 is missing and cannot be installed here: $3 will be skipped"
        fi
    fi
}
ensure chromium chromium "the UI test"
ensure redis-server redis-server "the serve/feedback tests (tests/serve)"

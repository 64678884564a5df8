#!/usr/bin/env bash
# System tools the tests use beyond the Python environment: Debian's chromium for the headless
# check of the Prefect UI. Installed once per machine (CI runs as root with Debian's registry).
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "[rlmill] installing Debian chromium for the UI test"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "[rlmill] chromium is missing and cannot be installed here: the UI test will be skipped"
    fi
fi

#!/usr/bin/env bash
# `make test`: the environment, the system tools, then the whole suite side by side on the cores
# (pytest-xdist, one worker per core unless RLMILL_TEST_WORKERS says otherwise), and last one line
# with how long it all took against the 12-minute budget (README "Tests").
#
#   bash scripts/run_tests.sh [pytest args]    (make test; extra args go to pytest)
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/ensure_venv.sh test || exit $?
bash scripts/ensure_test_tools.sh || exit $?
workers=${RLMILL_TEST_WORKERS:-$(nproc)}
# loadscope: a module's tests (a class's, where a module splits its work into classes) on one
# worker, so module- and session-scoped fixtures (a warm engine, a built model, tests/deployments'
# server and worker) are built once per worker. (loadgroup cannot be used: pytest-xdist 3.8's
# groups do not reach pytest 9.2's node ids.) Modules go out longest first (tests/conftest.py),
# not by test count, which xdist would otherwise do.
.venv/bin/python -m pytest -q --durations=30 -n "$workers" --dist loadscope --no-loadscope-reorder "${@:-tests}"
rc=$?
secs=$(( $(date +%s) - start ))
budget=$(( 12 * 60 ))
verdict=$([ "$secs" -le "$budget" ] && echo "within" || echo "OVER")
printf 'make test: %d min %02d s, %s the 12 min budget (%d workers, exit %d)\n' $((secs / 60)) $((secs % 60)) "$verdict" "$workers" "$rc"
exit $rc

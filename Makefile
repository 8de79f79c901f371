# mlx-worker-svc: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NODE_STAMP := node_modules/.installed
HOST ?= 127.0.0.1
PORT ?= 50051
PYTEST_ARGS ?=

.PHONY: install proto proto-check buf-lint model serve demo test lint typecheck fmt bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $(NODE_STAMP)

install: $(STAMP) ## create .venv with the package and its dev tools

proto: $(STAMP) ## regenerate mlx_worker_svc/gen from protos/
	$(PY) protos/generate.py

proto-check: proto ## fail if the committed generated code is stale
	git diff --exit-code -- mlx_worker_svc/gen || \
	  (echo "generated code is stale: run 'make proto' and commit" >&2; exit 1)
	test -z "$$(git status --porcelain -- mlx_worker_svc/gen)" || \
	  (echo "untracked generated files: run 'make proto' and commit" >&2; exit 1)

buf-lint: $(NODE_STAMP) ## lint protos/ with buf's standard rules
	./node_modules/.bin/buf lint

model: $(STAMP) ## build the embedded default model (SmolLM2-135M-Instruct)
	$(PY) -m mlx_worker_svc convert-gguf

serve: $(STAMP) ## serve the worker on the embedded model, lifecycle done
	$(PY) -m mlx_worker_svc serve --auto-init --host $(HOST) --port $(PORT)

demo: $(STAMP) ## start a worker, stream one chat answer through Generate, stop it
	$(PY) -m mlx_worker_svc.demo

lint: $(STAMP) ## ruff (lint + format check) and mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy mlx_worker_svc tests protos/generate.py

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: $(STAMP) model ## run the test suite (warnings are errors)
	$(PY) -m pytest -W error $(PYTEST_ARGS)

bench: $(STAMP) model ## benchmarks (JSON + PNG under benchmarks/results)
	$(PY) -m benchmarks.run

clean: ## remove the venv, node tools and caches (not the model cache)
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

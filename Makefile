# Developer entry points: `make up`, `make test`, `make bench` (public contracts, see README.md).
# GNU make. Everything runs from the virtualenv $(VENV), created on first use.

PYTHON ?= python3
VENV ?= .venv
PYTEST_ARGS ?=

VENV_PYTHON := $(VENV)/bin/python
# Reinstall only when the dependencies (or the C extension's source) change; the code itself is installed editable.
INSTALLED := $(VENV)/.installed

# The addresses `runplatform` binds (settings.py reads the same variables).
HTTP_BIND := $(or $(OBSERVATORY_HTTP_BIND),127.0.0.1:8000)
GRPC_BIND := $(or $(OBSERVATORY_OTLP_GRPC_BIND),127.0.0.1:4317)
GATEWAY_BIND := $(or $(ENGINE_GATEWAY_BIND),127.0.0.1:8100)
# Background load `make up` sends through the gateway, requests/s (0: none).
LOAD ?= 0.5

.DEFAULT_GOAL := help
.PHONY: help venv install up test bench lint docker-check clean

help:
	@echo "make up            install, migrate, print an ingest key and an API token, run the platform with a"
	@echo "                   simulated engine fleet behind the gateway and a gentle background load (LOAD=0 for none)"
	@echo "make test          install (with dev extras) and run every test; PYTEST_ARGS='...' passes through"
	@echo "make bench         run the benchmarks (lines 'BENCH <name>=<value> <unit>')"
	@echo "make lint          ruff check"
	@echo "make docker-check  validate docker/Dockerfile and docker/compose.yaml (no Docker engine needed)"
	@echo "make install       create $(VENV) and install the project editable with its dev extras"
	@echo "make clean         remove .data and build artefacts (keeps $(VENV))"

venv install: $(INSTALLED)

$(VENV_PYTHON):
	$(PYTHON) -m venv $(VENV)
	$(VENV_PYTHON) -m pip install --upgrade pip

# Order-only on the interpreter: recreating nothing when only its timestamp moves.
# The C fast path of ingest is built by the install too: rebuild it when its source changes.
$(INSTALLED): pyproject.toml platform/ingest/_otlp_fast.c | $(VENV_PYTHON)
	$(VENV_PYTHON) -m pip install -e '.[dev]'
	@touch $@

up: $(INSTALLED)
	$(VENV_PYTHON) manage.py migrate --noinput
	$(VENV_PYTHON) manage.py migrate_clickhouse
	@key=$$($(VENV_PYTHON) manage.py create_ingest_key --project default --name "make up") && \
	token=$$($(VENV_PYTHON) manage.py create_api_token --user admin --role admin --project default --name "make up") && \
	echo "" && \
	echo "LLM latency observatory" && \
	echo "  platform, JSON API   http://$(HTTP_BIND)" && \
	echo "  OTLP/HTTP            http://$(HTTP_BIND)/v1/traces" && \
	echo "  OTLP/gRPC            $(GRPC_BIND)" && \
	echo "  Prometheus metrics   http://$(HTTP_BIND)/metrics" && \
	echo "  engine gateway       http://$(GATEWAY_BIND)/v1   (OpenAI-compatible; simulated vLLM replicas)" && \
	echo "  ingest key (project 'default'):    $$key" && \
	echo "  admin API token (user 'admin'):    $$token" && \
	echo "" && \
	echo "  export OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf" && \
	echo "  export OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://$(HTTP_BIND)/v1/traces" && \
	echo "  export OTEL_EXPORTER_OTLP_HEADERS='Authorization=Bearer $$key'" && \
	echo ""
	exec $(VENV_PYTHON) manage.py runplatform --with-engine --load $(LOAD)

test: $(INSTALLED)
	$(VENV_PYTHON) -m pytest -q $(PYTEST_ARGS)

bench: $(INSTALLED)
	$(VENV_PYTHON) -m observatory.bench.ingest
	$(VENV_PYTHON) -m observatory.bench.summary
	$(VENV_PYTHON) -m observatory.bench.overload
	$(VENV_PYTHON) -m observatory.bench.api
	$(VENV_PYTHON) -m engine.bench.sim
	$(VENV_PYTHON) -m engine.bench.gateway
	$(VENV_PYTHON) -m slo.bench
	$(VENV_PYTHON) -m alerts.bench

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .

docker-check: $(INSTALLED)
	$(VENV_PYTHON) -m pytest -q tests/test_docker_files.py

clean:
	rm -rf .data .bench build dist .pytest_cache .hypothesis *.egg-info platform/*.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

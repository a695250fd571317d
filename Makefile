# Everything a fresh machine needs: `make serve` and `make test` create .venv and install.
# `make serve` installs the package and what serving needs; `make test` adds the test extra (and
# with it the bench extra), `make bench` the bench extra; both add the second reference
# environment (below). Each install leaves its own stamp.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SERVE_INSTALLED := $(VENV)/.installed-serve
BENCH_INSTALLED := $(VENV)/.installed-bench
TEST_INSTALLED := $(VENV)/.installed-test
HF_REFERENCE_INSTALLED := $(VENV)/.installed-hf-reference
# The second reference environment of the Mamba, Mamba-2 and RWKV parity tests and of `bench
# vs-hf-mamba` (`make test` and `make bench` install it): a newer transformers installed apart
# (--target), put first on PYTHONPATH by the subprocesses that run it; the test extra's
# transformers 4.37.2 stays the one the TransfoXL, XLNet and Reformer parity tests import
# (tests/models/hf_reference.py, docs/convert.md)
HF_REFERENCE_DIR := $(VENV)/hf-reference
HF_REFERENCE := transformers==4.57.1 tokenizers==0.22.1
# Every runtime package at the version constraints.txt pins (the images install from it too).
# Torch: that version, from pip's index (the CPU build with TORCH_INDEX_URL below, or from this
# machine's disk where pip finds it there); GPU users install their own torch first (pyproject
# says torch>=2.4) and keep it.
CONSTRAINTS := constraints.txt
TORCH_PIN ?= $(shell grep '^torch==' $(CONSTRAINTS))
# where torch comes from: pip's index unless set (PyPI's Linux x86_64 torch is the CUDA build, several
# GB; make serve TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu takes the CPU build)
TORCH_INDEX_URL ?=
HOST ?= 127.0.0.1
PORT ?= 8000
# pytest-xdist workers for `make test`, one test file at a time each (its module fixtures, such as
# a shared server, stay in one worker). Most of the suite waits on server subprocesses starting,
# streaming and stopping, so two workers on CI's 2 cores overlap that waiting; every test process
# runs torch on one thread (tests/conftest.py), so the workers do not fight over cores.
TEST_WORKERS ?= 2
# The interpreter must meet pyproject's requires-python (">=X.Y"), checked before anything is
# installed; read with a regex, since tomllib is what an older Python lacks.
CHECK_PYTHON := import re, sys; floor = tuple(map(int, re.search(r"requires-python\W+(\d+)\.(\d+)", \
  open("pyproject.toml").read()).groups())); sys.exit(0 if sys.version_info >= floor else \
  f"xlserve needs Python >= {floor[0]}.{floor[1]} (pyproject.toml); $(PYTHON) is {sys.version.split()[0]}: run make PYTHON=<a Python {floor[0]}.{floor[1]} or newer>")
# Torch's version read from its metadata: importing torch before numpy is installed prints
# "Failed to initialize NumPy"; and reading the version this way costs no torch import.
TORCH_IS_PINNED := import sys; from importlib.metadata import version; \
  sys.exit(version("torch").split("+")[0] != "$(TORCH_PIN)".split("==")[1])
# $(call APT_INSTALL,[FLAGS] PACKAGES,WHAT FOLLOWS[,exit 1;]) after a check that found a program
# missing: as root (CI) apt-get installs the packages; as another user nothing is installed, and
# it says what is missing, what follows from that and how to install it
APT_INSTALL = if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq $(1); \
  else echo "== not installed: $(filter-out -%,$(1)) (make installs packages only as root); $(2); to install: sudo apt-get install $(1)"; $(3) fi
SKIPPED := the tests that need it are skipped, saying why

.PHONY: serve test fuzz chaos bench gpu-check clean

# The venv, torch, and the constraints every later install uses: the pins, less torch's block
# when the torch installed is not the pinned one (a GPU build the user installed first)
$(VENV)/constraints.txt: pyproject.toml $(CONSTRAINTS)
	@$(PYTHON) -c '$(CHECK_PYTHON)'
	@test -x $(PY) || echo "== creating $(VENV) with $$($(PYTHON) --version)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip show torch >/dev/null 2>&1 \
	  || echo "== installing $(TORCH_PIN), the largest download (the CPU build about 190 MB, a CUDA build several GB)"
	$(PY) -m pip show torch >/dev/null 2>&1 || $(PY) -m pip install -c $(CONSTRAINTS) \
	  $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "$(TORCH_PIN)"
	$(PY) -c '$(TORCH_IS_PINNED)' && cp $(CONSTRAINTS) $@ \
	  || (echo "== keeping this venv's own torch: its pins are left out"; \
	      sed '/^# torch and what only torch needs/,$$d' $(CONSTRAINTS) > $@)

$(SERVE_INSTALLED): $(VENV)/constraints.txt
	@echo "== installing xlserve (editable) and what serving needs: numpy, fastapi, uvicorn, safetensors, ..."
	$(PY) -m pip install -c $(VENV)/constraints.txt -e .
	touch $@

$(BENCH_INSTALLED): $(SERVE_INSTALLED) $(HF_REFERENCE_INSTALLED)
	@echo "== installing the bench extra: matplotlib, transformers"
	$(PY) -m pip install -c $(VENV)/constraints.txt -e ".[bench]"
	touch $@

$(TEST_INSTALLED): $(SERVE_INSTALLED) $(HF_REFERENCE_INSTALLED)
	@echo "== installing the test extra (and the bench extra): pytest, selenium, schemathesis, transformers, ..."
	$(PY) -m pip install -c $(VENV)/constraints.txt -e ".[test]"
	touch $@ $(BENCH_INSTALLED)

# --no-deps: what it imports besides (huggingface_hub, safetensors, ...) is the bench extra's
$(HF_REFERENCE_INSTALLED): $(SERVE_INSTALLED)
	@echo "== installing the second reference environment, $(HF_REFERENCE_DIR): $(HF_REFERENCE)"
	$(PY) -m pip install --upgrade --no-deps --target $(HF_REFERENCE_DIR) $(HF_REFERENCE)
	touch $@

serve: $(SERVE_INSTALLED)
	$(VENV)/bin/xlserve serve --host $(HOST) --port $(PORT)

test: $(TEST_INSTALLED)
	command -v redis-server >/dev/null || $(call APT_INSTALL,redis-server,$(SKIPPED))
	command -v chromedriver >/dev/null || $(call APT_INSTALL,chromium chromium-driver,$(SKIPPED))
	command -v nginx >/dev/null || test -x /usr/sbin/nginx || $(call APT_INSTALL,nginx-light,$(SKIPPED))
	command -v prometheus >/dev/null || $(call APT_INSTALL,--no-install-recommends prometheus,$(SKIPPED))
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# the fuzz run of `make test` (tests/e2e/test_fuzz.py) with a larger budget: examples per operation and kind
FUZZ_EXAMPLES ?= 300
fuzz: $(TEST_INSTALLED)
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s tests/e2e/test_fuzz.py

# the chaos run of `make test` (tests/e2e/test_chaos.py: fairness, disconnects mid-prefill, poison
# imports, a Redis pause during commits, engine kills beside streams, against one real server and
# redis-server) with more rounds of each probe; it prints a table of probes and outcomes
CHAOS_ROUNDS ?= 20
chaos: $(TEST_INSTALLED)
	command -v redis-server >/dev/null || $(call APT_INSTALL,redis-server,make chaos needs it,exit 1;)
	CHAOS_ROUNDS=$(CHAOS_ROUNDS) $(PY) -m pytest -q -s tests/e2e/test_chaos.py

bench: $(BENCH_INSTALLED)
	$(VENV)/bin/xlserve bench continuation

gpu-check: $(TEST_INSTALLED)
	XLSERVE_DEVICE=cuda $(PY) -m pytest -q -m gpu
	XLSERVE_DEVICE=cuda $(VENV)/bin/xlserve bench continuation --device cuda

clean:
	rm -rf $(VENV)

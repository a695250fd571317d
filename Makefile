# Everything a fresh machine needs: `make serve` and `make test` create .venv and install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
# CPU build that lies on this machine's disk; GPU users install their own torch first (pyproject says torch>=2.4)
TORCH_PIN ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test fuzz bench gpu-check clean

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(INSTALLED)

serve: $(INSTALLED)
	$(VENV)/bin/xlserve serve --host $(HOST) --port $(PORT)

test: $(INSTALLED)
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	command -v chromedriver >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium chromium-driver)
	command -v nginx >/dev/null || test -x /usr/sbin/nginx || (apt-get update -qq && apt-get install -y -qq nginx-light)
	$(PY) -m pytest -q

# the fuzz run of `make test` (tests/e2e/test_fuzz.py) with a larger budget: examples per operation and kind
FUZZ_EXAMPLES ?= 300
fuzz: $(INSTALLED)
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s tests/e2e/test_fuzz.py

bench: $(INSTALLED)
	$(VENV)/bin/xlserve bench continuation

gpu-check: $(INSTALLED)
	XLSERVE_DEVICE=cuda $(PY) -m pytest -q -m gpu
	XLSERVE_DEVICE=cuda $(VENV)/bin/xlserve bench continuation --device cuda

clean:
	rm -rf $(VENV)

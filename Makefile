# meshembed — the two commands of the README, plus maintenance targets.
PYTHON_BOOT ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip
# Every extra that can run on a CPU-only machine (cupy needs an NVIDIA GPU).
TEST_EXTRAS ?= torch,jax,tf-interop,dev

.PHONY: demo test test-fast conformance bench protos clean

$(VENV)/bin/python:
	$(PYTHON_BOOT) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.core: $(VENV)/bin/python pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.full: $(VENV)/.core
	$(PIP) install -q -e ".[$(TEST_EXTRAS)]"
	touch $@

demo: $(VENV)/.core
	$(PYTHON) -m meshembed demo

test: $(VENV)/.full
	$(PYTHON) -m pytest tests conformance -q

conformance: $(VENV)/.core
	$(PYTHON) -m meshembed conformance

bench: $(VENV)/.full
	$(PYTHON) -m meshembed bench --workload all --peers

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache

-include Makefile.protos

# meshembed — the two commands of the README, plus maintenance targets.
PYTHON_BOOT ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip
# Every extra that can run on a CPU-only machine (cupy needs an NVIDIA GPU).
TEST_EXTRAS ?= torch,jax,tf-interop,dev

.PHONY: demo test test-fast conformance bench protos clean test-interop

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

# The test runner's own plugins, pinned: pytest-xdist runs the suite on TEST_WORKERS processes
# (2 = the CI box's cores; TEST_WORKERS=0 runs it in one process). conformance/xdist_groups.py
# keeps each file on one worker and the multi-process tests one at a time, long ones first.
TEST_TOOLS ?= pytest-xdist==3.8.0 execnet==2.1.2
TEST_WORKERS ?= 2

$(VENV)/.test-tools: $(VENV)/.full
	$(PIP) install -q $(TEST_TOOLS)
	touch $@

test: $(VENV)/.test-tools
	$(PYTHON) -m pytest tests conformance -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

conformance: $(VENV)/.core
	$(PYTHON) -m meshembed conformance

bench: $(VENV)/.full
	$(PYTHON) -m meshembed bench --workload all --peers

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache

-include Makefile.protos

# Peers of me.interop (extra [interop]) in their own venv layered on $(VENV), installed with
# --no-deps so nothing replaces $(VENV)'s torch/jax (torchrec's CUDA fbgemm-gpu dependency is
# replaced by fbgemm-gpu-cpu). Then the tests/test_interop_*.py that need them.
INTEROP_VENV ?= $(VENV)/interop
INTEROP_PEERS ?= torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 keras-rs==0.4.0 jax-tpu-embedding==0.1.0 \
	tensordict==0.15.3 pyvers==0.2.3 cloudpickle==3.1.3 pyre-extensions==0.0.32 typing-inspect==0.9.0 \
	mypy-extensions==1.2.0 flax==0.12.8 msgpack==1.2.4 PyYAML==6.0.4 einops==0.8.2

$(INTEROP_VENV)/.peers: $(VENV)/.full
	$(PYTHON) -m venv $(INTEROP_VENV)
	echo "import site; site.addsitedir('$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(INTEROP_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/meshembed-base.pth"
	$(INTEROP_VENV)/bin/python -m pip install -q --no-deps $(INTEROP_PEERS)
	touch $@

test-interop: $(INTEROP_VENV)/.peers
	$(INTEROP_VENV)/bin/python -m pytest tests/test_interop_core.py tests/test_interop_torchrec.py tests/test_interop_torchrec_mc.py \
		tests/test_interop_keras_rs.py tests/test_interop_jax_tpu_embedding.py tests/test_interop_rowwise.py -q

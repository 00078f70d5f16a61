# Two entry points for a fresh machine (see README):  make demo  |  make test
# Each sets up its own virtual environment in .venv first (torch before deepspeed: its build imports torch).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEMO_DIR ?= runs/demo
# Extra set-up steps the tests need (other targets append to this).
TEST_DEPS := system-deps
TEST_DEPS += .venv-pcluster/.installed
TEST_DEPS += pbs-install
TEST_DEPS += .bnb-site/.installed
TEST_DEPS += container-tools

.PHONY: venv demo test test-setup test-other-pythons system-deps pbs-install container-tools check-python clean format

venv: check-python $(VENV)/.installed

# llmft needs Python 3.11+ (its pinned stack does: transformers 5.21+ and trl 1.16 require 3.11);
# a .venv built by another interpreter than $(PYTHON) is rebuilt, not reused.
check-python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "make: $(PYTHON) is missing or older than Python 3.11; llmft needs 3.11+: make $(MAKECMDGOALS) PYTHON=python3.11" >&2; exit 1; }
	@want=$$($(PYTHON) -c 'import sys; print(sys.version)'); \
	if [[ -x $(PY) ]] && [[ "$$($(PY) -c 'import sys; print(sys.version)' 2>/dev/null)" != "$$want" ]]; then \
	  echo "make: $(VENV) was built with another Python than $(PYTHON); rebuilding it"; rm -rf $(VENV); fi

$(VENV)/.installed: setup.cfg constraints.txt | check-python  # after it: it may remove a .venv of another Python
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -c constraints.txt torch
	$(PIP) install -q --no-build-isolation -c constraints.txt -e '.[test]'
	$(PY) -m llmft.prebuild  # DeepSpeed's GPU ops compiled in once where torch has CUDA (else one line says why not)
	touch $@

demo: venv
	$(PY) -m llmft.demo --out $(DEMO_DIR)

# Two pytest workers, a test file each at a time (a file's module fixtures, such as its Slurm cluster, are built once):
# one worker alone kept the two cores about 75% busy (single-process CLI runs, Slurm's scheduling waits). Files go out in
# collection order, the longest first (tests/conftest.py's LONGEST_FILES), not xdist's most-tests-first.
# The set-up first, its pip and apt steps side by side (each is one process: one alone left the second core idle).
TEST_WORKERS ?= 2
test: check-python
	$(MAKE) --no-print-directory -j 3 --output-sync=target test-setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

# Everything `make test` sets up, without the tests.
test-setup: venv $(TEST_DEPS)

# Formatting and import order by ruff (settings in pyproject.toml); the tests fail on a file it would change.
format: venv
	$(PY) -m ruff check --fix -q llmft tests bench inference
	$(PY) -m ruff format -q llmft tests bench inference

# System tools the tests need (shellcheck, Slurm, munge): installed once here, before pytest starts.
system-deps:
	bash tests/system_deps.sh

# OpenPBS for the real PBS cluster of pbs/local/ (tests/pbs_cluster.py): built from source once (6-7 min on 2 cores)
# into /opt/llmft-openpbs, or restored from its cached install tree, here beside the venv's creation rather than
# inside pytest. After system-deps, which installs its build packages (two apt-gets at once would collide).
pbs-install: system-deps
	bash pbs/local/start.sh --install --build-only

# The real enroot and pyxis (from ../shared/vendor, a few seconds each) and the container tests' image (debootstrap +
# mksquashfs: 4-5 min on the 2-core machine), into /opt/llmft-containers, each cached by what defines it
# (tests/container_tools.sh). After system-deps, which installs debootstrap, squashfs-tools and the build packages.
container-tools: system-deps
	bash tests/container_tools.sh

# The interpreter-dependent tests (checkpoint reading, data) under every other Python 3.11+ found here.
test-other-pythons: venv
	bash tests/other_pythons.sh

clean:
	rm -rf $(VENV) .venv-py* .bnb-site runs

# bitsandbytes for tests/test_export.py's QLoRA merge only (4-bit quantize/dequantize; its wheel carries a CPU build),
# in a folder of its own that those tests put on the path: in .venv, every process that imports PEFT would import it
# (2.4 s a process on the 2-core machine, and a warning line on stderr on a CPU without its optional kernels).
BNB_VERSION ?= 0.50.2
.bnb-site/.installed: $(VENV)/.installed
	$(PIP) install -q --no-deps --target .bnb-site bitsandbytes==$(BNB_VERSION)
	touch $@

# aws-parallelcluster lives in its own virtual environment (its pins clash with the training
# stack): tests/test_clusters.py validates blueprints/aws/config.yaml with its schema, and
# .venv-pcluster/bin/pcluster is a ready CLI for ./manage_cluster.sh --provider aws.
PCLUSTER_VERSION ?= 3.16.1
.venv-pcluster/.installed:
	test -x .venv-pcluster/bin/python || $(PYTHON) -m venv .venv-pcluster
	.venv-pcluster/bin/python -m pip install -q aws-parallelcluster==$(PCLUSTER_VERSION)
	touch $@

# Two entry points for a fresh machine (see README):  make demo  |  make test
# Each sets up its own virtual environment in .venv first (torch before deepspeed: its build imports torch).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEMO_DIR ?= runs/demo
# Extra set-up steps the tests need (other targets append to this).
TEST_DEPS :=
TEST_DEPS += .venv-pcluster/.installed

.PHONY: venv demo test clean

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -c constraints.txt torch
	$(PIP) install -q --no-build-isolation -c constraints.txt -e '.[test]'
	touch $@

demo: venv
	$(PY) -m llmft.demo --out $(DEMO_DIR)

test: venv $(TEST_DEPS)
	$(PY) -m pytest -q --durations=10 tests

clean:
	rm -rf $(VENV) runs

# aws-parallelcluster lives in its own virtual environment (its pins clash with the training
# stack): tests/test_clusters.py validates blueprints/aws/config.yaml with its schema, and
# .venv-pcluster/bin/pcluster is a ready CLI for ./manage_cluster.sh --provider aws.
PCLUSTER_VERSION ?= 3.16.1
.venv-pcluster/.installed:
	test -x .venv-pcluster/bin/python || $(PYTHON) -m venv .venv-pcluster
	.venv-pcluster/bin/python -m pip install -q aws-parallelcluster==$(PCLUSTER_VERSION)
	touch $@

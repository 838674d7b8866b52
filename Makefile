# The two commands the README starts with, and the pieces they are made of.
SHELL := /bin/bash
VENV := .venv/bin
NODES ?= 2
# Training processes per lab node (the lab's default, 2, when empty).
NPROC ?=
# The lab's name: its containers, network and Docker labels derive from it.
LAB_NAME ?= llama-lab
# Tools that tests and scripts start by name (ansible-playbook, ansible-config, molecule) come
# from the controller environment, activated or not.
export PATH := $(CURDIR)/.venv/bin:$(PATH)
# Downloads and built environments are cached here (CI keeps them between runs).
export LLAMA_CLUSTER_CACHE ?= $(HOME)/.cache/llama-cluster
export LLAMA_CLUSTER_TRAIN_VENV ?= $(LLAMA_CLUSTER_CACHE)/venv-train
export LLAMA_CLUSTER_TRAIN_PYTHON ?= $(LLAMA_CLUSTER_TRAIN_VENV)/bin/python

.PHONY: host setup test-env lab lab-down provision train demo lint test test-fast test-lab

host:                 ## this machine: Docker daemon, debootstrap, rsync (installed and started as root)
	@scripts/bootstrap-host.sh

setup:                ## controller: .venv + collections
	scripts/setup-controller.sh

test-env: setup       ## the node wheelhouse (CPU build) and a controller venv with the training stack
	$(VENV)/ansible-playbook playbooks/wheelhouse.yml -e cluster_accelerator=cpu \
	  -e wheelhouse_python=$$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
	scripts/setup-train-venv.sh

lab: host setup       ## start the local lab cluster (NODES=2, NPROC=2)
	$(VENV)/ansible-playbook playbooks/lab.yml -e lab_nodes=$(NODES) -e lab_cluster_name=$(LAB_NAME) \
	  $(if $(NPROC),-e lab_nproc=$(NPROC))

lab-down: setup       ## remove the lab's containers and network
	$(VENV)/ansible-playbook playbooks/lab.yml -e lab_state=absent -e lab_cluster_name=$(LAB_NAME)

provision: setup
	$(VENV)/ansible-playbook provision.yml

train: setup
	$(VENV)/ansible-playbook train.yml -e model=tiny

demo: host            ## set up, start the lab, provision it, train the tiny model on 2 nodes (timed)
	@NODES=$(NODES) NPROC=$(NPROC) LAB_NAME=$(LAB_NAME) scripts/demo.sh

# Code that runs on the nodes must run on Python 3.10 (Ubuntu 22.04's python3): the collection's
# modules and module_utils, and every Python file the roles run or install there
# (roles/*/files: *.py, and files whose first line is a python shebang). vermin fails on anything newer (datetime.UTC, tomllib, ...).
PLUGINS := collections/ansible_collections/llama/cluster/plugins
NODE_PYTHON = $(shell find $(PLUGINS)/modules $(PLUGINS)/module_utils roles/*/files -type f -name '*.py'; \
  find roles/*/files -type f ! -name '*.py' -exec grep -l -m1 -e '^.!.*python' {} +)

# The maps that must not drift from the code (the collection's room list, the README's pointers,
# the import rules: tests/unit/project/test_maps.py) and every plugin rendered by ansible-doc
# (tests/unit/project/test_plugin_docs.py): seconds, no node, no container.
LINT_TESTS := tests/unit/project/test_maps.py tests/unit/project/test_plugin_docs.py

lint: setup           ## ansible-lint (production), yamllint, ruff, vermin (node-side Python 3.10), maps and ansible-doc
	$(VENV)/yamllint --strict .
	$(VENV)/ansible-lint
	$(VENV)/ruff check .
	$(VENV)/ruff format --check .
	$(VENV)/vermin --target=3.10- --violations --no-tips --no-parse-comments $(sort $(NODE_PYTHON))
	$(VENV)/pytest -q -p no:cacheprovider $(LINT_TESTS)

test-fast: test-env   ## lint + pytest without molecule scenarios
	$(MAKE) lint
	$(VENV)/pytest -m "not molecule"

# pytest on PYTEST_WORKERS workers (pytest-xdist): the lab's tests are one group and each molecule
# scenario another, each run whole by one worker, the longest first (tests/conftest.py); the other
# tests spread over the workers. 2 (the default): the train scenario on one worker, the lab's
# tests, the other scenarios and the unit tests on the other; 1: one process, the files' order
# (CONTRIBUTING.md, "Tests and CI's time", has the figures).
PYTEST_WORKERS ?= 2
PYTEST := $(VENV)/pytest --durations=40 $(if $(filter-out 0 1,$(PYTEST_WORKERS)),\
  -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

# The tests use the lab: a lab already up is used and kept; otherwise one is started for them and
# removed after them. Before pytest, side by side (make -j, each target's output printed whole
# once it ends): lint, the wheelhouse and the training venv, and the lab.
LAB_UP_BEFORE := $(wildcard inventory/lab.yml)
LAB_DOWN_AFTER := $(if $(LAB_UP_BEFORE),true,$(MAKE) --no-print-directory lab-down)

test-lab: host setup
	$(if $(LAB_UP_BEFORE),@echo "test: using the lab that is up ($(LAB_UP_BEFORE))",\
	  $(VENV)/ansible-playbook playbooks/lab.yml -e lab_nodes=$(NODES) -e lab_cluster_name=$(LAB_NAME))

# The machine is checked first, alone: what it lacks stops the run before anything is set up.
# Beyond `make host`, the tests need chromium (it renders TensorBoard, molecule/train/tests/test_serve.py).
test:                 ## everything CI runs: lint, pytest (lab and molecule scenarios included)
	@scripts/bootstrap-host.sh --with chromium
	@$(MAKE) --no-print-directory -j3 --output-sync=target lint test-env test-lab || \
	  { $(LAB_DOWN_AFTER); exit 1; }
	@status=0; $(PYTEST) || status=$$?; $(LAB_DOWN_AFTER); exit $$status

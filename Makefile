# The two commands the README starts with, and the pieces they are made of.
SHELL := /bin/bash
VENV := .venv/bin
NODES ?= 2

.PHONY: setup lab lab-down provision train demo lint test test-fast

setup:                ## controller: .venv + collections
	scripts/setup-controller.sh

lab: setup            ## start the local lab cluster (NODES=2)
	$(VENV)/ansible-playbook playbooks/lab.yml -e lab_nodes=$(NODES)

lab-down: setup       ## remove the lab's containers and network
	$(VENV)/ansible-playbook playbooks/lab.yml -e lab_state=absent

provision: setup
	$(VENV)/ansible-playbook provision.yml

train: setup
	$(VENV)/ansible-playbook train.yml -e model=tiny

demo: lab provision train   ## set up, start the lab, provision it, train the tiny model on 2 nodes

lint: setup           ## ansible-lint (production), yamllint, ruff
	$(VENV)/yamllint --strict .
	$(VENV)/ansible-lint
	$(VENV)/ruff check .
	$(VENV)/ruff format --check .

test-fast: setup      ## lint + pytest without molecule scenarios
	$(MAKE) lint
	$(VENV)/pytest -m "not molecule"

test: setup           ## everything CI runs: lint, pytest, molecule scenarios
	$(MAKE) lint
	$(VENV)/pytest

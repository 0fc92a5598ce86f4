# Nyströmformer pipeline. `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NYS := $(VENV)/bin/nystromformer

.DEFAULT_GOAL := help
.PHONY: help setup test

help: ## list the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | awk -F'\t' '{printf "  %-14s %s\n", $$1, $$2}'

setup: $(VENV)/.installed ## create .venv and install the project with its test tools

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: setup ## run the test suite (GPU tests skip on CPU)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests ran"; rc=0; fi; exit $$rc

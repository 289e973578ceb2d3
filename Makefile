# Quick start: `make run` (main job, embedded default) and `make test` (lint,
# types, tests). Both create .venv on first use.
#
# torch: a CPU-only machine gets torch==2.13.0 (its CPU wheel); pip is never
# asked for an unpinned torch, which would fetch a multi-GB CUDA build. GPU
# users create .venv and install their CUDA torch into it first; this file
# then keeps it (see README, "GPU machines").
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tierzero-installed

.PHONY: setup run test test-busy lint typecheck unit bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "torch==2.13.0"
	$(BIN)/python -m pip install -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/tierzero train

lint: setup
	$(BIN)/ruff check tierzero engine offload swap tests benchmarks

typecheck: setup
	$(BIN)/mypy

# The suite in parallel (pytest-xdist): one worker per core, at most 4 (each worker and the
# child processes its tests start hold their own models and buffers in host memory).
# A single test or file: $(BIN)/pytest -q tests/... (serial, as pyproject's addopts are).
unit: setup
	$(BIN)/pytest -q -n auto --maxprocesses 4

test: lint typecheck unit

# The suite beside two CPU-bound processes, as on a shared machine or a busy CI runner:
# tests must assert what is guaranteed, not what a quiet scheduler happened to do. The
# hogs are this recipe's own children, stopped however the run ends. HOGS=n for more.
HOGS ?= 2
test-busy: setup
	@set -e; pids=""; trap 'kill $$pids 2>/dev/null || true' EXIT INT TERM; \
	for i in $$(seq $(HOGS)); do \
		$(BIN)/python -c "while True: pass" & pids="$$pids $$!"; \
	done; \
	echo "test-busy: $(HOGS) CPU hogs running (pids$$pids)"; \
	$(MAKE) test

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

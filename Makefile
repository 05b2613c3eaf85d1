# Two commands do all set-up: `make chat` and `make test`. Both go through `make setup`, which is idempotent.
# TORCH picks the torch build: the default lets pip choose (CUDA wheels on Linux);
# CI passes TORCH='torch==2.13.0' to take the CPU build from local disk.
PYTHON ?= python3
TORCH ?= torch
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup chat test fuzz bench-cpu lint

setup: $(VENV)/.installed
	@$(BIN)/python -m llamaterm.engine.store.default_model

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q '$(TORCH)'
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

chat: setup
	$(BIN)/llamaterm chat

test: setup
	$(BIN)/python -m pytest -q

# The model-file fuzz test for longer than CI runs it (tests/test_fuzz.py): FUZZ_SECONDS of cases from a new seed.
FUZZ_SECONDS ?= 600
fuzz: setup
	LLAMATERM_FUZZ_SEED=$${LLAMATERM_FUZZ_SEED:-$$(date +%s)} LLAMATERM_FUZZ_CASES=1000000 \
	LLAMATERM_FUZZ_SECONDS=$(FUZZ_SECONDS) $(BIN)/python -m pytest -q tests/test_fuzz.py

bench-cpu: setup
	$(BIN)/llamaterm bench --device cpu --peer hf --sessions 1

lint: setup
	$(BIN)/ruff check app engine kernels tests

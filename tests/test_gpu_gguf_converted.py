"""GGUF files written by llama.cpp's own converter, loaded on CUDA (GPU only; skipped elsewhere):
kestrel's float32 logits on the GPU equal transformers' on the Hugging Face checkpoint, prefilled
in chunks and decoded token by token."""

import pytest
import torch
from tests.reference import assert_close, chunked_logits, decode_logits
from tests.test_gguf_converted import (  # noqa: F401  (fixtures)
    PROMPT,
    cache_dir,
    converted,
    tokenizers,
)

from kestrel.weights.loader import load_model, resolve

pytestmark = pytest.mark.gpu


def test_converted_gguf_on_cuda_matches_transformers(converted):  # noqa: F811
    _, path, expected, _ = converted
    model = load_model(resolve(str(path)), torch.float32, torch.device("cuda"), progress=False)
    assert_close(chunked_logits(model, PROMPT, 5).cpu(), expected, rtol=1e-3, atol=1e-3)
    assert_close(decode_logits(model, PROMPT, 9).cpu(), expected, rtol=1e-3, atol=1e-3)

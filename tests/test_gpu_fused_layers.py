"""On CUDA the layers fuse for Triton: every `Linear` takes the one-row GEMV, Gemma 4's attention
its fused path, and the fused model's logits equal the unfused one's (fp32 to 1e-4; bfloat16,
where the GEMV serves one row, within its rounding). GPU only; skipped elsewhere."""

import copy

import pytest
import torch

from kestrel.kernels.backend import Backend, backend_for
from kestrel.models.gemma4 import Gemma4Attention
from kestrel.models.layers.fused import fuse_model
from kestrel.models.layers.linear import Linear
from test_fused_layers import logits
from test_paged_cache import tiny_model

pytestmark = pytest.mark.gpu

FAMILIES = ["llama", "gemma3", "gemma4", "glm4_moe_lite"]


def on_cuda(family: str, dtype: torch.dtype):
    return copy.deepcopy(tiny_model(family)).to(device="cuda", dtype=dtype)


def test_cuda_layers_fuse_for_triton():
    assert backend_for("cuda") is Backend.TRITON
    model = on_cuda("gemma4", torch.bfloat16)
    fuse_model(model)
    fusing = [m for m in model.modules() if isinstance(m, (Linear, Gemma4Attention))]
    assert fusing and all(m.fused for m in fusing)


# bfloat16: a logit near 10 rounds in steps of 1/16, and the fused sums round in another order
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-1)])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_logits_equal_unfused_on_cuda(family, tokens, dtype, tol):
    ids = [(i * 37 + 11) % 97 for i in range(tokens)]
    want = logits(on_cuda(family, dtype), ids).float()
    model = on_cuda(family, dtype)
    fuse_model(model)
    torch.testing.assert_close(logits(model, ids).float(), want, rtol=tol, atol=tol)

"""GGUF dequantization of every type the issue names, against gguf's quantize round trip; the
packed layers' torch dequantization (kernels/quant.py) against gguf's, bit for bit; the llama.cpp
Q/K permutation undone."""

import gguf
import numpy as np
import pytest
import torch
from tests.gguf_writer import random_blocks

from kestrel.kernels.quant import BLOCKS
from kestrel.kernels.quant import dequantize as torch_dequantize
from kestrel.models.llama import unpermute_rows
from kestrel.weights.gguf import dequantize

T = gguf.GGMLQuantizationType
TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K]


class FakeTensor:
    """The three fields of a GGUFReader tensor that `dequantize` reads."""

    def __init__(self, data, tensor_type, shape):
        self.data, self.tensor_type, self.shape = data, tensor_type, shape


def quantize(values: np.ndarray, qtype) -> np.ndarray:
    if qtype == T.F32:
        return values
    if qtype == T.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_reference_round_trip(qtype):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((8, 256)).astype(np.float32)
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) and not gguf.quants._type_traits[qtype].__dict__.get(
        "quantize_blocks"
    ):
        pytest.skip(f"gguf cannot quantize {qtype.name}; covered by the real models")
    try:
        data = quantize(values, qtype)
    except NotImplementedError:
        pytest.skip(f"gguf cannot quantize {qtype.name}; covered by the real models")
    out = dequantize(FakeTensor(data, qtype, [256, 8]))  # GGUF shapes are reversed
    assert out.shape == (8, 256) and out.dtype == torch.float32
    expected = (
        gguf.quants.dequantize(data, qtype)
        if qtype not in (T.F32, T.F16)
        else data.astype(np.float32)
    )
    np.testing.assert_array_equal(out.numpy(), expected)
    tolerance = {T.F32: 0, T.F16: 1e-2, T.BF16: 2e-2, T.Q8_0: 2e-2}.get(qtype, 0.5)
    assert np.abs(out.numpy() - values).max() <= tolerance + 1e-6


def test_unpermute_inverts_llama_cpp_permutation():
    n_heads, head_dim, hidden = 3, 8, 5
    w = torch.randn(n_heads * head_dim, hidden)
    # llama.cpp's convert script: reshape(n_head, 2, D/2, ...).swapaxes(1, 2)
    permuted = w.reshape(n_heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rows(permuted, n_heads), w)


@pytest.mark.parametrize("qtype", sorted(BLOCKS))
def test_torch_dequantize_equals_gguf_bit_for_bit(qtype):
    # valid blocks (finite scales) and raw random bytes (any float16 scale, NaN and inf included)
    rng = np.random.default_rng(1)
    element, size = BLOCKS[qtype]
    valid = random_blocks((6, 3 * element), T[qtype], rng)
    raw = rng.integers(0, 256, size=(5, 3 * size), dtype=np.uint8)
    for blocks in (valid, raw):
        with np.errstate(invalid="ignore", over="ignore"):
            expected = gguf.quants.dequantize(blocks, T[qtype])
        out = torch_dequantize(torch.from_numpy(blocks), qtype, 3 * element).numpy()
        assert out.dtype == np.float32
        # NaNs in the same places (their payload bits depend on the vector unit), and every
        # other value the same bits (the sign of zero included)
        nan = np.isnan(expected)
        np.testing.assert_array_equal(np.isnan(out), nan)
        np.testing.assert_array_equal(out.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])

"""GGUF dequantization of every type the issue names, against gguf's quantize round trip; the
packed layers' torch dequantization (kernels/quant.py) against gguf's, bit for bit; the llama.cpp
Q/K permutation undone."""

import gguf
import numpy as np
import pytest
import torch
from tests.gguf_writer import random_blocks

from kestrel.kernels.quant import BLOCKS, align_blocks, aligned_bytes, row_bytes
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


def test_q6_k_padded_to_224_byte_blocks_dequantizes_to_the_files_values():
    """CUDA's Q6_K layout (`align_blocks`): each 210-byte block followed by 14 zero bytes,
    decoded bit for bit as gguf decodes the file's blocks; the other types stay as they are."""
    rng = np.random.default_rng(2)
    blocks = torch.from_numpy(random_blocks((6, 3 * 256), T.Q6_K, rng))
    padded, layout = align_blocks(blocks, "Q6_K")
    assert layout == "Q6_K_224" and padded.shape == (6, row_bytes("Q6_K_224", 3 * 256))
    assert padded.numel() == aligned_bytes("Q6_K", blocks.numel()) == 6 * 3 * 224
    per_block = padded.reshape(6, 3, 224)
    assert torch.equal(per_block[..., :210], blocks.reshape(6, 3, 210))
    assert not per_block[..., 210:].any()
    expected = gguf.quants.dequantize(blocks.numpy(), T.Q6_K)
    out = torch_dequantize(padded, "Q6_K_224", 3 * 256).numpy()
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    q4 = torch.from_numpy(random_blocks((2, 256), T.Q4_K, rng))
    same, name = align_blocks(q4, "Q4_K")
    assert same is q4 and name == "Q4_K" and aligned_bytes("Q4_K", 288) == 288

"""kestrel's native CPU kernels (kernels/cpu/*.cpp). GGUF: for every type they read, the
matmul straight from the blocks and their dequantization equal the PyTorch decoding of
kernels/quant.py (gguf-py's values), for every number of activation rows (the 8-, 4-, 2- and 1-row
passes of decode and small batches, the dequantized tiles of prefill), in float32 and bfloat16;
bad blocks are refused by the op; without the kernels the layers fall back to PyTorch and give
the same logits. Paged attention equals its PyTorch reference on trimmed, sunk and sliding
sequences, decode and prefill tiles, GQA and wide heads, the MLA latent, float32 and bfloat16;
so do the fused RMSNorm, activation-times-up and RoPE-and-store."""

import gguf
import numpy as np
import pytest
import torch
from tests.family_suite import one_thread  # noqa: F401
from tests.gguf_writer import random_blocks
from tests.kernel_checks import check_fused, check_paged_attention
from tests.reference import assert_close, chunked_logits
from tests.test_gguf_quantized import PROMPT, load, tiny_llama_gguf

from kestrel.kernels import cpu_native
from kestrel.kernels.quant import dequantize
from kestrel.models.layers.quant import QuantLinear


def blocks_of(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(random_blocks((rows, cols), gguf.GGMLQuantizationType[qtype], rng))


def test_the_kernels_build_on_this_machine():
    assert cpu_native.available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 40])
@pytest.mark.parametrize("window", [None, 16])
def test_paged_attention_equals_the_reference(dtype, chunk, window):
    check_paged_attention(cpu_native.paged_attention, "cpu", dtype, chunk, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_equal_their_references(dtype):
    check_fused("cpu", dtype)


@pytest.mark.parametrize(
    "hq,hkv,d,bs,value_dim",
    [(9, 3, 64, 64, None), (4, 1, 256, 16, None), (8, 8, 72, 16, None), (20, 1, 72, 64, 64)],
)
def test_paged_attention_head_shapes_and_the_latent(hq, hkv, d, bs, value_dim):
    # SmolLM2's GQA on 64-token blocks, gemma3's 256-wide heads, a width no vector divides, and
    # MLA in latent space (values inside the keys)
    for chunk in (1, 9):
        check_paged_attention(
            cpu_native.paged_attention, "cpu", torch.float32, chunk, None, hq, hkv, d, bs,
            value_dim, 4,
        )  # fmt: skip


@pytest.mark.parametrize("qtype", cpu_native.QTYPES)
def test_dequantize_equals_the_pytorch_decoding(qtype):
    blocks = blocks_of(qtype, 37, 512)
    expected = dequantize(blocks, qtype, 512)
    assert expected.abs().max() > 0
    torch.testing.assert_close(cpu_native.gguf_dequantize(blocks, qtype, 512), expected)


@pytest.mark.parametrize("window", [None, 100])
def test_a_decode_step_over_few_kv_heads_splits_the_keys(window):
    """Fewer work items than twice the threads (one KV head, as gemma3-270m has, and three
    sequences): each sequence's keys are split in parts computed apart and merged; parts the
    window hides entirely, the trimmed sequence's sinks and a sequence too short to split
    merge the same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_paged_attention(
            cpu_native.paged_attention, "cpu", torch.float32, 1, window, 4, 1, 64, 16,
            lengths=(700, 400, 90),
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", cpu_native.QTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 15, 32, 33])
def test_matmul_from_the_blocks_equals_dequantize_then_matmul(qtype, rows):
    """37 output rows: not a multiple of the four a thread takes at once. The float path."""
    torch.manual_seed(0)
    blocks = blocks_of(qtype, 37, 512)
    x = torch.randn(rows, 512)
    expected = x @ dequantize(blocks, qtype, 512).T
    out = cpu_native.gguf_mm(x, blocks, qtype, 512, int8=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", cpu_native.QTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 15, 32])
def test_int8_activations_are_exact_where_they_are_integers(qtype, rows):
    """Activations that quantize without loss (integers, each block of 32 reaching 127: scale 1)
    meet the weights exactly: every block's integers, scales and biases are the file's."""
    torch.manual_seed(0)
    blocks = blocks_of(qtype, 37, 512)
    x = torch.randint(-127, 128, (rows, 512)).float()
    x[:, 5::32] = 127.0
    expected = x.double() @ dequantize(blocks, qtype, 512).double().T
    out = cpu_native.gguf_mm(x, blocks, qtype, 512, int8=True)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("cols", [64, 320, 576])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_rows_of_32_element_blocks_end_in_pairs(qtype, cols, rows):
    """The int8 path takes eight 32-element blocks a step; a row whose length is not a multiple
    of 256 (SmolLM2's 576) ends two blocks a step, and is exact the same way."""
    torch.manual_seed(0)
    blocks = blocks_of(qtype, 37, cols)
    x = torch.randint(-127, 128, (rows, cols)).float()
    x[:, 5::32] = 127.0
    expected = x.double() @ dequantize(blocks, qtype, cols).double().T
    out = cpu_native.gguf_mm(x, blocks, qtype, cols, int8=True)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("qtype", cpu_native.QTYPES)
def test_int8_activations_stay_near_the_float_path(qtype):
    """Rounding activations to 1/254 of their block's range moves each output by about that
    much of its size (this bounds it at 4%, measured at 0.5-1%)."""
    torch.manual_seed(1)
    blocks = blocks_of(qtype, 64, 1024)
    x = torch.randn(4, 1024)
    exact = x.double() @ dequantize(blocks, qtype, 1024).double().T
    error = cpu_native.gguf_mm(x, blocks, qtype, 1024, int8=True).double() - exact
    assert 0 < error.abs().max() < 0.04 * exact.abs().max()


def test_int8_activations_are_chosen_by_the_environment(monkeypatch):
    for choice, expected in (("0", False), ("1", True)):
        monkeypatch.setenv("KESTREL_CPU_INT8", choice)
        cpu_native.int8_activations.cache_clear()
        assert cpu_native.int8_activations() is expected
    monkeypatch.setenv("KESTREL_CPU_INT8", "yes")
    cpu_native.int8_activations.cache_clear()
    with pytest.raises(ValueError, match="KESTREL_CPU_INT8 must be auto, 0 or 1"):
        cpu_native.int8_activations()
    monkeypatch.delenv("KESTREL_CPU_INT8")
    cpu_native.int8_activations.cache_clear()


def test_bfloat16_activations_come_back_as_bfloat16():
    blocks, x = blocks_of("Q4_K", 16, 256), torch.randn(2, 256)
    out = cpu_native.gguf_mm(x.bfloat16(), blocks, "Q4_K", 256, int8=False)
    expected = x.bfloat16().float() @ dequantize(blocks, "Q4_K", 256).T
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_blocks_that_do_not_hold_the_columns_are_refused():
    blocks = blocks_of("Q8_0", 4, 64)
    with pytest.raises(RuntimeError, match="do not hold 96 columns"):
        cpu_native.gguf_mm(torch.randn(1, 96), blocks, "Q8_0", 96)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_native.gguf_mm(torch.randn(1, 32), blocks, "Q8_0", 64)


@pytest.mark.parametrize("quant", ["Q4_1", "Q6_K"])
def test_without_the_kernels_packed_layers_give_the_same_logits(quant, tmp_path, monkeypatch):
    path = tiny_llama_gguf(tmp_path / f"{quant}.gguf", quant)
    packed = load(path, packed=True)
    native = chunked_logits(packed, PROMPT, 5)
    monkeypatch.setattr(cpu_native, "serves", lambda qtype: False)
    assert isinstance(packed.model.layers[0].mlp.down_proj, QuantLinear)
    assert_close(chunked_logits(packed, PROMPT, 5), native)

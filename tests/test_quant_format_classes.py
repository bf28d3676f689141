"""The quantization methods as classes (kernels/formats.py): each format's layer holds the shapes
the format declares, its rows decode the same one entry per row (an expert stack) as whole, its
weights stack along the rows only where the format says and then decode to the stacked rows, on
the CPU only GGUF blocks have a kernel, and no code outside the registry compares a format's
name."""

import re
from pathlib import Path

import pytest
import torch
from tests.test_tensor_parallel_quantized import LAYERS, fp8_layer, gguf_layer, mlx_layer

from kestrel.kernels import cpu_native
from kestrel.kernels.formats import FORMATS, FP8Format, GGUFFormat, MLXFormat

SRC = Path(__file__).resolve().parent.parent / "src" / "kestrel"


def squeezed(shape) -> tuple:
    return tuple(d for d in shape if d != 1)


@pytest.mark.parametrize("key", sorted(LAYERS))
def test_a_layer_holds_the_shapes_its_format_declares(key):
    layer = LAYERS[key]()
    expected = layer.fmt.expected_shapes(layer.out_features, layer.in_features)
    held = {role: squeezed(t.shape) for role, t in layer.tensors().items()}
    assert held == {role: squeezed(shape) for role, shape in expected.items()}
    assert isinstance(layer.fmt, FORMATS[layer.fmt.kind])


@pytest.mark.parametrize("key", sorted(LAYERS))
def test_one_entry_per_row_decodes_to_the_same_weight(key):
    layer = LAYERS[key]()
    rows = layer.out_features
    fmt, t = layer.fmt.by_row(layer.tensors(), rows)
    assert all(v.dim() == 0 or v.shape[0] == rows for v in t.values())
    got = fmt.dequantize_rows(t, torch.tensor([0, rows - 1, 5]), layer.cols)
    assert torch.equal(got, layer.weight_rows(torch.tensor([0, rows - 1, 5])))


def test_fp8_tiles_stack_only_when_none_straddles_two_weights():
    fmt = FP8Format(block=(128, 128))
    assert fmt.stacks_rows([128, 256, 64]) and not fmt.stacks_rows([64, 128])
    assert GGUFFormat("Q4_K").stacks_rows([3, 5])
    assert not MLXFormat(bits=4, group=64).stacks_rows([64, 64])


@pytest.mark.parametrize(
    "make", [lambda: fp8_layer((128, 128), rows=128), lambda: gguf_layer("Q4_K")]
)
def test_stacked_rows_decode_to_the_weights_stacked(make):
    a, b = make(), make()
    assert a.fmt.stacks_rows([a.out_features, b.out_features])
    stacked = {role: torch.cat([a.tensors()[role], b.tensors()[role]]) for role in a.roles}
    got = a.fmt.dequantize_rows(stacked, slice(None), a.cols)
    assert torch.equal(got, torch.cat([a.weight_rows(slice(None)), b.weight_rows(slice(None))]))


@pytest.mark.skipif(not cpu_native.available(), reason="no C++ compiler for the native kernels")
def test_on_the_cpu_only_gguf_blocks_have_a_kernel():
    x = torch.randn(3, 512)
    gguf = gguf_layer("Q4_K")
    assert torch.allclose(
        gguf.fmt.linear(gguf, x), x @ gguf.weight_rows(slice(None)).t(), atol=1e-3
    )
    for layer in (fp8_layer((128, 128)), mlx_layer(), LAYERS["nvfp4"]()):
        assert layer.fmt.linear(layer, x) is None  # the layer multiplies dequantized rows


def test_no_format_name_is_compared_outside_the_registry():
    names = "|".join(FORMATS)
    compared = re.compile(rf"fmt\.kind|kind\s*(==|!=|in)\s*\(?[\"']({names})[\"']")
    found = [
        f"{path.relative_to(SRC)}:{i}"
        for path in SRC.rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if compared.search(line)
    ]
    assert found == []

"""Tensor parallel over quantized weights kept quantized (distributed/quantized.py): a rank's
rows or columns of a GGUF, FP8, MLX or NVFP4 layer decode to exactly those rows or columns of
the whole layer; a cut inside a format's group is refused by name; and two gloo ranks holding
halves of a packed GGUF generate what one process holding it whole generates."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from tests.gguf_writer import random_blocks
from tests.quant_writer import fp8_quantize, mlx_quantize, nvfp4_quantize
from tests.test_gguf_quantized import resident_bytes, tiny_llama_gguf
from tests.test_tensor_parallel import assert_same_outputs, generate_with

from kestrel.distributed.quantized import columns_of, padded, rows_of
from kestrel.kernels.formats import FP8Format, MLXFormat, NVFP4Format
from kestrel.kernels.quant import align_blocks
from kestrel.models.layers.quant import QuantEmbedding, QuantLinear


def gguf_layer(qtype: str, rows: int = 40, cols: int = 512) -> QuantLinear:
    blocks = random_blocks((rows, cols), GGMLQuantizationType[qtype], np.random.default_rng(0))
    return QuantLinear(torch.from_numpy(blocks), qtype, cols)


def aligned_layer(qtype: str) -> QuantLinear:
    """A GGUF layer in the layout CUDA keeps (Q6_K's blocks padded to 224 bytes)."""
    blocks, layout = align_blocks(gguf_layer(qtype).qweight, qtype)
    return QuantLinear(blocks, layout, 512)


def fp8_layer(block, rows: int = 384, cols: int = 512) -> QuantLinear:
    q, scale, _ = fp8_quantize(torch.randn(rows, cols), block)
    return QuantLinear(q, FP8Format(block=block), cols, scale=scale)


def mlx_layer(rows: int = 40, cols: int = 512) -> QuantLinear:
    t, _ = mlx_quantize(torch.randn(rows, cols), 4, 64)
    fmt = MLXFormat(bits=4, group=64)
    return QuantLinear(t["weight"], fmt, cols, scales=t["scales"], biases=t["biases"])


def nvfp4_layer(rows: int = 40, cols: int = 512) -> QuantLinear:
    t, _ = nvfp4_quantize(torch.randn(rows, cols))
    fmt = NVFP4Format(group=16)
    scales = dict(scale=t["weight_scale"], scale_2=t["weight_scale_2"])
    return QuantLinear(t["weight"], fmt, cols, **scales)


LAYERS = {
    "Q4_K": lambda: gguf_layer("Q4_K"),
    "Q6_K": lambda: gguf_layer("Q6_K"),
    "Q6_K_224": lambda: aligned_layer("Q6_K"),
    "Q8_0": lambda: gguf_layer("Q8_0"),
    "Q5_1": lambda: gguf_layer("Q5_1"),
    "fp8 128x128": lambda: fp8_layer((128, 128)),
    "fp8 per row": lambda: fp8_layer((1, 512)),
    "fp8 per tensor": lambda: fp8_layer((384, 512)),
    "mlx 4-bit": mlx_layer,
    "nvfp4": nvfp4_layer,
}


def weight(layer) -> torch.Tensor:
    return layer.weight_rows(slice(None))


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_a_ranks_rows_and_columns_decode_to_the_whole_layers(kind):
    """Rows: a tile-aligned range, a range starting mid-tile (FP8 scales then per row) and
    scattered ids (Mamba2's in_proj); columns: the second half. Exact: the same values."""
    layer = LAYERS[kind]()
    whole = weight(layer)
    ids = torch.tensor([3, 4, 5, 17, 30, 31])
    for rows in (slice(128, 256) if kind.startswith("fp8") else slice(8, 24), slice(5, 37), ids):
        part = rows_of(layer, rows)
        assert isinstance(part, QuantLinear) and type(part.fmt) is type(layer.fmt)
        assert torch.equal(weight(part), whole[rows])
    part = columns_of(layer, slice(256, 512))
    assert part.in_features == 256
    assert torch.equal(weight(part), whole[:, 256:])
    x = torch.randn(3, 256)
    torch.testing.assert_close(part(x), x @ whole[:, 256:].T)


def test_a_cut_inside_a_block_is_refused_naming_the_format():
    with pytest.raises(ValueError, match="splits Q4_K's groups of 256 columns"):
        columns_of(gguf_layer("Q4_K"), slice(128, 512))
    with pytest.raises(ValueError, match="groups of 128 columns"):
        columns_of(fp8_layer((128, 128)), slice(64, 512))
    part = columns_of(fp8_layer((1, 512)), slice(64, 512))  # one scale per row: any cut
    assert part.in_features == 448


@pytest.mark.parametrize("kind", ["Q4_K", "fp8 128x128", "mlx 4-bit", "nvfp4"])
def test_a_padded_vocabulary_shard_decodes_zeros_past_its_rows(kind):
    layer = LAYERS[kind]()
    table = QuantEmbedding(
        layer.qweight, layer.fmt, layer.cols, torch.float32,
        **{r: t for r, t in layer.tensors().items() if r != "qweight"},
    )  # fmt: skip
    rows = rows_of(table, slice(0, 25))
    grown = padded(rows, 32)
    assert isinstance(grown, QuantEmbedding) and grown.num_embeddings == 32
    ids = torch.arange(32)
    assert torch.equal(grown(ids)[:25], table(ids[:25]))
    assert not grown(ids)[25:].any()


def test_packed_gguf_over_two_ranks_generates_what_one_process_generates(tmp_path):
    """Q8_0 (blocks of 32): two gloo ranks each hold half of every projection's blocks, the
    embedding's and the tied head's, kept packed, and give the tokens and first-step log-probs
    of one process holding the file packed."""
    path = str(tiny_llama_gguf(tmp_path / "q8.gguf", "Q8_0"))
    want = generate_with(path, quantized_weights="keep")
    got = generate_with(path, quantized_weights="keep", tensor_parallel_size=2)
    assert_same_outputs(got, want)


def test_each_rank_loads_half_of_the_packed_blocks(tmp_path):
    """`load_sharded` with the blocks kept: every projection, the embedding and the head stay
    quantized, and a rank holds about half of the whole model's bytes."""
    from kestrel.config import build_config
    from kestrel.distributed.group import TPGroup
    from kestrel.distributed.tensor_parallel import load_sharded
    from kestrel.loading import load_model

    path = str(tiny_llama_gguf(tmp_path / "q4k.gguf", "Q8_0"))
    config = build_config(model=path, quantized_weights="keep")
    whole = resident_bytes(load_model(config, torch.device("cpu"), progress=False)[0])
    for rank in (0, 1):
        model, _, _ = load_sharded(config, torch.device("cpu"), TPGroup(rank, 2), False, False)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert isinstance(attn.q_proj, QuantLinear) and attn.q_proj.out_features == 128
        assert isinstance(attn.o_proj.part, QuantLinear) and attn.o_proj.part.in_features == 128
        assert isinstance(mlp.down_proj.part, QuantLinear)
        assert isinstance(model.model.embed_tokens.rows, QuantEmbedding)
        assert isinstance(model.lm_head.part, QuantLinear)
        assert resident_bytes(model) < 0.6 * whole


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_packed_expert_stacks_shard_as_their_dequantized_values(tmp_path, expert_parallel):
    """A rank's part of a GGUF file's packed expert stacks (a slice of each expert's width, or
    whole experts) holds the values of the same part of the stacks dequantized at load."""
    from tests.test_gguf_quantized import load, tiny_moe_gguf

    from kestrel.distributed.group import TPGroup
    from kestrel.distributed.tensor_parallel import shard_model
    from kestrel.models.layers.moe import Experts

    path = tiny_moe_gguf(tmp_path / "moe.gguf", "Q8_0")  # other layers' cuts split no block
    for rank in (0, 1):
        parts = []
        for packed in (True, False):
            model = shard_model(load(path, packed), TPGroup(rank, 2), expert_parallel)
            parts.append([m for m in model.modules() if isinstance(m, Experts)])
        assert parts[0]
        for got, want in zip(*parts, strict=True):
            assert not got.packed
            for name in ("gate_up_proj", "down_proj"):
                torch.testing.assert_close(getattr(got, name), getattr(want, name))

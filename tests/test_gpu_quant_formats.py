"""Quantized safetensors checkpoints on CUDA (GPU only; skipped elsewhere): FP8 weights decode
(a few rows) in a Triton GEMV that agrees with the dequantized weights to bfloat16 rounding,
inside CUDA graphs too; larger batches with one scale per row or per tensor multiply on the FP8
tensor cores (`torch._scaled_mm`, activations quantized per row on the fly), 128 x 128 tiled
ones on the block-scaled GEMM, and agree with the dequantized weights to FP8 activation
rounding; the other formats dequantize inside the layer
and agree to bfloat16 rounding; the weights stay in their checkpoint bytes on the GPU, and decode
under CUDA graphs gives the eager tokens. MoE experts stay quantized in every format, the fused
MoE kernels reading the chosen experts dequantized."""

import pytest
import torch
import torch.nn.functional as F
from tests.quant_writer import fp8_quantize
from tests.reference import chunked_logits
from tests.test_paged_cache import prompts, run_to_end
from tests.test_quant_formats import FORMATS, PROMPT, write_glm_pair, write_pair

from kestrel.config import CacheConfig
from kestrel.engine.paged_runner import PagedRunner
from kestrel.engine.request import Request
from kestrel.kernels import fp8_activations
from kestrel.kernels.formats import FP8Format
from kestrel.kernels.quant import fp8_block_gemm_works, fp8_groups
from kestrel.models.layers.moe import PackedStack
from kestrel.models.layers.quant import QuantLinear
from kestrel.sampling import SamplingParams
from kestrel.weights.loader import load_model, resolve

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("block", [(1, 640), (300, 640), (128, 128), (32, 256)])  # row, tensor
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_decode_gemv_matches_dequantized(block, dtype):
    """Rows not a multiple of the GEMV's tile, columns not a multiple of its step (640)."""
    torch.manual_seed(0)
    w = torch.randn(300, 640)
    q, scale, dequantized = fp8_quantize(w, block)
    layer = QuantLinear(q.to(CUDA), FP8Format(block=block), 640, scale=scale.to(CUDA))
    x = torch.randn(3, 640, device=CUDA, dtype=dtype)
    expected = F.linear(x.float(), dequantized.to(CUDA))
    assert relative_error(layer(x), expected) < (1e-5 if dtype == torch.float32 else 0.01)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(x)
    graph.replay()
    assert relative_error(captured, expected) < (1e-5 if dtype == torch.float32 else 0.01)


@pytest.mark.parametrize("rows", [9, 256])
def test_fp8_row_scaled_linear_uses_the_tensor_cores_and_matches_dequantized(rows):
    torch.manual_seed(0)
    w = torch.randn(512, 256)
    q, scale, dequantized = fp8_quantize(w, (1, 256))
    layer = QuantLinear(q.to(CUDA), FP8Format(block=(1, 256)), 256, scale=scale.to(CUDA))
    assert layer.fp8_scale is not None  # the _scaled_mm path
    x = torch.randn(rows, 256, device=CUDA, dtype=torch.bfloat16)
    expected = F.linear(x.float(), dequantized.to(CUDA))
    assert relative_error(layer(x), expected) < 0.04  # e4m3 activations: 3 mantissa bits


@pytest.mark.parametrize("rows", [9, 256])
def test_fp8_block_scaled_linear_uses_the_tensor_cores_and_matches_dequantized(rows):
    # 128 x 128 tiles (DeepSeek-V3 / Qwen3-FP8): H200 with torch's block-scaled scaled_mm
    assert fp8_block_gemm_works(CUDA)
    torch.manual_seed(0)
    w = torch.randn(384, 512)
    q, scale, dequantized = fp8_quantize(w, (128, 128))
    layer = QuantLinear(q.to(CUDA), FP8Format(block=(128, 128)), 512, scale=scale.to(CUDA))
    assert layer.fp8_tiles is not None and layer.fp8_scale is None
    x = torch.randn(rows, 512, device=CUDA, dtype=torch.bfloat16)
    expected = F.linear(x.float(), dequantized.to(CUDA))
    assert relative_error(layer(x), expected) < 0.04


@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_activation_kernel_writes_the_bytes_of_the_pytorch_quantization(rows, dtype):
    """One Triton kernel (kernels/fp8_activations.py) in place of PyTorch's six: the same FP8
    bytes and scales, the padding rows zero, an all-zero group included; x a row slice of a
    wider tensor (its own row stride)."""
    torch.manual_seed(0)
    wide = torch.randn(rows, 640, device=CUDA) * torch.rand(rows, 1, device=CUDA) * 100
    x = wide.to(dtype)[:, :512]
    x[0, 128:256] = 0
    got_q, got_scales = fp8_activations.quantize(x)
    want_q, want_scales = fp8_groups(x)
    assert got_q.shape == want_q.shape == (rows + (-rows % 4), 512)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert got_scales.stride() == want_scales.stride() and torch.equal(got_scales, want_scales)


def load(folder, dtype=torch.bfloat16):
    return load_model(resolve(str(folder)), dtype, CUDA, progress=False)


@pytest.mark.parametrize("key", sorted(FORMATS))
def test_quantized_checkpoint_on_cuda_matches_its_dequantized_values(key, tmp_path):
    quant, floats = write_pair(tmp_path, key)
    model, reference = load(quant), load(floats, torch.float32)
    with torch.no_grad():
        got = chunked_logits(model, PROMPT, 5)
        expected = chunked_logits(reference, PROMPT, 5)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    fp8_cores = any(getattr(m, "fp8_scale", None) is not None for m in layers) or any(
        getattr(m, "fp8_tiles", None) is not None for m in layers
    )
    assert fp8_cores == key.startswith("fp8")  # fp8-block's head (320 rows) dequantizes
    assert relative_error(got, expected) < (0.06 if fp8_cores else 0.02)


def test_quantized_weights_stay_in_checkpoint_bytes_on_the_gpu(tmp_path):
    quant, floats = write_pair(tmp_path, "nvfp4-modelopt")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = load(quant)
    packed = torch.cuda.memory_allocated() - before
    dense = load(floats)
    assert packed < (torch.cuda.memory_allocated() - before - packed) / 2  # bf16 embedding in both
    del model, dense


def eager_and_graph_tokens(model) -> list:
    """Greedy tokens of a few requests on the paged runner, eager and under CUDA graphs."""
    outputs = []
    for graphs in (False, True):
        config = CacheConfig(block_size=16, num_blocks=200)
        runner = PagedRunner(model, CUDA, 4, 9, 256, config, cuda_graphs=graphs)
        reqs = [
            Request(f"q{i}", p, SamplingParams(temperature=0), 16)
            for i, p in enumerate(prompts(9, 4, 13))
        ]
        run_to_end(runner, reqs, max_num_seqs=4, prefill_chunk_size=5)
        outputs.append([r.output_ids for r in reqs])
    return outputs


@pytest.mark.parametrize("key", ["fp8-channel", "fp8-block", "nvfp4-modelopt", "mlx-4"])
def test_cuda_graph_decode_gives_the_eager_tokens(key, tmp_path):
    eager, graphs = eager_and_graph_tokens(load(write_pair(tmp_path, key)[0]))
    assert eager == graphs


def write_glm(tmp_path, key: str):
    fmt, options, _, _ = FORMATS[key]
    return write_glm_pair(tmp_path, key, {**options, "group": 16} if fmt == "mlx" else options)


@pytest.mark.parametrize("key", ["mlx-4", "fp8-block", "fp8-tensor", "nvfp4-compressed"])
def test_quantized_moe_experts_on_cuda_match_their_dequantized_values(key, tmp_path):
    quant, floats = write_glm(tmp_path, key)
    model, reference = load(quant), load(floats, torch.float32)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts.gate_up_proj, PackedStack) and isinstance(
        experts.down_proj, PackedStack
    )
    ids = [(i * 37 + 11) % 128 for i in range(20)]
    with torch.no_grad():
        expected = chunked_logits(reference, ids, len(ids))
        for chunk in (len(ids), 1):  # a prefill-sized step, then decode-sized ones
            got = chunked_logits(model, ids, chunk)
            assert relative_error(got, expected) < (0.06 if key.startswith("fp8") else 0.02)


@pytest.mark.parametrize("key", ["fp8-block", "mlx-4"])
def test_quantized_moe_cuda_graph_decode_gives_the_eager_tokens(key, tmp_path):
    eager, graphs = eager_and_graph_tokens(load(write_glm(tmp_path, key)[0]))
    assert eager == graphs

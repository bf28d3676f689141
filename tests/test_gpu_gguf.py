"""GGUF blocks kept packed on CUDA (GPU only; skipped elsewhere): the Triton GEMVs equal the
PyTorch decoding followed by a matmul, for every type they read, inside CUDA graphs too; a packed
tiny model decodes the tokens of the same file dequantized at load; `--quantized-weights auto`
keeps blocks packed only for a model that would not fit dense in half the GPU."""

import pytest
import torch
from tests.test_gguf_quantized import tiny_llama_gguf, tiny_moe_gguf
from tests.test_paged_cache import prompts, run_to_end

from kestrel.config import CacheConfig
from kestrel.engine.paged_runner import PagedRunner
from kestrel.engine.request import Request
from kestrel.kernels import gguf_dp4a
from kestrel.kernels.gguf_gemv import K_QUANTS, TYPES, gemv
from kestrel.kernels.quant import ALIGNED, BLOCKS, align_blocks, dequantize
from kestrel.models.layers.moe import Experts, PackedStack
from kestrel.models.layers.quant import Quantized, QuantLinear
from kestrel.sampling import SamplingParams
from kestrel.weights.loader import keep_packed, load_model, resolve

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# the float16 fields of each type's blocks
SCALE_OFFSETS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}  # fmt: skip


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path / "cache"))


def random_blocks(qtype: str, rows: int, cols: int) -> torch.Tensor:
    """Random bytes in layout `qtype` with small, finite float16 scales (a padded layout's
    blocks padded as the loader pads them): (rows, row bytes)."""
    file_type = next((t for t, layout in ALIGNED.items() if layout == qtype), qtype)
    elements, size = BLOCKS[file_type]
    blocks = torch.randint(0, 256, (rows, cols // elements, size), dtype=torch.uint8)
    for offset in SCALE_OFFSETS[file_type]:
        scales = (torch.rand(rows, cols // elements) * 0.02 + 0.001).half()
        blocks[:, :, offset : offset + 2] = scales.view(torch.uint8).reshape(rows, -1, 2)
    blocks = blocks.reshape(rows, -1)
    if file_type != qtype:  # the padded layout, as the loader pads the file's blocks
        blocks = align_blocks(blocks, file_type)[0]
    return blocks.to(CUDA)


@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_equals_dequantize_then_matmul(qtype, dtype):
    """Rows not a multiple of the tile; the 32-element types with a row that ends inside a tile
    of eight blocks (576 columns)."""
    torch.manual_seed(0)
    cols = 768 if qtype in K_QUANTS else 576
    blocks = random_blocks(qtype, 37, cols)
    x = torch.randn(3, cols, device=CUDA).to(dtype)
    expected = x.float() @ dequantize(blocks, qtype, cols).T
    tol = dict(rtol=2e-2, atol=2e-1) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(gemv(x, blocks, qtype, cols).float(), expected, **tol)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv(x, blocks, qtype, cols)
    graph.replay()
    torch.testing.assert_close(captured.float(), expected, **tol)


@pytest.mark.parametrize("qtype", sorted(gguf_dp4a.TYPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_gemv_equals_the_quantized_x_times_dequantize(qtype, dtype):
    """The dp4a kernels compute x's int8 rounding (`quantize`) times W exactly, up to float
    summation order: 3 super-blocks (a step of two ends inside the row), rows not a multiple of
    the tile, 1 and 5 rows of x, inside a CUDA graph too; and the rounding stays within 1% of
    x's largest value per group."""
    torch.manual_seed(0)
    blocks = random_blocks(qtype, 37, 768)
    weights = dequantize(blocks, qtype, 768)
    for rows in (1, 5):
        x = torch.randn(rows, 768, device=CUDA).to(dtype)
        words, info = gguf_dp4a.quantize(x)
        q = words.view(torch.int8).float().reshape(rows, -1, 32)
        rounded = (q * info[:, :, :1]).reshape(rows, 768)
        groups = x.float().reshape(rows, -1, 32)
        error = (rounded.reshape(groups.shape) - groups).abs().amax(2)
        assert (error <= groups.abs().amax(2) / 127 / 2 + 1e-6).all()
        expected = (rounded @ weights.T).to(dtype).float()
        tol = dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(gguf_dp4a.gemv(x, blocks, qtype, 768).float(), expected, **tol)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gguf_dp4a.gemv(x, blocks, qtype, 768)
        graph.replay()
        torch.testing.assert_close(captured.float(), expected, **tol)


@pytest.mark.parametrize("qtype", sorted(ALIGNED.values()))
def test_padded_layout_gives_the_outputs_of_the_files_blocks(qtype):
    """The GEMVs read the padded blocks (`Q6_K_224`) to the very outputs they give on the
    file's own (210-byte Q6_K blocks), dense and per expert."""
    torch.manual_seed(0)
    padded = random_blocks(qtype, 5 * 24, 512)
    file_type = next(t for t, layout in ALIGNED.items() if layout == qtype)
    blocks = padded.view(5 * 24, 2, -1)[:, :, : BLOCKS[file_type][1]].reshape(5 * 24, -1)
    x = torch.randn(3, 512, device=CUDA, dtype=torch.bfloat16)
    for gemv_of, xs in ((gguf_dp4a.gemv, x), (gemv, x), (gemv, x.float())):
        assert torch.equal(gemv_of(xs, padded, qtype, 512), gemv_of(xs, blocks, file_type, 512))
    experts, scale = torch.tensor([4, 0, 0, 2, 4, 1], device=CUDA), torch.rand(6, device=CUDA)
    stacked = [(b.view(5, 24, -1), t) for b, t in ((blocks, file_type), (padded, qtype))]
    outs = [gguf_dp4a.expert_gemv(x, b, t, 512, experts, scale) for b, t in stacked]
    assert torch.equal(*outs)


def test_q6_k_file_loads_on_cuda_in_224_byte_blocks(tmp_path):
    """On CUDA a Q6_K file's linears and tied embedding hold 224-byte blocks whose weights are
    the file's, bit for bit; the CPU keeps the file's 210-byte blocks."""
    path = tiny_llama_gguf(tmp_path / "q6_k.gguf", "Q6_K")
    on_cuda = load_model(resolve(str(path)), torch.float32, CUDA, False, True)
    on_cpu = load_model(resolve(str(path)), torch.float32, torch.device("cpu"), False, True)
    pairs = [
        (a, b)
        for a, b in zip(on_cuda.modules(), on_cpu.modules(), strict=True)
        if isinstance(a, Quantized)
    ]
    assert pairs
    for a, b in pairs:
        assert (a.qtype, b.qtype) == ("Q6_K_224", "Q6_K")
        assert a.qweight.shape[1] * 210 == b.qweight.shape[1] * 224
        assert torch.equal(a.weight_rows(slice(None)).cpu(), b.weight_rows(slice(None)))


@pytest.mark.parametrize("quant", sorted(BLOCKS))
def test_packed_gguf_decodes_the_tokens_of_the_dequantized_file(quant, tmp_path):
    """fp32 on CUDA, paged runner with graphs: decode through the GEMVs, prefill through the
    dequantized matmul; greedy tokens equal those of the file dequantized at load."""
    path = tiny_llama_gguf(tmp_path / f"{quant}.gguf", quant)
    is_packed = lambda model: any(isinstance(m, QuantLinear) for m in model.modules())  # noqa: E731
    assert greedy_tokens(path, True, is_packed) == greedy_tokens(path, False, is_packed)


def greedy_tokens(path, packed: bool, is_packed) -> list[list[int]]:
    """fp32 greedy tokens of three prompts on the paged runner with graphs, the file's blocks
    kept packed or dequantized at load (`is_packed(model)` says which it got)."""
    model = load_model(resolve(str(path)), torch.float32, CUDA, False, packed)
    assert is_packed(model) == packed
    runner = PagedRunner(model, CUDA, 4, 64, 256, CacheConfig(block_size=16, num_blocks=64))
    params = SamplingParams(temperature=0)
    requests = [Request(f"q{i}", p, params, 12) for i, p in enumerate(prompts(9, 5, 14))]
    run_to_end(runner, requests, max_num_seqs=4, prefill_chunk_size=8)
    return [r.output_ids for r in requests]


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_packed_experts_equal_their_dequantized_stacks(tokens):
    """bfloat16 Q4_K/Q6_K expert stacks against the dense stacks in the fused kernels. A decode
    step (fewer pairs than experts) multiplies each pair from its expert's blocks (int8 x, so
    within a few percent of each token's output), inside a CUDA graph too; prefill (40 tokens)
    dequantizes every expert for the fused kernels, equal to bf16 rounding."""
    torch.manual_seed(0)
    E, H, inter = 8, 256, 512
    in_blocks = random_blocks("Q4_K", E * 2 * inter, H).view(E, 2 * inter, -1)
    down_blocks = random_blocks("Q6_K", E * H, inter).view(E, H, -1)
    packed, dense = Experts(E, H, inter), Experts(E, H, inter)
    for experts in (packed, dense):
        del experts.gate_up_proj, experts.down_proj
    packed.gate_up_proj = PackedStack({"qweight": in_blocks}, "Q4_K", H, torch.bfloat16)
    packed.down_proj = PackedStack({"qweight": down_blocks}, "Q6_K", inter, torch.bfloat16)
    dense.gate_up_proj = torch.nn.Parameter(packed.gate_up_proj[:], requires_grad=False)
    dense.down_proj = torch.nn.Parameter(packed.down_proj[:], requires_grad=False)
    x = torch.randn(tokens, H, device=CUDA, dtype=torch.bfloat16)
    weights = torch.rand(tokens, 2, device=CUDA)
    ids = torch.stack([torch.randperm(E, device=CUDA)[:2] for _ in range(tokens)])
    expected = dense(x, weights, ids).float()
    assert packed._reads_blocks(x, ids) == (2 * tokens <= E)

    def check(out):
        if 2 * tokens > E:
            torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
        else:
            error = (out.float() - expected).norm(dim=-1) / expected.norm(dim=-1)
            assert error.max() < 3e-2, error

    check(packed(x, weights, ids))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = packed(x, weights, ids)
    graph.replay()
    check(captured)


@pytest.mark.parametrize("qtype", sorted(gguf_dp4a.TYPES))
def test_expert_gemv_multiplies_each_pair_by_its_expert(qtype):
    """Rows of x repeated for each token's experts, experts chosen twice, the routing scale:
    each row within int8 x's rounding of the dequantized expert's product."""
    torch.manual_seed(0)
    E, N, K = 5, 96, 512
    blocks = random_blocks(qtype, E * N, K).view(E, N, -1)
    dense = dequantize(blocks.reshape(E * N, -1), qtype, K).view(E, N, K)
    x = torch.randn(3, K, device=CUDA, dtype=torch.bfloat16)
    experts = torch.tensor([4, 0, 0, 2, 4, 1], device=CUDA)
    scale = torch.rand(6, device=CUDA)
    expected = torch.stack([x[p // 2].float() @ dense[e].T for p, e in enumerate(experts.tolist())])
    for out, want in (
        (gguf_dp4a.expert_gemv(x, blocks, qtype, K, experts), expected),
        (gguf_dp4a.expert_gemv(x, blocks, qtype, K, experts, scale), expected * scale[:, None]),
    ):
        error = (out.float() - want).norm(dim=-1) / want.norm(dim=-1)
        assert error.max() < 2e-2, error
    assert out.dtype == torch.float32


def test_packed_moe_gguf_decodes_the_tokens_of_the_dequantized_file(tmp_path):
    """fp32 on CUDA, paged runner with graphs: a Q4_K MoE file with its expert stacks packed
    decodes the greedy tokens of the file dequantized at load."""
    path = tiny_moe_gguf(tmp_path / "moe.gguf", "Q4_K")
    is_packed = lambda model: isinstance(model.model.layers[1].mlp.experts.down_proj, PackedStack)  # noqa: E731
    assert greedy_tokens(path, True, is_packed) == greedy_tokens(path, False, is_packed)


def test_auto_keeps_blocks_packed_only_for_models_too_big_to_run_dense():
    total = torch.cuda.get_device_properties(CUDA).total_memory
    assert not keep_packed(CUDA, 16 << 30 if total > 64 << 30 else 1 << 30)
    assert keep_packed(CUDA, total)

"""Every Triton kernel equals its PyTorch fallback on random inputs (GPU only; skipped elsewhere).

Paged attention is checked on trimmed, sunk and sliding-window sequences, decode and prefill tiles,
with and without a window; the fused norm / activation / RoPE kernels on random rows.
"""

import pytest
import torch
import torch.nn.functional as F
from tests.kernel_checks import check_fused, check_paged_attention
from tests.quant_writer import fp8_quantize, mlx_quantize

from kestrel.kernels import attention, fused, gemv
from kestrel.kernels.attention import FP8
from kestrel.kernels.formats import FP8Format
from kestrel.kernels.moe import QuantStack, fused_experts, route
from kestrel.models.layers.moe import Experts, grouped_matmul, route_topk

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [1, 7])
@pytest.mark.parametrize("window", [None, 16])
def test_paged_attention_kernel_matches_fallback(dtype, chunk, window):
    check_paged_attention(attention.paged_attention_triton, "cuda", dtype, chunk, window)


@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (4, 1, 256), (32, 8, 128)])
def test_paged_attention_kernel_head_shapes(hq, hkv, d):
    check_paged_attention(
        attention.paged_attention_triton, "cuda", torch.bfloat16, 1, None, hq, hkv, d
    )
    check_paged_attention(
        attention.paged_attention_triton, "cuda", torch.bfloat16, 5, None, hq, hkv, d
    )


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize(
    "hq,hkv,d,bs,value_dim,tile_tokens,lengths",
    [
        (8, 2, 64, 16, None, 4, (37, 90, 70)),  # GQA on small blocks
        (8, 2, 512, 64, None, 4, (37, 90, 70)),  # gemma4's wide heads
        (32, 8, 128, 64, None, 4, (1500, 3100, 2200)),  # long contexts: split keys in decode
        (20, 1, 576, 64, 512, 1, (37, 900, 70)),  # GLM-4.7-Flash's latent
    ],
)
def test_paged_attention_kernel_reads_an_fp8_pool(
    hq, hkv, d, bs, value_dim, tile_tokens, lengths, window
):
    # e4m3 keys and values with per-head scales, widened in the kernel: prefill and decode
    for chunk in (1, 7):
        check_paged_attention(
            attention.paged_attention_triton, "cuda", torch.bfloat16, chunk, window, hq, hkv, d,
            bs, value_dim, tile_tokens, lengths, kv_dtype=FP8,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hq,hkv,d,bs,value_dim", [(32, 8, 128, 64, None), (20, 1, 576, 64, 512), (8, 2, 64, 16, None)]
)
def test_paged_attention_kernel_splits_long_contexts_in_decode(dtype, hq, hkv, d, bs, value_dim):
    # one decode token over thousands of keys: each sequence's keys are cut in parts over
    # several programs and merged (llama3-8b's heads, GLM-4.7-Flash's latent, small blocks)
    for window in (None, 300):
        check_paged_attention(
            attention.paged_attention_triton,
            "cuda",
            dtype,
            1,
            window,
            hq,
            hkv,
            d,
            bs,
            value_dim,
            lengths=(1500, 3100, 2200),
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hq,hkv,d,tile_tokens", [(8, 2, 512, 4), (32, 4, 512, 4), (16, 16, 256, 8)]
)
def test_paged_attention_kernel_wide_heads_in_big_blocks(dtype, hq, hkv, d, tile_tokens):
    # gemma4's shapes on the default 64-token blocks: the kernel splits groups and blocks
    for chunk in (1, 9):
        check_paged_attention(
            attention.paged_attention_triton,
            "cuda",
            dtype,
            chunk,
            None,
            hq,
            hkv,
            d,
            64,
            None,
            tile_tokens,
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,rank,rope", [(20, 512, 64), (40, 256, 32), (4, 8, 4)])
def test_paged_attention_kernel_latent_values_inside_keys(dtype, hq, rank, rope):
    # MLA in latent space: GLM-4.7-Flash's, MiniCPM3's and a tiny test model's shapes
    for chunk, bs in ((1, 64), (6, 64), (6, 16)):
        check_paged_attention(
            attention.paged_attention_triton,
            "cuda",
            dtype,
            chunk,
            None,
            hq,
            1,
            rank + rope,
            bs,
            rank,
            1,
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_kernels_match_fallbacks(dtype):
    check_fused("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(1056, 2560), (64, 2048), (37, 200), (5, 8), (2560, 6400)])
def test_gemv_equals_linear(dtype, n, k):
    """The one-row GEMV equals F.linear (with and without a bias, K not a multiple of a loop
    step, N not of a program's rows), and gives fp32 logits as the MoE router asks."""
    torch.manual_seed(n)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    assert gemv.serves(x, w) and not gemv.serves(torch.cat([x, x]), w)
    for b in (None, bias):
        torch.testing.assert_close(gemv.gemv(x, w, b), F.linear(x, w, b), rtol=1e-2, atol=1e-2)
    exact = F.linear(x.float(), w.float())
    torch.testing.assert_close(
        gemv.gemv(x, w, out_dtype=torch.float32), exact, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_expert_matmul_matches_one_matmul_per_expert(dtype):
    """The MoE's grouped GEMM (PyTorch's on Hopper in bf16), with experts that get no rows,
    equals a matmul per expert; so does its form under CUDA-graph capture."""
    torch.manual_seed(0)
    experts, k, n = 8, 64, 96
    weights = torch.randn(experts, n, k, device="cuda", dtype=dtype) / 8
    counts = torch.tensor([3, 0, 17, 1, 0, 9, 30, 4], device="cuda")
    ends = counts.cumsum(0)
    xs = torch.randn(int(ends[-1]), k, device="cuda", dtype=dtype)
    bounds = [0, *ends.tolist()]
    expected = torch.cat([xs[bounds[e] : bounds[e + 1]] @ weights[e].t() for e in range(experts)])
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grouped_matmul(xs, weights, ends), expected, **tol)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = grouped_matmul(xs, weights, ends)
    graph.replay()
    torch.testing.assert_close(captured, expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_rope_norm_kernel_equals_the_pytorch_layers(dtype, interleaved):
    """MLA's fused RoPE + latent norm equals layers/rope.py and RMSNorm, 20 heads (not a power
    of two), GLM-4.7-Flash's widths; the queries are rotated in place."""
    from kestrel.models.layers.norm import RMSNorm
    from kestrel.models.layers.rope import apply_rope, apply_rope_interleaved

    torch.manual_seed(1)
    T, H, dn, dr, r = 9, 20, 192, 64, 512
    q = torch.randn(T, H, dn + dr, device="cuda", dtype=dtype)
    kv_a = torch.randn(T, r + dr, device="cuda", dtype=dtype)
    norm = RMSNorm(r, 1e-5).to("cuda", dtype)
    torch.nn.init.normal_(norm.weight)
    angles = torch.randn(T, dr // 2, device="cuda")
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    rope = apply_rope_interleaved if interleaved else apply_rope
    want_q = torch.cat([q[..., :dn], rope(q[..., dn:], cos, sin)], dim=-1)
    want_kv = torch.cat([norm(kv_a[:, :r]), rope(kv_a[:, None, r:], cos, sin)[:, 0]], dim=-1)
    kv = fused.mla_rope_norm(q, kv_a, norm.weight, 1e-5, cos, sin, r, interleaved)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(kv, want_kv, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
# decode's pair GEMVs (P <= E): one token reads its rows together (k = 3 pads its pairs to 4),
# 2-3 tokens one row set at a time; sorted blocks; few pairs on a width no GEMV chunk divides
@pytest.mark.parametrize(
    "tokens,inter,k", [(1, 72, 4), (1, 72, 3), (3, 72, 4), (2, 72, 8), (40, 72, 4), (2, 34, 4)]
)
@pytest.mark.parametrize(
    "act,gated", [("silu", True), ("gelu_pytorch_tanh", True), ("relu2", False)]
)
def test_fused_experts_equal_the_pytorch_experts(dtype, tokens, inter, k, act, gated):
    """The fused MoE kernels equal the PyTorch experts (run on the CPU in fp32 on the same
    weights), with widths that are not whole tiles, also under graph capture."""
    torch.manual_seed(tokens)
    experts = Experts(16, 200, inter, act, gated)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(tokens, 200)
    weights, ids = route_topk(torch.randn(tokens, 16), k)
    expected = experts(x, weights, ids)
    gpu = experts.to("cuda", dtype)
    args = (x.to("cuda", dtype), gpu.in_proj, gpu.down_proj, weights.cuda(), ids.cuda(), act, gated)
    tol = dict(rtol=3e-2, atol=3e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_experts(*args).float().cpu(), expected, **tol)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = fused_experts(*args)
    graph.replay()
    torch.testing.assert_close(captured.float().cpu(), expected, **tol)


def quant_stack(kind: str, E: int, N: int, K: int) -> tuple[QuantStack, torch.Tensor]:
    """A random expert stack (E, N, K) as the kernels read it in `kind` and its dequantized
    values, quantized by tests/quant_writer.py (FP8: 128 x 128 tiles, per row once stacked)."""
    parts, dense = [], []
    for _ in range(E):
        w = torch.randn(N, K) * 0.1
        if kind == "fp8":
            q, scale, values = fp8_quantize(w, (128, 128))
            _, t = FP8Format(block=(128, 128)).by_row({"qweight": q, "scale": scale}, N)
            parts.append({"values": q, "scales": t["scale"]})
        else:
            t, values = mlx_quantize(w, int(kind[-1]), 32)
            words = t["weight"].view(torch.int32)
            parts.append({"values": words, "scales": t["scales"], "biases": t["biases"]})
        dense.append(values)
    stacked = {role: torch.stack([p[role] for p in parts]).cuda() for role in parts[0]}
    bits, group = (0, 128) if kind == "fp8" else (int(kind[-1]), 32)
    stack = QuantStack(stacked["values"], stacked["scales"], stacked.get("biases"), bits, group)
    return stack, torch.stack(dense)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 40])  # decode's pair GEMVs (P <= E), sorted blocks
@pytest.mark.parametrize("kind", ["fp8", "mlx4", "mlx8"])
def test_fused_experts_read_quantized_stacks_as_their_dequantized_values(dtype, tokens, kind):
    """FP8 and MLX stacks read quantized in the kernels give what the kernels give on the same
    stacks dequantized first (widths not whole tiles, FP8's last tile clipped)."""
    torch.manual_seed(tokens)
    E, H, inter = 16, 192, 96
    w_in, dense_in = quant_stack(kind, E, 2 * inter, H)
    w_down, dense_down = quant_stack(kind, E, H, inter)
    x = torch.randn(tokens, H, device="cuda", dtype=dtype)
    weights, ids = route_topk(torch.randn(tokens, E, device="cuda"), 4)
    dense = (dense_in.to("cuda", dtype), dense_down.to("cuda", dtype))
    expected = fused_experts(x, *dense, weights, ids, "silu", True)
    got = fused_experts(x, w_in, w_down, weights, ids, "silu", True)
    # The GEMVs scale each chunk's float32 sum once, where the bf16 stack rounds each weight
    # first: bf16's tolerance. The sorted GEMMs round every tile as the dequantized stack is.
    gemv_bf16 = dtype == torch.bfloat16 and tokens < 40
    tol = dict(rtol=3e-2, atol=3e-2) if gemv_bf16 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got, expected, **tol)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = fused_experts(x, w_in, w_down, weights, ids, "silu", True)
    graph.replay()
    torch.testing.assert_close(captured, expected, **tol)


@pytest.mark.parametrize(
    "experts,k,scoring,bias,normalize,scaling",
    [(64, 4, "sigmoid", True, True, 1.8), (128, 8, "softmax", False, True, 1.0),
     (60, 6, "sigmoid", False, False, 2.5), (8, 2, "softmax", False, False, 1.0)],
)  # fmt: skip
def test_route_kernel_equals_route_topk(experts, k, scoring, bias, normalize, scaling):
    """The one-kernel router picks the experts `route_topk` picks (best first), same weights."""
    torch.manual_seed(experts)
    logits = torch.randn(37, experts)
    correction = torch.randn(experts) / 10 if bias else None
    want_w, want_ids = route_topk(
        logits, k, scoring, correction, normalize=normalize, scaling=scaling
    )
    on_gpu = None if correction is None else correction.cuda()
    got_w, got_ids = route(logits.cuda(), k, scoring, on_gpu, normalize, scaling)
    assert torch.equal(got_ids.cpu(), want_ids)
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=1e-5, atol=1e-6)


def test_route_kernel_picks_valid_experts_for_nan_scores():
    """A diverged row (NaN logits, as in a CUDA graph's padding rows) still routes to k real
    experts, so the expert GEMMs never index past the last one."""
    logits = torch.randn(4, 60, device="cuda")
    logits[1] = float("nan")
    logits[2, :7] = float("nan")
    _, ids = route(logits, 8, "sigmoid", None, True, 1.0)
    assert 0 <= ids.min().item() and ids.max().item() < 60


# -- Mamba decode steps, states updated in place by slot ---------------------------------------


def _states(shape, dtype=torch.float32, slots=6):
    """A state store of `slots` and the slots (b=3, in no order) the step updates."""
    store = torch.randn(slots, *shape, device="cuda").to(dtype)
    return store, torch.tensor([4, 1, 2], device="cuda")


def _assert_in_place(store, before, slots, expected_new):
    """The chosen slots hold the fallback's new states (rounded to the store's dtype); every
    other slot is untouched."""
    others = [s for s in range(store.shape[0]) if s not in slots.tolist()]
    tol = 1e-5 if store.dtype == torch.float32 else 1e-2  # an fp32 ulp may flip a bf16 rounding
    torch.testing.assert_close(store[slots], expected_new.to(store.dtype), rtol=tol, atol=tol)
    torch.testing.assert_close(store[others], before[others], rtol=0, atol=0)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_ssd_update_equals_the_mamba2_step(state_dtype):
    """In fp32 or a bf16 store (--mamba-ssm-cache-dtype), the math stays fp32."""
    from kestrel.kernels.mamba import ssd_update
    from kestrel.models.layers.mamba import ssd_step

    H, P, N = 6, 20, 24  # not powers of two: masked lanes
    store, slots = _states((H, P, N), state_dtype)
    before = store.clone()
    x, B, C = (torch.randn(3, 1, H, n, device="cuda") for n in (P, N, N))
    dt = torch.rand(3, 1, H, device="cuda")
    A = -torch.rand(H, device="cuda")
    y_ref, new = ssd_step(x, dt, A, B, C, before[slots].float())
    y = ssd_update(store, slots, x[:, 0], dt[:, 0], B[:, 0], C[:, 0], A)
    torch.testing.assert_close(y, y_ref[:, 0], rtol=1e-5, atol=1e-5)
    _assert_in_place(store, before, slots, new)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_selective_update_equals_the_mamba_step(state_dtype):
    from kestrel.kernels.mamba import selective_update
    from kestrel.models.layers.mamba import selective_scan

    D, N = 100, 12
    store, slots = _states((D, N), state_dtype)
    before = store.clone()
    x, dt = torch.randn(3, 1, D, device="cuda"), torch.rand(3, 1, D, device="cuda")
    B, C = torch.randn(3, 1, N, device="cuda"), torch.randn(3, 1, N, device="cuda")
    A = -torch.rand(D, N, device="cuda")
    y_ref, new = selective_scan(x, dt, A, B, C, before[slots].float())
    y = selective_update(store, slots, x[:, 0], dt[:, 0], B[:, 0], C[:, 0], A)
    torch.testing.assert_close(y, y_ref[:, 0], rtol=1e-5, atol=1e-5)
    _assert_in_place(store, before, slots, new)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_conv_update_equals_the_causal_conv(dtype, bias):
    from kestrel.kernels.mamba import conv_update
    from kestrel.models.layers.mamba import causal_conv

    K, channels = 4, 300
    store, slots = _states((K - 1, channels))
    store = store.to(dtype)
    before = store.clone()
    x = torch.randn(3, 1, channels, device="cuda", dtype=dtype)
    weight = torch.randn(channels, 1, K, device="cuda", dtype=dtype)
    b = torch.randn(channels, device="cuda", dtype=dtype) if bias else None
    y_ref, new = causal_conv(x, weight, b, before[slots])
    y = conv_update(store, slots, x[:, 0], weight, b)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, y_ref[:, 0], rtol=tol, atol=tol)
    _assert_in_place(store, before, slots, new)  # the window moves exactly, in any dtype


class _Gathered:
    """The paged runner's states read, stepped in PyTorch and written back (its CPU path)."""

    def __init__(self, states):
        self.states, self.slots = states, states.slots

    def in_place(self, layer_idx, attr):
        return None

    def read(self, layer_idx, attr, zeros):
        return self.states.read(layer_idx, attr, zeros)

    def write(self, layer_idx, attr, new):
        self.states.write(layer_idx, attr, new)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba2_decode_in_place_equals_the_mixers_pytorch_step(dtype, device="cuda"):
    """Nemotron-H's decode on the paged runner: conv + SiLU, the SSD step and the gated norm in
    kernels give the mixer's PyTorch step, outputs and both states, for rows in no order."""
    from kestrel.cache.paged import PoolStates, StatePool
    from kestrel.models.layers.mamba import Mamba2Mixer

    torch.manual_seed(0)
    mixer = Mamba2Mixer(0, 48, 6, 20, 24, 2, 4, 8, 1e-5, dt_limit=(0.01, 5.0)).to(device, dtype)
    with torch.no_grad():
        for name in ("dt_bias", "A_log", "D", "norm.weight", "conv1d.bias"):
            mixer.get_parameter(name).uniform_(-1, 1)
    pool = StatePool([mixer.state_shape()], 8, dtype, device)
    for store in pool.tensors():
        store.copy_(torch.randn_like(store))
    slots = torch.tensor([5, 1, 3], device=device)
    rows = torch.tensor([2, 0, 1], device=device)[:, None]
    x = torch.randn(3, 48, device=device, dtype=dtype)
    before = [t.clone() for t in pool.tensors()]
    with torch.no_grad():
        y = mixer(x, [(rows, PoolStates(pool, slots))])
        after = [t.clone() for t in pool.tensors()]
        for store, saved in zip(pool.tensors(), before, strict=True):
            store.copy_(saved)
        y_ref = mixer(x, [(rows, _Gathered(PoolStates(pool, slots)))])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    for got, want in zip(after, pool.tensors(), strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)

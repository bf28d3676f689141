"""A Triton matrix-vector product straight from FP8 weights (decode on CUDA).

y = x @ W.T for a few rows of x, W (N, K) float8_e4m3fn times a float32 scale per (rows, cols)
tile (`Format("fp8", block=...)`: 128 x 128 tiles, one per row, or one for the tensor). A
decode step reads one byte a weight instead of bfloat16's two, and x stays in bfloat16: unlike
the FP8 tensor-core GEMM (kernels/quant.py's `fp8_block_linear`), nothing quantizes the
activations, and one kernel replaces that path's six (pad, amax, scale, cast, GEMM, slice),
whose launches cost more than a decode step's GEMV. Each program owns BLOCK_N rows and walks K
in steps of BLOCK_K columns, loading the next step's weights while it computes this one's; a
step's sums are taken per 128 columns and scaled once each.

The PyTorch path (kernels/quant.py's `dequantize_rows`, then a matmul) is the CPU path and this
kernel's oracle in the GPU tests. Imports nothing from kestrel.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

GROUP = 128  # columns summed before a scale multiplies them
MAX_ROWS = 8  # rows of x a GEMV serves; more go through the tensor cores
BLOCK_N, BLOCK_K, WARPS = 8, 512, 4


def serves(x: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether `gemv` computes x (M, K) times FP8 weights with scale tiles `block`: CUDA,
    Triton, few rows, and a scale that is constant over each group of 128 columns."""
    rows = x.numel() // x.shape[-1]
    whole_groups = block[1] % GROUP == 0 or block[1] >= x.shape[-1]
    return triton is not None and x.is_cuda and rows <= MAX_ROWS and whole_groups


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
    """x (M, K) times (w * scale).T -> (M, N) in x's dtype; w (N, K) float8_e4m3fn, scale the
    float32 (tile rows, tile cols) grid of `block` tiles."""
    M, K = x.shape
    N = w.shape[0]
    x = x.contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _gemv[(triton.cdiv(N, BLOCK_N), M)](
        x, w, scale, y, N, K, w.stride(0), triton.cdiv(K, BLOCK_K), min(block[0], N),
        min(block[1], K), scale.stride(0), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=WARPS,
    )  # fmt: skip
    return y


if triton is not None:

    @triton.jit
    def _gemv(
        X, W, S, Y, N, K, w_stride, steps, tile_rows, tile_cols, scale_stride,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1).to(tl.int64)
        row = tl.where(n < N, n, 0).to(tl.int64)  # rows past N read row 0, not stored
        g = tl.arange(0, BLOCK_K // 128)  # (G,) groups of a step
        k = g[:, None] * 128 + tl.arange(0, 128)[None, :]  # (G, 128) columns of a step
        at = W + row[:, None, None] * w_stride + k[None]
        ahead = tl.load(at, mask=k[None] < K, other=0.0)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for step in range(0, steps):
            start = step * BLOCK_K
            w = ahead
            ahead = tl.load(at + start + BLOCK_K, mask=k[None] + start + BLOCK_K < K, other=0.0)
            x = tl.load(X + m * K + start + k, mask=start + k < K, other=0.0).to(tl.float32)
            part = tl.sum(w.to(tl.float32) * x[None], 2)  # (N, G)
            tiles = (row // tile_rows)[:, None] * scale_stride + ((start + g * 128) // tile_cols)
            scale = tl.load(S + tiles, mask=(start + g * 128 < K)[None, :], other=0.0)
            acc += tl.sum(part * scale, 1)
        tl.store(Y + m * N + n, acc.to(Y.dtype.element_ty), mask=n < N)

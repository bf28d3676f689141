"""A Triton matrix-vector product straight from FP8 weights (decode on CUDA).

y = x @ W.T for a few rows of x, W (N, K) float8_e4m3fn times a float32 scale per (rows, cols)
tile (`FP8Format(block=...)`: 128 x 128 tiles, one per row, or one for the tensor). A
decode step reads one byte a weight instead of bfloat16's two, and x stays in bfloat16: unlike
the FP8 tensor-core GEMM (kernels/quant.py's `fp8_block_linear`), nothing quantizes the
activations, and one kernel replaces that path's three (quantize x, GEMM, slice), whose
launches cost more than a decode step's GEMV (a GEMV on the FP8 tensor cores was tried too:
benchmarks/fp8_gemv_tensor_cores.py; for one row of x it is slower and less exact). Each program owns BLOCK_N rows and walks K
in steps of CHUNKS x 16 columns; each thread sums a (row, 16 columns) chunk on its own and
scales it once (the scale is constant over 16 columns: a tile is 128 wide or the whole row).

The loop is kernels/gemv.py's `row_sums`. The PyTorch path (kernels/formats.py's
`dequantize_rows`, then a matmul) is the CPU path and this kernel's oracle in the GPU tests.
Imports nothing from kestrel outside kestrel.kernels.
"""

import torch

from kestrel.kernels.backend import on_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

if triton is not None:
    from kestrel.kernels.gemv import row_sums

GROUP = 128  # columns summed before a scale multiplies them
SPAN = 16  # columns a thread loads at once: one 16-byte load of weights
MAX_ROWS = 8  # rows of x a GEMV serves; more go through the tensor cores
BLOCK_N, CHUNKS, WARPS = 4, 32, 2  # rows per program, SPAN-column chunks per loop step, warps
MIN_PROGRAMS = 2048  # fewer rows a program until there are this many (15 per SM)


def serves(x: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether `gemv` computes x (M, K) times FP8 weights with scale tiles `block`: CUDA,
    Triton, few rows, K a multiple of 16 and scale tiles a power-of-two multiple of 128 columns
    wide (or the whole row)."""
    rows, cols = x.numel() // x.shape[-1], x.shape[-1]
    width = block[1]  # a power of two: the kernel finds a column's tile by a shift
    whole_groups = (width % GROUP == 0 and width & (width - 1) == 0) or width >= cols
    return on_triton(x) and rows <= MAX_ROWS and whole_groups and cols % SPAN == 0


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
    """x (M, K) times (w * scale).T -> (M, N) in x's dtype; w (N, K) float8_e4m3fn, scale the
    float32 (tile rows, tile cols) grid of `block` tiles."""
    M, K = x.shape
    N = w.shape[0]
    block_n = BLOCK_N
    while block_n > 1 and triton.cdiv(N, block_n) < MIN_PROGRAMS:
        block_n //= 2  # a short matrix (k/v projections): more programs, fewer rows each
    x = x.contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _gemv[(triton.cdiv(N, block_n), M)](
        x, w, scale, y, N, K, w.stride(0), triton.cdiv(K, CHUNKS * SPAN), min(block[0], N),
        31 if block[1] >= K else block[1].bit_length() - 1, scale.stride(0),
        BLOCK_N=block_n, CHUNKS=CHUNKS, SPAN=SPAN, num_warps=WARPS,
    )  # fmt: skip
    return y


if triton is not None:

    @triton.jit
    def _gemv(
        X, W, S, Y, N, K, w_stride, steps, tile_rows, tile_shift, scale_stride,
        BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, SPAN: tl.constexpr,
    ):  # fmt: skip
        """A thread owns a (row, 16 columns) chunk: it loads the weights in one 16-byte load
        and its own copy of x's 16 values (from L1, shared by the rows' threads), and sums
        them on its own; the chunk's scale multiplies the sum. Chunks past K (the last step's
        tail) read the last chunk again and count zero, so no load needs a mask; rows past N
        recompute row N - 1 and are not stored. A column's scale tile is column >> tile_shift."""
        first = tl.program_id(0) * BLOCK_N
        m = tl.program_id(1).to(tl.int64)
        rows = tl.minimum(first + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)[:, None]
        tile_row = (rows // tile_rows) * scale_stride
        y = row_sums(
            X, W, S, S, rows, m + 0 * rows, K, w_stride, tile_row, tile_shift, steps, 1, 0,
            BLOCK_N, CHUNKS, SPAN,
        )  # fmt: skip
        lanes = first + tl.arange(0, BLOCK_N)
        tl.store(Y + m * N + lanes, y.to(Y.dtype.element_ty), mask=lanes < N)

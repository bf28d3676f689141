"""A Triton matrix-vector product for bfloat16/float16 weights: one row of x (single-stream decode).

On the small projections of the MLA and MoE families cuBLAS picks split-K kernels plus a
reduction (MiniCPM3's 2560 -> 1056 down-projection: 15 us for 5 MB) or tiles that leave the GPU
half idle. Here each program owns BLOCK_N rows and walks K in steps of CHUNKS x 8 columns; each
thread sums a (row, 8 columns) chunk, one 16-byte load, on its own, and the program adds its
chunks at the end: one kernel, no reduction pass. Its best configurations beat cuBLAS on every
decode projection of the seed families and Llama-3.1-8B up to 48 MB (benchmarks/bf16_gemv.py).
That benchmark repeats one matrix, which then stays in L2; the defaults below are the ones that
decoded faster end to end (MiniCPM3-4B 202 tok/s against 184 with the benchmark's favourite,
2 rows x 64 chunks x 2 warps, whose matrices up to 64 MB that run also took).

Its loop, `row_sums`, is also the loop of the FP8 GEMV (kernels/fp8_gemv.py) and of the MoE
pair GEMVs (kernels/moe_gemv.py), which read FP8 and MLX values in the same chunks and scale
each chunk's sum once.

`F.linear` is this kernel's oracle in the GPU tests and every other shape's path. Imports
nothing from kestrel outside kestrel.kernels.
"""

import torch
import torch.nn.functional as F

from kestrel.kernels.backend import on_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

SPAN = 8  # columns a thread loads at once: one 16-byte load of 2-byte weights
MAX_BYTES = 40 << 20  # larger matrices stay on cuBLAS
BLOCK_N, CHUNKS, WARPS = 2, 32, 4  # rows per program, SPAN-column chunks per loop step, warps
MIN_PROGRAMS = 1024  # fewer rows a program until there are this many (8 per SM)


def serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gemv` computes x @ w.T: CUDA, Triton, one row of x in w's 2-byte float dtype,
    K a multiple of 8, w at most MAX_BYTES with contiguous rows."""
    return (
        on_triton(x)
        and x.numel() == x.shape[-1]
        and x.dtype == w.dtype
        and w.dtype in (torch.bfloat16, torch.float16)
        and w.shape[1] % SPAN == 0
        and w.stride(1) == 1
        and w.numel() * 2 <= MAX_BYTES
    )


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)`, through `gemv` where it serves."""
    return gemv(x, w, bias) if serves(x, w) else F.linear(x, w, bias)


def gemv(x, w, bias=None, out_dtype=None, config=None) -> torch.Tensor:
    """x (..., K), one row, times w (N, K).T (+ bias) -> (..., N) in `out_dtype` (x's dtype by
    default; products are summed in float32 either way). `config` (BLOCK_N, CHUNKS, WARPS)
    overrides the defaults (benchmarks/bf16_gemv.py sweeps them)."""
    N, K = w.shape
    block_n, chunks, warps = config or (BLOCK_N, CHUNKS, WARPS)
    if config is None:
        while block_n > 1 and triton.cdiv(N, block_n) < MIN_PROGRAMS:
            block_n //= 2  # a short matrix: more programs, fewer rows each
    y = torch.empty(*x.shape[:-1], N, device=x.device, dtype=out_dtype or x.dtype)
    _gemv[(triton.cdiv(N, block_n),)](
        x.contiguous(), w, y, bias if bias is not None else y, N, K, w.stride(0),
        triton.cdiv(K, chunks * SPAN), HAS_BIAS=bias is not None, BLOCK_N=block_n,
        CHUNKS=chunks, SPAN=SPAN, num_warps=warps,
    )  # fmt: skip
    return y


if triton is not None:

    @triton.jit
    def _gemv(
        X, W, Y, B, N, K, w_stride, steps,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, SPAN: tl.constexpr,
    ):  # fmt: skip
        """Rows past N recompute row N - 1 and are not stored."""
        first = tl.program_id(0) * BLOCK_N
        rows = tl.minimum(first + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)[:, None]
        out = row_sums(
            X, W, W, W, rows, 0 * rows, K, w_stride, rows, 0, steps, 0, 0, BLOCK_N, CHUNKS, SPAN
        )  # one row of x; no scales
        lanes = first + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            out += tl.load(B + lanes, mask=lanes < N, other=0.0).to(tl.float32)
        tl.store(Y + lanes, out.to(Y.dtype.element_ty), mask=lanes < N)

    @triton.jit
    def row_sums(
        X, W, S, Z, rows, xm, K, w_stride, scale_rows, shift, steps,
        QUANT: tl.constexpr, BITS: tl.constexpr, R: tl.constexpr, CHUNKS: tl.constexpr,
        SPAN: tl.constexpr,
    ):  # fmt: skip
        """(R,) float32: W's rows `rows` ((R, 1), `w_stride` of W's elements apart) times rows
        `xm` ((R, 1)) of X (., K), all R loaded in each step of CHUNKS chunks of SPAN columns;
        a thread sums a (row, chunk) on its own. QUANT 0: W holds the values; 1: FP8 values, a
        chunk's sum times its scale in S; 2: MLX words of BITS-bit values, scale * sum(q * x) +
        bias * sum(x) (S, Z). A row's scales start at `scale_rows` ((R, 1)) and a column's is
        column >> shift. Chunks past K (the last step's tail) read the last chunk again and
        count zero, so no load needs a mask."""
        chunk = tl.arange(0, CHUNKS)[None, :]
        columns = tl.arange(0, SPAN)[None, None, :]
        acc = tl.zeros((R, CHUNKS), dtype=tl.float32)
        for step in range(0, steps):
            start = (step * CHUNKS + chunk) * SPAN  # (1, C) each chunk's first column
            ok = start < K
            start = tl.minimum(start, K - SPAN)
            cols = start[:, :, None] + columns  # (1, C, SPAN)
            x = tl.load(X + (xm * K)[:, :, None] + cols).to(tl.float32)  # (R, C, SPAN)
            group = scale_rows + (start >> shift)  # (R, C): the chunk's scale
            # one branch compiles (constexpr): the MLX one divides by BITS, 0 otherwise
            if QUANT == 2:
                part = _mlx_chunks(W, S, Z, group, rows * w_stride, start, x, BITS, SPAN)
            else:
                w = tl.load(W + rows[:, :, None] * w_stride + cols)  # (R, C, SPAN)
                part = tl.sum(w.to(tl.float32) * x, 2)
                if QUANT == 1:
                    part *= tl.load(S + group)
            acc += tl.where(ok, part, 0.0)
        return tl.sum(acc, 1)

    @triton.jit
    def _mlx_chunks(W, S, Z, group, row_words, start, x, BITS: tl.constexpr, SPAN: tl.constexpr):
        """(R, C): chunks of MLX words (value j of a word at bits j * BITS) times x (R, C, SPAN):
        scale * sum(q * x) + bias * sum(x)."""
        per: tl.constexpr = 32 // BITS  # values in a word
        word = tl.arange(0, SPAN // per)[None, None, :]
        words = tl.load(W + row_words[:, :, None] + (start // per)[:, :, None] + word)
        shifts = (tl.arange(0, per) * BITS)[None, None, None, :]
        q = tl.reshape((words[:, :, :, None] >> shifts) & ((1 << BITS) - 1), x.shape)
        dot = tl.sum(q.to(tl.float32) * x, 2)
        scale = tl.load(S + group).to(tl.float32)
        return scale * dot + tl.load(Z + group).to(tl.float32) * tl.sum(x, 2)

"""Activations quantized to FP8 per 1 x 128 group for the block-scaled FP8 GEMM, in one Triton
kernel.

The GEMM (kernels/quant.py's `fp8_block_linear`) multiplies x by 128 x 128-tile-scaled FP8
weights once x is FP8 too, with one float32 scale per row and group of 128 columns. Quantizing x
in PyTorch takes about six kernels (pad, cast, group max of |x|, divide and cast, and a
transposed copy of the scales); on the H200 they cost as much as the GEMM itself in a prefill
step of the 8B shape (90 against 87 ms of 201, benchmarks/README.md). This kernel reads x once and writes both outputs in
the layouts the GEMM reads, with the same arithmetic, so its bytes equal PyTorch's.
Imports nothing from kestrel outside kestrel.kernels.
"""

import torch

from kestrel.kernels.backend import on_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

GROUP = 128  # columns per activation scale (the weights' tile width)
ROWS = 16  # rows per program


def serves(x: torch.Tensor) -> bool:
    return on_triton(x) and x.stride(-1) == 1 and x.shape[-1] % GROUP == 0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (xq (M4, K) float8_e4m3fn, scales (M4, K / 128) float32, column-major), M4
    being M rounded up to a multiple of 4 (cuBLAS's alignment; the padding rows are 0). Each
    group's scale is max |x| times 1 / 448 (at least 1e-12) and xq = x / scale, rounded to
    nearest."""
    M, K = x.shape
    padded = M + (-M % 4)
    xq = torch.empty(padded, K, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(K // GROUP, padded, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(padded, ROWS), K // GROUP)
    _quantize[grid](x, xq, scales, M, padded, K, x.stride(0), ROWS=ROWS, GROUP=GROUP)
    return xq, scales.t()


if triton is not None:
    INVERSE_FP8_MAX = tl.constexpr(1 / 448)  # float8_e4m3fn's largest finite value: 448
    SMALLEST_SCALE = tl.constexpr(1e-12)  # an all-zero group's scale (its values stay 0)

    @triton.jit
    def _quantize(X, XQ, S, M, padded, K, stride, ROWS: tl.constexpr, GROUP: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        group = tl.program_id(1)
        cols = group * GROUP + tl.arange(0, GROUP)
        at = rows[:, None].to(tl.int64) * stride + cols[None, :]
        x = tl.load(X + at, mask=rows[:, None] < M, other=0.0).to(tl.float32)
        # kernels/quant.py's `fp8_groups` arithmetic: times 1 / 448, then an IEEE division
        # (Triton's float32 `/` is approximate)
        scale = tl.maximum(tl.max(tl.abs(x), 1) * INVERSE_FP8_MAX, SMALLEST_SCALE)
        q = tl.math.div_rn(x, scale[:, None]).to(tl.float8e4nv)
        inside = rows < padded
        tl.store(XQ + rows[:, None].to(tl.int64) * K + cols[None, :], q, mask=inside[:, None])
        tl.store(S + group * padded + rows, scale, mask=inside)

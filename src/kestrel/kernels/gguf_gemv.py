"""Triton matrix-vector products straight from GGUF k-quant and Q8_0 blocks (decode on CUDA).

y = x @ W.T for a few rows of x, W (N, K) kept as the file's blocks: each program decodes a tile
of BLOCK_N rows x 256 columns from the packed bytes in registers (the same float16 scales, the
same products as kernels/quant.py's PyTorch decoding) and multiplies it by x's columns, so a
decode step reads the 4-6 bits per weight the file holds instead of 16. One program row per
row of x: the weights are read from DRAM once, the other rows find them in L2.

The PyTorch path (kernels/quant.py's `dequantize`, then a matmul) is the CPU path and these
kernels' oracle in the GPU tests. Imports nothing from kestrel.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# type -> (bytes per 256 columns, kernel id)
TYPES = {"Q8_0": (8 * 34, 0), "Q4_K": (144, 1), "Q5_K": (176, 2), "Q6_K": (210, 3)}
MAX_ROWS = 8  # rows of x a GEMV serves; more go through the dequantized matmul


def serves(x: torch.Tensor, qtype: str) -> bool:
    """Whether `gemv` computes x (M, K) times weights of `qtype`: CUDA, Triton, few rows."""
    rows = x.numel() // x.shape[-1]
    return triton is not None and x.is_cuda and qtype in TYPES and rows <= MAX_ROWS


def gemv(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, cols: int, block_n: int = 8, warps: int = 4
) -> torch.Tensor:
    """x (M, K) times W.T -> (M, N) in x's dtype; blocks (N, row bytes) uint8 in `qtype`.
    `block_n` rows a program, `warps` per program (benchmarks/gguf_gemv.py --sweep)."""
    M, N = x.shape[0], blocks.shape[0]
    x = x.contiguous()
    y = torch.empty(M, N, device=x.device, dtype=torch.float32)
    _gemv[(triton.cdiv(N, block_n), M)](
        x, blocks, y, N, cols, blocks.stride(0),
        QTYPE=TYPES[qtype][1], TILE_BYTES=TYPES[qtype][0], BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    return y.to(x.dtype)


if triton is not None:

    @triton.jit
    def _f16(at, ok):
        # two little-endian bytes at `at` -> their float16 value as float32
        lo = tl.load(at, mask=ok, other=0).to(tl.uint16)
        hi = tl.load(at + 1, mask=ok, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _byte(at, ok):
        return tl.load(at, mask=ok, other=0).to(tl.int32)

    @triton.jit
    def _k_scale_min(base, s, ok):
        # Q4_K/Q5_K: the 6-bit scale and min of sub-block s (0..7) from the 12 bytes at base + 4
        lo = s < 4
        a = _byte(base + 4 + s % 4, ok)  # bytes 0-3: scales' low bits (and high bits of 4-7)
        b = _byte(base + 8 + s % 4, ok)  # bytes 4-7: mins' low bits (and high bits of 4-7)
        c = _byte(base + 12 + s % 4, ok)  # bytes 8-11: low nibbles of scales/mins 4-7
        sc = tl.where(lo, a & 63, (c & 15) | ((a >> 6) << 4))
        mn = tl.where(lo, b & 63, (c >> 4) | ((b >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _decode(base, e, ok, QTYPE: tl.constexpr):
        """(BLOCK_N, 256) float32 weights of the tile whose bytes start at `base` (BLOCK_N, 1);
        e (1, 256): the column within the tile; `ok`: the columns inside the row."""
        if QTYPE == 0:  # Q8_0: eight blocks of (f16 d, 32 int8)
            at = base + (e // 32) * 34
            q = tl.load(at + 2 + e % 32, mask=ok, other=0).to(tl.int8, bitcast=True)
            return q.to(tl.float32) * _f16(at, ok)
        elif QTYPE == 3:  # Q6_K: ql[128], qh[64], int8 scales[16], f16 d
            low = _byte(base + (e // 128) * 64 + e % 64, ok) >> (4 * ((e // 64) % 2)) & 15
            high = _byte(base + 128 + (e // 128) * 32 + e % 32, ok) >> (2 * ((e // 32) % 4)) & 3
            q = ((low | (high << 4)) - 32).to(tl.float32)
            sc = tl.load(base + 192 + e // 16, mask=ok, other=0).to(tl.int8, bitcast=True)
            return (_f16(base + 208, ok) * sc.to(tl.float32)) * q
        else:  # Q4_K / Q5_K: f16 d, f16 dmin, 12 scale bytes, (Q5_K: qh[32]), qs[128]
            if QTYPE == 1:
                qs = base + 16
            else:
                qs = base + 48
            q = _byte(qs + (e // 64) * 32 + e % 32, ok) >> (4 * ((e // 32) % 2)) & 15
            if QTYPE == 2:
                q = q | ((_byte(base + 16 + e % 32, ok) >> (e // 32) & 1) << 4)
            sc, mn = _k_scale_min(base, e // 32, ok)
            return (_f16(base, ok) * sc) * q.to(tl.float32) - _f16(base + 2, ok) * mn

    @triton.jit
    def _gemv(
        X, W, Y, N, K, row_bytes,
        QTYPE: tl.constexpr, TILE_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1).to(tl.int64)
        e = tl.arange(0, 256)
        live = n < N
        rows = W + tl.where(live, n, 0).to(tl.int64)[:, None] * row_bytes
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for tile in range(0, tl.cdiv(K, 256)):
            cols = tile * 256 + e
            inside = cols < K
            x = tl.load(X + m * K + cols, mask=inside, other=0.0).to(tl.float32)
            ok = live[:, None] & inside[None, :]
            w = _decode(rows + tile * TILE_BYTES, e[None, :], ok, QTYPE)
            acc += tl.sum(tl.where(ok, w, 0.0) * x[None, :], axis=1)
        tl.store(Y + m * N + n, acc, mask=live)

"""Triton matrix-vector products straight from GGUF blocks (decode on CUDA).

y = x @ W.T for a few rows of x, W (N, K) kept as the file's blocks. Each program owns BLOCK_N
rows of W and walks them 256 columns (a k-quant super-block, or eight 32-element blocks) at a
time. Why it is fast, against decoding every weight on its own:
- the quantized values load as whole words or byte runs, each thread decoding several nibbles
  from one register;
- a scale or min is decoded once per sub-block, not once per weight: each sub-block's dot
  product sum(q * x) is taken on the raw integers and scaled after (and the min times sum(x));
- integers become floats by the exponent trick (q | 0x4B000000 is the float 2^23 + q), an
  integer op and a subtraction, not the conversion unit's slow path.
So a decode step reads the 4-8 bits per weight the file holds instead of bfloat16's 16.

One program row per row of x: the weights come from DRAM once, the other rows find them in L2.
The PyTorch path (kernels/quant.py's `dequantize`, then a matmul) is the CPU path and these
kernels' oracle in the GPU tests. Imports nothing from kestrel.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# type -> (kernel id, bytes per block); the launch shapes come from `CONFIGS`
TYPES = {
    "Q4_0": (0, 18),
    "Q4_1": (1, 20),
    "Q5_0": (2, 22),
    "Q5_1": (3, 24),
    "Q8_0": (4, 34),
    "Q4_K": (5, 144),
    "Q5_K": (6, 176),
    "Q6_K": (7, 210),
}
# type -> (rows per program, 256-column tiles per loop step, warps): benchmarks/gguf_gemv.py
# --sweep on the H200
CONFIGS = {qtype: (8, 4, 4) for qtype in TYPES}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # 256-element super-blocks; the rest hold 32 elements
MAX_ROWS = 8  # rows of x a GEMV serves; more go through the dequantized matmul
MIN_PROGRAMS = 256  # fewer rows a program until there are this many (about 2 per SM)


def serves(x: torch.Tensor, qtype: str) -> bool:
    """Whether `gemv` computes x (M, K) times weights of `qtype`: CUDA, Triton, few rows."""
    rows = x.numel() // x.shape[-1]
    return triton is not None and x.is_cuda and qtype in TYPES and rows <= MAX_ROWS


def gemv(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, cols: int, config: tuple | None = None
) -> torch.Tensor:
    """x (M, K) times W.T -> (M, N) in x's dtype; blocks (N, row bytes) uint8 in `qtype`.
    `config` (rows per program, tiles per step, warps) overrides `CONFIGS` (the sweep)."""
    kind, size = TYPES[qtype]
    M, N = x.shape[0], blocks.shape[0]
    block_n, span, warps = config or CONFIGS[qtype]
    while config is None and block_n > 2 and triton.cdiv(N, block_n) < MIN_PROGRAMS:
        block_n //= 2  # a short matrix (k/v projections): more programs, fewer rows each
    x = x.contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    words = blocks.view(torch.int32) if qtype in ("Q4_K", "Q5_K") else blocks  # 16-byte aligned
    row = blocks.stride(0)  # bytes; the float16 and int32 strides are passed whole, so Triton
    # sees their divisibility (and vectorizes the word loads)
    _gemv[(triton.cdiv(N, block_n), M)](
        x, blocks, blocks.view(torch.float16), words, y, N, cols, row, row // 2, row // 4,
        QTYPE=kind, BLOCK_BYTES=size, BLOCK_N=block_n, SPAN=span, num_warps=warps,
    )  # fmt: skip
    return y


if triton is not None:

    @triton.jit
    def _float(q, offset: tl.constexpr):
        # integers 0 <= q < 2^23 -> float32 q - offset, exactly: 0x4B000000 is 2^23 as a float
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)

    @triton.jit
    def _k_scale_min(at, s):
        # Q4_K/Q5_K: the 6-bit scales and mins of sub-blocks `s` from the 12 bytes at `at`
        low = s < 4
        a = tl.load(at + s % 4).to(tl.int32)  # bytes 0-3: scales' low bits (and high bits of 4-7)
        b = tl.load(at + 4 + s % 4).to(tl.int32)  # bytes 4-7: mins' low bits (and 4-7's high)
        c = tl.load(at + 8 + s % 4).to(tl.int32)  # bytes 8-11: low nibbles of 4-7's scale/min
        sc = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
        mn = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _q45_k(B, H, Wd, row8, row16, row32, X, step, K, QTYPE: tl.constexpr, SPAN: tl.constexpr):
        """Q4_K (f16 d, f16 dmin, 12 scale bytes, qs[128]) and Q5_K (the same, qh[32] before qs):
        sum of w * x over SPAN super-blocks for each (BLOCK_N,) row. The nibble bytes load as
        (chunks u, 8 words t): chunk u is chunk j = u % 4 of super-block u // 4, and byte
        4t + k of chunk j holds elements 64j + 4t + k (low nibble, sub-block 2j) and
        64j + 32 + 4t + k (high nibble, sub-block 2j + 1)."""
        words_per = 36 if QTYPE == 5 else 44  # the block's bytes / 4
        qs = 4 if QTYPE == 5 else 12  # word offset of qs
        u = tl.arange(0, 4 * SPAN)
        t = tl.arange(0, 8)
        j = u % 4
        sb = step * SPAN + u // 4  # (U,) super-block of each chunk
        ok = sb < K // 256
        at = row32[:, None, None] + (sb * words_per)[None, :, None]
        words = tl.load(
            Wd + at + (qs + j * 8)[None, :, None] + t[None, None, :], mask=ok[None, :, None]
        )
        if QTYPE == 6:
            high = tl.load(Wd + at + 4 + t[None, None, :], mask=ok[None, :, None])  # qh words
        half = row16[:, None] + (sb * 2 * words_per)[None, :]
        d = tl.load(H + half, mask=ok[None, :], other=0.0).to(tl.float32)
        dmin = tl.load(H + half + 1, mask=ok[None, :], other=0.0).to(tl.float32)
        scales = row8[:, None] + (sb * 4 * words_per + 4)[None, :]  # (N, U) byte offsets
        x = X + (sb * 256 + j * 64)[:, None] + t[None, :] * 4  # (U, 8) element pointers
        total = tl.zeros(d.shape, dtype=tl.float32)
        for p in tl.static_range(2):  # low nibbles: sub-blocks 2j; high: 2j + 1
            sc, mn = _k_scale_min(B + scales, (2 * j + p)[None, :])
            dot = tl.zeros(words.shape, dtype=tl.float32)
            xsum = tl.zeros((4 * SPAN, 8), dtype=tl.float32)
            for k in tl.static_range(4):
                q = (words >> (8 * k + 4 * p)) & 15
                if QTYPE == 6:  # the fifth bit: bit 2j + p of qh byte 4t + k
                    q |= ((high >> (8 * k + 2 * j[None, :, None] + p)) & 1) << 4
                xk = tl.load(x + 32 * p + k, mask=ok[:, None], other=0.0).to(tl.float32)
                dot += _float(q, 0) * xk[None]
                xsum += xk
            total += d * sc * tl.sum(dot, 2) - dmin * mn * tl.sum(xsum, 1)[None, :]
        return tl.sum(total, 1)

    @triton.jit
    def _q6_k(B, H, row8, row16, X, step, K, SPAN: tl.constexpr):
        """Q6_K (ql[128], qh[64], int8 scales[16], f16 d): element h*128 + n*64 + p*32 + l has
        low bits (nibble n of ql[h*64 + p*32 + l]) and high bits (2 bits 2(2n + p) of
        qh[h*32 + l]), scale e / 16. Loaded as (groups u, 16 bytes i): group g = u % 4 of
        super-block u // 4 holds h = g // 2 and l = 16 (g % 2) + i."""
        u = tl.arange(0, 4 * SPAN)
        i = tl.arange(0, 16)
        g = u % 4
        sb = step * SPAN + u // 4
        ok = sb < K // 256
        start = row8[:, None] + (sb * 210)[None, :]  # (N, U) byte offsets of the super-blocks
        at = B + start[:, :, None]
        qh = tl.load(at + (128 + g * 16)[None, :, None] + i[None, None, :], mask=ok[None, :, None])
        qh = qh.to(tl.int32)
        d = tl.load(H + row16[:, None] + (sb * 105 + 104)[None, :], mask=ok[None, :], other=0.0)
        spot = (g // 2) * 64 + (g % 2) * 16  # (U,): where group g starts in ql
        total = tl.zeros(d.shape, dtype=tl.float32)
        for p in tl.static_range(2):
            ql = tl.load(
                at + (spot + p * 32)[None, :, None] + i[None, None, :], mask=ok[None, :, None]
            )
            ql = ql.to(tl.int32)
            for n in tl.static_range(2):
                q = ((ql >> (4 * n)) & 15) | (((qh >> (2 * (2 * n + p))) & 3) << 4)
                e = (g // 2) * 128 + n * 64 + p * 32 + (g % 2) * 16  # (U,) first elements
                xs = tl.load(X + (sb * 256 + e)[:, None] + i[None, :], mask=ok[:, None], other=0.0)
                scale = tl.load(B + start + (192 + e // 16)[None, :], mask=ok[None, :], other=0)
                scale = scale.to(tl.int8, bitcast=True).to(tl.float32)
                total += tl.sum(_float(q, 32) * xs.to(tl.float32)[None], 2) * scale
        return tl.sum(total * d.to(tl.float32), 1)

    @triton.jit
    def _small_blocks(
        B, H, row8, row16, X, step, K,
        QTYPE: tl.constexpr, SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr,
    ):  # fmt: skip
        """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: 8 SPAN 32-element blocks (f16 d, Q4_1/Q5_1: f16 m, Q5_x:
        4 bytes of fifth bits, then the values; 4-bit values: element i < 16 the low nibble of
        byte i, 16 + i its high nibble). Blocks past K (the row's end) count zero."""
        blk = step * 8 * SPAN + tl.arange(0, 8 * SPAN)
        whole = blk < K // 32
        inside = whole[None, :]
        at = (B + row8)[:, None] + blk[None, :] * SIZE  # (N, blocks) block starts
        half = row16[:, None] + blk[None, :] * (SIZE // 2)
        d = tl.load(H + half, mask=inside, other=0.0).to(tl.float32)
        if QTYPE == 4:  # Q8_0: int8 values from byte 2
            i = tl.arange(0, 32)
            q = tl.load(at[:, :, None] + 2 + i[None, None, :], mask=inside[:, :, None], other=0)
            xs = tl.load(X + blk[:, None] * 32 + i[None, :], mask=whole[:, None], other=0.0)
            # a signed byte s is the unsigned byte b: s + 128 = b ^ 0x80
            dot = tl.sum(_float(q.to(tl.int32) ^ 0x80, 128) * xs.to(tl.float32)[None], 2)
            return tl.sum(dot * d, 1)
        else:
            i = tl.arange(0, 16)
            scaled = tl.zeros((BLOCK_N, 8 * SPAN), dtype=tl.float32)
            xsum = tl.zeros((8 * SPAN,), dtype=tl.float32)
            values: tl.constexpr = 2 + 2 * QTYPE  # byte offset of the nibbles: 2, 4, 6, 8
            qs = tl.load(at[:, :, None] + values + i[None, None, :], mask=inside[:, :, None])
            for p in tl.static_range(2):
                q = (qs.to(tl.int32) >> (4 * p)) & 15
                if QTYPE >= 2:  # bit 16p + i of the 4 bytes before the nibbles
                    bits = at[:, :, None] + values - 4 + 2 * p + i[None, None, :] // 8
                    h = tl.load(bits, mask=inside[:, :, None], other=0).to(tl.int32)
                    q |= ((h >> (i[None, None, :] % 8)) & 1) << 4
                e = blk[:, None] * 32 + 16 * p + i[None, :]
                xs = tl.load(X + e, mask=whole[:, None], other=0.0).to(tl.float32)
                if QTYPE == 0:  # w = d (q - 8)
                    scaled += tl.sum(_float(q, 8) * xs[None], 2)
                elif QTYPE == 2:  # w = d (q - 16)
                    scaled += tl.sum(_float(q, 16) * xs[None], 2)
                else:  # w = d q + m
                    scaled += tl.sum(_float(q, 0) * xs[None], 2)
                xsum += tl.sum(xs, 1)
            total = tl.sum(scaled * d, 1)
            if QTYPE % 2 == 1:
                m = tl.load(H + half + 1, mask=inside, other=0.0).to(tl.float32)
                total += tl.sum(m * xsum[None], 1)
            return total

    @triton.jit
    def _gemv(
        X, B, H, Wd, Y, N, K, row_bytes, row_halves, row_words,
        QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
        SPAN: tl.constexpr,
    ):  # fmt: skip
        """B, H, Wd: the blocks as bytes, float16 and (Q4_K/Q5_K) int32 words. Each step of
        the loop takes SPAN x 256 columns, so every thread has several loads in flight."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1).to(tl.int64)
        live = n < N
        row = tl.where(live, n, 0).to(tl.int64)  # dead rows read row 0
        row8, row16, row32 = row * row_bytes, row * row_halves, row * row_words
        x = X + m * K
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for step in range(0, tl.cdiv(K, 256 * SPAN)):
            if QTYPE == 5 or QTYPE == 6:
                acc += _q45_k(B, H, Wd, row8, row16, row32, x, step, K, QTYPE, SPAN)
            elif QTYPE == 7:
                acc += _q6_k(B, H, row8, row16, x, step, K, SPAN)
            else:
                acc += _small_blocks(
                    B, H, row8, row16, x, step, K, QTYPE, BLOCK_BYTES, BLOCK_N, SPAN
                )
        tl.store(Y + m * N + n, acc.to(Y.dtype.element_ty), mask=live)

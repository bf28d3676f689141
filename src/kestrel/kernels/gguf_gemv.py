"""Triton matrix-vector products straight from GGUF blocks (decode on CUDA).

y = x @ W.T for a few rows of x, W (N, K) kept as the file's blocks. Each program owns BLOCK_N
rows of W and walks them 256 columns (a k-quant super-block, or eight 32-element blocks) at a
time. What it does instead of decoding every weight on its own:
- the quantized values load as whole words or byte runs, each thread decoding several nibbles
  from one register;
- a scale or min is decoded once per sub-block, not once per weight: each sub-block's dot
  product sum(q * x) is taken on the raw integers and scaled after (and the min times sum(x));
- integers become floats by the exponent trick (q | 0x4B000000 is the float 2^23 + q), an
  integer op and a subtraction, not the conversion unit's slow path; and a value is read where
  it lies in its word (x is scaled by a power of two instead), so masking it out and setting
  the exponent is a single instruction with no shift.
So a decode step reads the 4-8 bits per weight the file holds instead of bfloat16's 16. On the
H200 these kernels still take about as long per matrix as bfloat16's: they issue some 7-9
instructions per weight, so they are bound by instructions, not bytes (benchmarks/README.md,
"Quantized weights on the H200"); integer dot products (dp4a) on pre-quantized x are the next
step.

One program row per row of x: the weights come from DRAM once, the other rows find them in L2.
The PyTorch path (kernels/quant.py's `dequantize`, then a matmul) is the CPU path and these
kernels' oracle in the GPU tests. Imports nothing from kestrel outside kestrel.kernels.
"""

import torch

from kestrel.kernels.backend import on_triton

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
    "Q6_K_224": (7, 224),  # Q6_K padded (kernels/quant.py's `ALIGNED`)
}
# type -> (rows per program, 256-column tiles per loop step, warps): benchmarks/quantized_gemv.py
# --sweep on the H200
CONFIGS = {
    **dict.fromkeys(("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"), (2, 4, 1)),
    "Q4_K": (4, 4, 1),
    "Q5_K": (4, 4, 1),
    "Q6_K": (2, 2, 1),
    "Q6_K_224": (2, 2, 1),
}
# 256-element super-blocks; the rest hold 32 elements
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K", "Q6_K_224")
FLOAT_2_23 = 0x4B000000  # the bits of the float 2^23
MAX_ROWS = 8  # rows of x a GEMV serves; more go through the dequantized matmul
MIN_PROGRAMS = 256  # fewer rows a program until there are this many (about 2 per SM)


def serves(x: torch.Tensor, qtype: str) -> bool:
    """Whether `gemv` computes x (M, K) times weights of `qtype`: CUDA, Triton, few rows."""
    rows = x.numel() // x.shape[-1]
    return on_triton(x) and qtype in TYPES and rows <= MAX_ROWS


def gemv(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, cols: int, config: tuple | None = None
) -> torch.Tensor:
    """x (M, K) times W.T -> (M, N) in x's dtype; blocks (N, row bytes) uint8 in `qtype`.
    `config` (rows per program, tiles per step, warps) overrides `CONFIGS` (the sweep)."""
    kind, size = TYPES[qtype]
    M, N = x.shape[0], blocks.shape[0]
    block_n, span, warps = config or CONFIGS[qtype]
    while config is None and block_n > 1 and triton.cdiv(N, block_n) < MIN_PROGRAMS:
        block_n //= 2  # a short matrix (k/v projections): more programs, fewer rows each
    x = x.contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    words = blocks.view(torch.int32) if qtype in ("Q4_K", "Q5_K") else blocks  # 16-byte aligned
    row = blocks.stride(0)  # bytes; the float16 and int32 strides are passed whole, so Triton
    # sees their divisibility (and vectorizes the word loads)
    _gemv[(triton.cdiv(N, block_n), M)](
        x, blocks, blocks.view(torch.float16), words, y, N, cols, triton.cdiv(cols, 256 * span),
        row, row // 2, row // 4, FLOAT_2_23,
        QTYPE=kind, BLOCK_BYTES=size, BLOCK_N=block_n, SPAN=span, num_warps=warps,
    )  # fmt: skip
    return y


if triton is not None:

    @triton.jit
    def _float(bits, magic):
        # `bits` (an integer q shifted left by s, below bit 23) OR the float 2^23 -> q * 2^s
        return (bits | magic).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _inverse_power(s):
        # 2^-s as float32, exactly
        return 1.0 / (1 << s).to(tl.float32)

    @triton.jit
    def _rows(first, N, r: tl.constexpr, BLOCK_N: tl.constexpr):
        # (row, step offset) of the r-th load of a program: row r % BLOCK_N, r // BLOCK_N steps on
        # (one row ahead of the computation, so the last row of a step loads the next step's first)
        return tl.minimum(first + r % BLOCK_N, N - 1).to(tl.int64), r // BLOCK_N

    @triton.jit
    def _gemv(
        X, B, H, Wd, Y, N, K, steps, row_bytes, row_halves, row_words, magic,
        QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
        SPAN: tl.constexpr,
    ):  # fmt: skip
        """B, H, Wd: the blocks as bytes, float16 and (Q4_K/Q5_K) int32 words; `magic` is the
        float 2^23's bits, an argument so that masking a value and setting them is one
        instruction. Each loop step loads SPAN x 256 columns of x once and uses them for the
        program's BLOCK_N rows one after the other, so x stays in registers; each row's
        weights are loaded while the row before is computed (rows past N recompute row N - 1
        and are not stored)."""
        first = tl.program_id(0) * BLOCK_N
        m = tl.program_id(1).to(tl.int64)
        x_row = X + m * K
        lanes = tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        row, _ = _rows(first, N, 0, BLOCK_N)
        w0, w1, w2, w3, w4, w5, w6 = _load(
            B, H, Wd, row, 0, K, row_bytes, row_halves, row_words, QTYPE, BLOCK_BYTES, SPAN
        )
        for step in range(0, steps):  # of SPAN x 256 columns
            x0, x1, xsum = _x(x_row, step, K, QTYPE, SPAN)
            for r in tl.static_range(BLOCK_N):
                c0, c1, c2, c3, c4, c5, c6 = w0, w1, w2, w3, w4, w5, w6
                row, ahead = _rows(first, N, r + 1, BLOCK_N)
                w0, w1, w2, w3, w4, w5, w6 = _load(
                    B, H, Wd, row, step + ahead, K, row_bytes, row_halves, row_words,
                    QTYPE, BLOCK_BYTES, SPAN,
                )  # fmt: skip
                c = _dot(c0, c1, c2, c3, c4, c5, c6, x0, x1, xsum, magic, QTYPE, SPAN)
                acc += tl.where(lanes == r, c, 0.0)
        tl.store(Y + m * N + first + lanes, acc.to(Y.dtype.element_ty), mask=first + lanes < N)

    @triton.jit
    def _x(X, step, K, QTYPE: tl.constexpr, SPAN: tl.constexpr):
        if QTYPE == 5 or QTYPE == 6:
            return _k45_x(X, step, K, SPAN)
        elif QTYPE == 7:
            return _q6_x(X, step, K, SPAN)
        else:
            return _small_x(X, step, K, QTYPE, SPAN)

    @triton.jit
    def _load(
        B, H, Wd, row, step, K, row_bytes, row_halves, row_words,
        QTYPE: tl.constexpr, SIZE: tl.constexpr, SPAN: tl.constexpr,
    ):  # fmt: skip
        """One row's blocks for a step, as the type's seven tensors (some unused)."""
        r8, r16 = row * row_bytes, row * row_halves
        if QTYPE == 5 or QTYPE == 6:
            return _k45_load(B, H, Wd, r8, r16, row * row_words, step, K, QTYPE, SPAN)
        elif QTYPE == 7:
            return _q6_load(B, H, r8, r16, step, K, SIZE, SPAN)
        else:
            return _small_load(B, H, r8, r16, step, K, QTYPE, SIZE, SPAN)

    @triton.jit
    def _dot(c0, c1, c2, c3, c4, c5, c6, x0, x1, xsum, magic, QTYPE: tl.constexpr, SPAN):
        """The row's sum of w * x over the step, from its `_load`."""
        if QTYPE == 5 or QTYPE == 6:
            return _k45_dot(c0, c1, c2, c3, c4, c5, c6, x0, x1, xsum, magic, QTYPE, SPAN)
        elif QTYPE == 7:
            return _q6_dot(c0, c1, c2, c3, x0, xsum, magic, SPAN)
        else:
            return _small_dot(c0, c1, c2, c3, x0, xsum, magic, QTYPE)

    # Q4_K (f16 d, f16 dmin, 12 scale bytes, qs[128]) and Q5_K (the same, qh[32] before qs). A
    # step's nibble bytes load as (chunks u, 8 words t): chunk u is chunk j = u % 4 of
    # super-block u // 4, and byte k of word t holds elements 64j + 4t + k (its low nibble,
    # p = 0, sub-block 2j) and 64j + 32 + 4t + k (high nibble, p = 1, sub-block 2j + 1). Bytes
    # k = 2h + l (h, l in 0, 1) are read from the word shifted right by 16h, where the nibble
    # lies at bit s = 8l + 4p: so x is two (p, u, t, l) tiles, one per h, times 2^-s.

    @triton.jit
    def _k45_x(X, step, K, SPAN: tl.constexpr):
        u = tl.arange(0, 4 * SPAN)[None, :, None, None]
        p = tl.arange(0, 2)[:, None, None, None]
        t = tl.arange(0, 8)[None, None, :, None]
        l = tl.arange(0, 2)[None, None, None, :]  # noqa: E741
        at = (step * SPAN + u // 4) * 256 + (u % 4) * 64 + 32 * p + 4 * t + l
        x0 = tl.load(X + at, mask=at < K, other=0.0).to(tl.float32)  # bytes 0, 1 of each word
        x1 = tl.load(X + at + 2, mask=at < K, other=0.0).to(tl.float32)  # bytes 2, 3
        xsum = tl.sum(tl.sum(x0 + x1, 3), 2)  # (2, U)
        scale = _inverse_power(8 * l + 4 * p)
        return x0 * scale, x1 * scale, xsum

    @triton.jit
    def _k45_load(B, H, Wd, r8, r16, r32, step, K, QTYPE: tl.constexpr, SPAN: tl.constexpr):
        """(qs words, qh words, d, dmin, and the three scale bytes of each sub-block)."""
        words_per = 36 if QTYPE == 5 else 44  # the block's bytes / 4
        u = tl.arange(0, 4 * SPAN)
        j = u % 4
        sb = step * SPAN + u // 4  # (U,) super-block of each chunk
        ok = sb < K // 256  # past the row's end (the step after the last) loads nothing
        at = Wd + r32 + (sb * words_per)[:, None]
        t = tl.arange(0, 8)[None, :]
        qs = 4 if QTYPE == 5 else 12  # word offset of qs
        words = tl.load(at + (qs + j * 8)[:, None] + t, mask=ok[:, None], other=0)  # (U, 8)
        if QTYPE == 6:
            qh = tl.load(at + 4 + t, mask=ok[:, None], other=0)
        else:
            qh = words
        half = H + r16 + sb * 2 * words_per
        d = tl.load(half, mask=ok, other=0.0)
        dmin = tl.load(half + 1, mask=ok, other=0.0)
        s = (2 * j[None, :] + tl.arange(0, 2)[:, None]) % 4  # (2, U): sub-block 2j + p, mod 4
        at = (B + r8 + sb * 4 * words_per + 4)[None, :] + s
        a = tl.load(at, mask=ok[None, :], other=0)  # bytes 0-3: scales' low bits (4-7's high)
        b = tl.load(at + 4, mask=ok[None, :], other=0)  # bytes 4-7: mins' low bits (4-7's high)
        c = tl.load(at + 8, mask=ok[None, :], other=0)  # bytes 8-11: 4-7's low bits
        return words, qh, d, dmin, a, b, c

    @triton.jit
    def _k45_dot(words, qh, d, dmin, a, b, c, x0, x1, xsum, magic, QTYPE: tl.constexpr, SPAN):
        j = tl.arange(0, 4 * SPAN) % 4
        p = tl.arange(0, 2)[:, None, None, None]
        l = tl.arange(0, 2)[None, None, None, :]  # noqa: E741
        nibble = 15 << (8 * l + 4 * p)  # (2, 1, 1, 2): where each value lies in its half-word
        w = words[None, :, :, None]
        low, high = w & nibble, (w >> 16) & nibble
        if QTYPE == 6:  # the fifth bit: bit 2j + p of qh byte 4t + k, put at bit s + 4
            h = qh[None, :, :, None]
            shift = 2 * j[None, :, None, None] + p
            fifth = 1 << (8 * l)
            to = 4 * p + 4
            low |= ((h >> shift) & fifth) << to
            high |= ((h >> (shift + 16)) & fifth) << to
        dot = tl.sum(tl.sum(_float(low, magic) * x0 + _float(high, magic) * x1, 3), 2)  # (2, U)
        first4 = (2 * j[None, :] + tl.arange(0, 2)[:, None]) < 4  # sub-blocks 0-3
        a, b, c = a.to(tl.int32), b.to(tl.int32), c.to(tl.int32)
        sc = tl.where(first4, a & 63, (c & 15) | ((a >> 6) << 4)).to(tl.float32)
        mn = tl.where(first4, b & 63, (c >> 4) | ((b >> 6) << 4)).to(tl.float32)
        d, dmin = d.to(tl.float32), dmin.to(tl.float32)
        return tl.sum(tl.sum(d * sc * dot - dmin * mn * xsum, 1), 0)

    # Q6_K (ql[128], qh[64], int8 scales[16], f16 d): element h*128 + n*64 + p*32 + l has low
    # bits (nibble n of ql[h*64 + p*32 + l]), high bits (bits 2(2n + p) of qh[h*32 + l]) and
    # scale e / 16; its 6-bit value minus 32. A step loads (groups u, 16 bytes i): group
    # g = u % 4 of super-block u // 4 holds h = g // 2 and l = 16 (g % 2) + i. The value is
    # put together at bit 4n, where its nibble lies: x is an (n, p, u, i) tile times 2^-4n.

    @triton.jit
    def _q6_first(u, n, p):
        g = u % 4
        return (g // 2) * 128 + n * 64 + p * 32 + (g % 2) * 16  # the group's first element

    @triton.jit
    def _q6_x(X, step, K, SPAN: tl.constexpr):
        u = tl.arange(0, 4 * SPAN)[None, None, :, None]
        n = tl.arange(0, 2)[:, None, None, None]
        p = tl.arange(0, 2)[None, :, None, None]
        i = tl.arange(0, 16)[None, None, None, :]
        at = (step * SPAN + u // 4) * 256 + _q6_first(u, n, p) + i
        x = tl.load(X + at, mask=at < K, other=0.0).to(tl.float32)  # (2, 2, U, 16)
        return x * _inverse_power(4 * n), x, tl.sum(x, 3)

    @triton.jit
    def _q6_load(B, H, r8, r16, step, K, SIZE: tl.constexpr, SPAN: tl.constexpr):
        """(qh (U, 16), ql (2, U, 16), scales (2, 2, U), d (U,)) as loaded, from blocks of
        SIZE bytes (210, or 224 padded)."""
        u = tl.arange(0, 4 * SPAN)
        g = u % 4
        i = tl.arange(0, 16)[None, :]
        sb = step * SPAN + u // 4
        ok = sb < K // 256
        at = B + r8 + sb * SIZE  # (U,) super-block starts
        qh = tl.load(at[:, None] + 128 + (g * 16)[:, None] + i, mask=ok[:, None], other=0)
        spot = (g // 2) * 64 + (g % 2) * 16  # (U,): where group g starts in ql
        p = tl.arange(0, 2)[:, None, None]
        ok3 = ok[None, :, None]
        ql = tl.load(at[None, :, None] + spot[None, :, None] + 32 * p + i[None], mask=ok3, other=0)
        n3, p3 = tl.arange(0, 2)[:, None, None], tl.arange(0, 2)[None, :, None]
        first = _q6_first(u[None, None, :], n3, p3)  # (2, 2, U)
        scale = tl.load(at[None, None, :] + 192 + first // 16, mask=ok[None, None, :], other=0)
        d = tl.load(H + r16 + sb * (SIZE // 2) + 104, mask=ok, other=0.0)
        return qh, ql, scale, d, d, d, d

    @triton.jit
    def _q6_dot(qh, ql, scale, d, x, xsum, magic, SPAN: tl.constexpr):
        n = tl.arange(0, 2)[:, None, None, None]
        p = tl.arange(0, 2)[None, :, None, None]
        low = ql[None].to(tl.int32) & (15 << (4 * n))
        high = (qh[None, None].to(tl.int32) & (3 << (2 * (2 * n + p)))) << (4 - 2 * p)
        dot = tl.sum(_float(low | high, magic) * x, 3) - 32.0 * xsum  # (2, 2, U)
        scaled = tl.sum(tl.sum(dot * scale.to(tl.int8, bitcast=True).to(tl.float32), 1), 0)
        return tl.sum(scaled * d.to(tl.float32), 0)

    # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: 32-element blocks of f16 d (Q4_1/Q5_1: then f16 m; Q5_x:
    # then 4 bytes of fifth bits) and the values. 4-bit values: element i < 16 is the low
    # nibble (p = 0) of byte i, 16 + i its high nibble, read where it lies (bit 4p: x times
    # 2^-4p). A step takes 8 SPAN blocks; blocks past K (the row's end) count zero.

    @triton.jit
    def _small_x(X, step, K, QTYPE: tl.constexpr, SPAN: tl.constexpr):
        blk = step * 8 * SPAN + tl.arange(0, 8 * SPAN)
        if QTYPE == 4:  # (blocks, 32)
            at = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
            x = tl.load(X + at, mask=at < K, other=0.0).to(tl.float32)
            return x, x, tl.sum(x, 1)
        else:  # (p, blocks, 16)
            p = tl.arange(0, 2)[:, None, None]
            at = blk[None, :, None] * 32 + p * 16 + tl.arange(0, 16)[None, None, :]
            x = tl.load(X + at, mask=at < K, other=0.0).to(tl.float32)
            return x * _inverse_power(4 * p), x, tl.sum(tl.sum(x, 2), 0)

    @triton.jit
    def _small_load(
        B, H, r8, r16, step, K, QTYPE: tl.constexpr, SIZE: tl.constexpr, SPAN: tl.constexpr
    ):
        """(values, fifth-bit bytes (Q5_x), d, m (Q4_1, Q5_1)) as loaded."""
        blk = step * 8 * SPAN + tl.arange(0, 8 * SPAN)
        ok = blk < K // 32
        at = B + r8 + blk * SIZE  # (blocks,) block starts
        half = H + r16 + blk * (SIZE // 2)
        d = tl.load(half, mask=ok, other=0.0)
        if QTYPE == 4:  # Q8_0: int8 values from byte 2
            i = tl.arange(0, 32)[None, :]
            q = tl.load(at[:, None] + 2 + i, mask=ok[:, None], other=0)
            return q, q, d, d, d, d, d
        else:
            values: tl.constexpr = 2 + 2 * QTYPE  # byte offset of the nibbles: 2, 4, 6, 8
            i = tl.arange(0, 16)[None, :]
            qs = tl.load(at[:, None] + values + i, mask=ok[:, None], other=0)  # (blocks, 16)
            if QTYPE >= 2:  # bit 16p + i of the 4 bytes before the nibbles
                p = tl.arange(0, 2)[:, None, None]
                bits = at[None, :, None] + values - 4 + 2 * p + i[None] // 8
                h = tl.load(bits, mask=ok[None, :, None], other=0)  # (2, blocks, 16)
            else:
                h = qs
            if QTYPE % 2 == 1:
                m = tl.load(half + 1, mask=ok, other=0.0)
            else:
                m = d
            return qs, h, d, m, d, d, d

    @triton.jit
    def _small_dot(q, h, d, m, x, xsum, magic, QTYPE: tl.constexpr):
        d = d.to(tl.float32)
        if QTYPE == 4:  # Q8_0: a signed byte s is read as s + 128 = b ^ 0x80
            dot = tl.sum(_float(q.to(tl.int32) ^ 0x80, magic) * x, 1) - 128.0 * xsum
        else:
            p = tl.arange(0, 2)[:, None, None]
            v = q[None].to(tl.int32) & (15 << (4 * p))  # (2, blocks, 16)
            if QTYPE >= 2:  # the fifth bit, put at bit 4p + 4
                i = tl.arange(0, 16)[None, None, :]
                v |= ((h.to(tl.int32) >> (i % 8)) & 1) << (4 * p + 4)
            dot = tl.sum(tl.sum(_float(v, magic) * x, 2), 0)
            if QTYPE == 0:  # w = d (q - 8)
                dot -= 8.0 * xsum
            elif QTYPE == 2:  # w = d (q - 16)
                dot -= 16.0 * xsum
        if QTYPE % 2 == 1:  # w = d q + m
            return tl.sum(dot * d + m.to(tl.float32) * xsum, 0)
        else:
            return tl.sum(dot * d, 0)

"""Triton GEMVs for the GGUF k-quants on int8 activations (decode on CUDA, half-precision x).

y = x @ W.T for a few rows of x, W (N, K) kept as the file's Q4_K, Q5_K or Q6_K blocks. This is
llama.cpp's scheme for decode (its MMVQ kernels): x is first quantized to int8 in groups of 32,
one float scale each (`quantize`), and then a 32-bit word of four packed weights meets a word of
four int8 x values in one dp4a, four multiply-adds in one integer instruction. Decoding four
weights is one or two bit operations on a whole word, so a weight costs about two instructions
in all (three for Q6_K) where the float kernels (kernels/gguf_gemv.py) spend seven to nine: on
the H200, Q4_K reads 2.7 TB/s, 2.5x bfloat16's speed on Llama-3.1-8B's MLP shapes, and Q6_K,
whose halfword loads cost more, 1.7 TB/s (benchmarks/README.md). The price is x's rounding to
8 bits per group of 32 (a relative error near bfloat16's own), so these kernels serve bfloat16
and float16 x; float32 x keeps the float kernels, exact to float tolerance.

Each sub-block's integer dot product is scaled once: by the weights' scale (d times its 6-bit
scale) and x's group scale; the weights' offsets (Q4_K/Q5_K's min, Q6_K's 32) multiply the sum of
the group's int8 x, which `quantize` stores per 16 values. A program owns BLOCK_N rows of W and
walks K in steps of SPAN super-blocks (256 columns each); a thread owns a (row, chunk) and sums
it on its own, x's words loaded in the weights' shape (each row's thread reads its own copy
from L1), so no value crosses threads inside the loop. Chunks past the row's end read the last
super-block again and count zero, so no load needs a mask. Q6_K's blocks (210 bytes) are only
2-byte aligned in a row, so its words are put together from halfwords; on CUDA the loader pads
them to 224 bytes (`Q6_K_224`, kernels/quant.py's `ALIGNED`), read as whole words like Q4_K's.

The PyTorch path (kernels/quant.py's `dequantize`, then a matmul on the dequantized x) is these
kernels' oracle in the GPU tests. Imports nothing from kestrel outside kestrel.kernels.
"""

import os

import torch

from kestrel.kernels.backend import on_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# type -> kernel id; the launch shapes come from `CONFIGS`
TYPES = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2, "Q6_K_224": 3}
# type -> (rows per program, super-blocks per loop step, warps)
CONFIGS = {"Q4_K": (4, 4, 1), "Q5_K": (4, 4, 1), "Q6_K": (2, 4, 1), "Q6_K_224": (2, 4, 1)}
GROUP = 32  # x values per int8 scale
MAX_ROWS = 8  # rows of x a GEMV serves; more go through the dequantized matmul
MIN_PROGRAMS = 2048  # fewer rows a program until there are this many (15 per SM)
HALF_DTYPES = (torch.bfloat16, torch.float16)
# The interpreter (CPU checks of these kernels) runs no inline assembly: dp4a is emulated there
EMULATE_DP4A = os.environ.get("TRITON_INTERPRET") == "1"


def serves(x: torch.Tensor, qtype: str, max_rows: int = MAX_ROWS) -> bool:
    """Whether `gemv` computes x (M, K) times weights of `qtype`: CUDA, Triton, half-precision
    x, a k-quant, at most `max_rows` rows."""
    rows = x.numel() // x.shape[-1]
    return on_triton(x) and x.dtype in HALF_DTYPES and qtype in TYPES and rows <= max_rows


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K), K a multiple of 256 -> (its int8 values as int32 words (M, K / 4), float32
    (M, K / 32, 4): each group of 32's scale d and the sums d * q of its first 16, its last 16
    and all 32)."""
    M, K = x.shape
    words = torch.empty(M, K // 4, device=x.device, dtype=torch.int32)
    info = torch.empty(M, K // GROUP, 4, device=x.device, dtype=torch.float32)
    groups = 8  # a program's groups of 32
    _quantize[(triton.cdiv(K // GROUP, groups), M)](x, words, info, K, GROUPS=groups)
    return words, info


def gemv(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, cols: int, config: tuple | None = None
) -> torch.Tensor:
    """x (M, K) times W.T -> (M, N) in x's dtype; blocks (N, row bytes) uint8 in `qtype`.
    `config` (rows per program, super-blocks per step, warps) overrides `CONFIGS`."""
    y = torch.empty(x.shape[0], blocks.shape[0], device=x.device, dtype=x.dtype)
    return _launch(x, blocks, qtype, cols, y, config)


def expert_gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: str,
    cols: int,
    experts: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each (token, expert) pair's GEMV, from the stacked experts' blocks (E, N, row bytes): row
    p of the result is x[p // (P / T)] times expert experts[p]'s W.T, for x (T, K) and ids
    `experts` (P,) (so x's rows repeat for a token's k experts). With `scale` (P,) row p is
    multiplied by scale[p] and the result is float32, for the sum over a token's experts."""
    out_dtype = x.dtype if scale is None else torch.float32
    y = torch.empty(experts.numel(), blocks.shape[1], device=x.device, dtype=out_dtype)
    return _launch(x, blocks, qtype, cols, y, None, experts, scale)


def _launch(x, blocks, qtype, cols, y, config, experts=None, scale=None) -> torch.Tensor:
    """One `_gemv` over y's rows: quantize x once, then a program per (rows of W, row of y)."""
    kind = TYPES[qtype]
    (M, N), T = y.shape, x.shape[0]
    block_n, span, warps = config or CONFIGS[qtype]
    # pairs of an MoE read different weights: each counts towards filling the GPU
    reads = 1 if experts is None else M
    while config is None and block_n > 1 and triton.cdiv(N, block_n) * reads < MIN_PROGRAMS:
        block_n //= 2  # a short matrix (k/v projections): more programs, fewer rows each
    words, info = quantize(x.contiguous())
    row = blocks.stride(-2)  # bytes
    # Q4_K, Q5_K and Q6_K_224 blocks are 16-byte aligned: int32 words; Q6_K's only 2-byte
    unit = 2 if qtype == "Q6_K" else 4
    w = blocks.view(torch.uint16 if unit == 2 else torch.int32)
    _gemv[(triton.cdiv(N, block_n), M)](
        words, info, w, y, experts if experts is not None else y,
        scale if scale is not None else y, N, cols, triton.cdiv(cols, 256 * span), row // unit,
        M // T,
        QTYPE=kind, BLOCK_N=block_n, SPAN=span, EXPERTS=experts is not None,
        SCALED=scale is not None, EMULATE=EMULATE_DP4A, num_warps=warps,
    )  # fmt: skip
    return y


if triton is not None:

    @triton.jit
    def _quantize(X, Q, Info, K, GROUPS: tl.constexpr):
        """Each group of 32: scale d = max |x| / 127, q = x / d rounded to nearest (even), the
        words of four q (byte k of a word is q[4t + k]) and `quantize`'s four floats."""
        m = tl.program_id(1).to(tl.int64)
        g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)  # (G,) groups of 32
        h = tl.arange(0, 2)  # a group's halves
        t = tl.arange(0, 4)  # a half's words
        k = tl.arange(0, 4)[None, None, None, :]  # a word's bytes
        word = g[:, None, None] * 8 + h[None, :, None] * 4 + t[None, None, :]  # (G, 2, 4)
        at = word[:, :, :, None] * 4 + k
        x = tl.load(X + m * K + at, mask=at < K, other=0.0).to(tl.float32)  # (G, 2, 4, 4)
        amax = tl.max(tl.max(tl.max(tl.abs(x), 3), 2), 1)  # (G,)
        inverse = tl.where(amax > 0.0, 127.0 / amax, 0.0)
        rounded = x * inverse[:, None, None, None] + 12582912.0  # 1.5 * 2^23: rounds to integers
        q = (rounded - 12582912.0).to(tl.int32)
        words = tl.sum((q & 255) << (8 * k), 3)  # disjoint bytes: the sum is an OR
        tl.store(Q + m * (K // 4) + word, words, mask=word * 4 < K)
        d = amax / 127.0
        halves = tl.sum(tl.sum(q, 3), 2).to(tl.float32) * d[:, None]  # (G, 2)
        first, last = tl.split(halves)
        column = tl.arange(0, 4)[None, :]
        d, first, last = d[:, None], first[:, None], last[:, None]
        info = tl.where(
            column == 0, d, tl.where(column == 1, first, tl.where(column == 2, last, first + last))
        )
        at = (m * (K // 32) + g[:, None]) * 4 + column
        tl.store(Info + at, info, mask=g[:, None] * 32 < K)

    @triton.jit
    def _dp4a(a, b, c, EMULATE: tl.constexpr):
        """Per element: c plus the sum of the four unsigned bytes of a times the four signed
        bytes of b, as int32."""
        if EMULATE:
            total = c + tl.zeros_like(a)
            for k in tl.static_range(4):
                total += ((a >> (8 * k)) & 255) * ((b << (24 - 8 * k)) >> 24)
            return total
        else:
            return tl.inline_asm_elementwise(
                "dp4a.u32.s32 $0, $1, $2, $3;",
                "=r,r,r,r",
                [a, b, c + tl.zeros_like(a)],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )

    @triton.jit
    def _f16_low(word):
        # the float16 in a word's low half, as float32
        return (word & 65535).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _gemv(
        Q, X, W, Y, Experts, Scale, N, K, steps, row_units, repeat,
        QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr, EXPERTS: tl.constexpr,
        SCALED: tl.constexpr, EMULATE: tl.constexpr,
    ):  # fmt: skip
        """Q, X: x's words and scales from `quantize`; W the blocks as int32 words (Q4_K, Q5_K,
        Q6_K_224) or halfwords (Q6_K), `row_units` a row's length in W's units. Row m of Y takes row
        m // `repeat` of x and, with EXPERTS, expert Experts[m]'s N rows of W. Rows past N
        recompute row N - 1 and are not stored."""
        first = tl.program_id(0) * BLOCK_N
        m = tl.program_id(1).to(tl.int64)
        rows = tl.minimum(first + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
        if EXPERTS:
            rows += tl.load(Experts + m).to(tl.int64) * N
        xm = m // repeat
        acc = tl.zeros((BLOCK_N, 4 * SPAN), dtype=tl.float32)
        for step in range(0, steps):
            if QTYPE >= 2:
                acc += _q6_step(Q, X, W, rows, xm, step, K, row_units, QTYPE, SPAN, EMULATE)
            else:
                acc += _k45_step(Q, X, W, rows, xm, step, K, row_units, QTYPE, SPAN, EMULATE)
        y = tl.sum(acc, 1)
        if SCALED:
            y *= tl.load(Scale + m)
        lanes = first + tl.arange(0, BLOCK_N)
        tl.store(Y + m * N + lanes, y.to(Y.dtype.element_ty), mask=lanes < N)

    # Q4_K (f16 d, f16 dmin, 12 scale bytes, qs[128]) and Q5_K (the same, then qh[32] before qs).
    # A step takes SPAN super-blocks as chunks u (chunk j = u % 4 of super-block u // 4) of 8
    # words t: byte k of word t holds element 64j + 4t + k in its low nibble (sub-block 2j) and
    # 64j + 32 + 4t + k in its high nibble (sub-block 2j + 1), so masking a word gives four
    # values in x's order. Q5_K's fifth bit of element 32i + l is bit i of qh byte l.

    @triton.jit
    def _k45_step(
        Q, X, W, rows, m, step, K, row_words,
        QTYPE: tl.constexpr, SPAN: tl.constexpr, EMULATE: tl.constexpr,
    ):  # fmt: skip
        """(BLOCK_N, chunks): each chunk's two sub-blocks' sum of w * x. A chunk's 8 words load
        as two (rows, chunks, 4) halves, so that one thread holds a whole chunk and its
        scales."""
        words_per: tl.constexpr = 36 if QTYPE == 0 else 44  # the block's bytes / 4
        qs: tl.constexpr = 4 if QTYPE == 0 else 12  # word offset of the nibbles
        u = tl.arange(0, 4 * SPAN)
        j = u % 4
        # (U,) super-block of each chunk; past the row's end (the last step's tail) a chunk
        # reads the last one again and counts zero, so no load needs a mask
        ok = (step * SPAN + u // 4 < K // 256)[None, :]
        sb = tl.minimum(step * SPAN + u // 4, K // 256 - 1)
        block = (rows[:, None] * row_words + (sb * words_per)[None, :])[:, :, None]
        four = tl.arange(0, 4)[None, None, :]
        nibbles = W + block + (qs + j * 8)[None, :, None] + four  # (BLOCK_N, U, 4)
        w_a = tl.load(nibbles)
        w_b = tl.load(nibbles + 4)
        # x words of sub-block 2j, in w's shape (each row's thread reads its own from L1)
        xw = Q + m * (K // 4) + (sb * 64 + j * 16)[None, :, None] + four + 0 * block
        low_a, high_a = w_a & 0x0F0F0F0F, (w_a >> 4) & 0x0F0F0F0F
        low_b, high_b = w_b & 0x0F0F0F0F, (w_b >> 4) & 0x0F0F0F0F
        if QTYPE == 1:  # the fifth bits of sub-blocks 2j and 2j + 1, put at bit 4 of each byte
            qh_a = tl.load(W + block + 4 + four)
            qh_b = tl.load(W + block + 8 + four)
            shift = 2 * j[None, :, None]
            low_a |= ((qh_a >> shift) & 0x01010101) << 4
            high_a |= ((qh_a >> (shift + 1)) & 0x01010101) << 4
            low_b |= ((qh_b >> shift) & 0x01010101) << 4
            high_b |= ((qh_b >> (shift + 1)) & 0x01010101) << 4
        dot_low = _dp4a(low_a, tl.load(xw), 0, EMULATE)
        dot_low = _dp4a(low_b, tl.load(xw + 4), dot_low, EMULATE)
        dot_high = _dp4a(high_a, tl.load(xw + 8), 0, EMULATE)
        dot_high = _dp4a(high_b, tl.load(xw + 12), dot_high, EMULATE)
        d_dmin, s0, s1, s2 = _columns(tl.load(W + block + four))
        d, dmin = _f16_low(d_dmin), _f16_low(d_dmin >> 16)
        info = X + (m * (K // 32) + (sb * 8 + 2 * j)[None, :, None]) * 4 + four + 0 * block
        dx_low, _, _, sum_low = _columns(tl.load(info))
        dx_high, _, _, sum_high = _columns(tl.load(info + 4))
        sc_low, mn_low = _k_scale(s0, s1, s2, j, 0)
        sc_high, mn_high = _k_scale(s0, s1, s2, j, 1)
        dot_low = tl.sum(dot_low, 2).to(tl.float32)
        dot_high = tl.sum(dot_high, 2).to(tl.float32)
        scaled = sc_low * dx_low * dot_low + sc_high * dx_high * dot_high
        return tl.where(ok, d * scaled - dmin * (mn_low * sum_low + mn_high * sum_high), 0.0)

    @triton.jit
    def _columns(x):
        """The four columns of x (..., 4)."""
        even, odd = tl.split(tl.reshape(x, x.shape[:-1] + [2, 2]))
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        return c0, c1, c2, c3

    @triton.jit
    def _k_scale(s0, s1, s2, j, p: tl.constexpr):
        """Sub-block 2j + p's 6-bit scale and min as float32 (BLOCK_N, U), from the scale words."""
        shift = (8 * ((2 * j + p) % 4))[None, :]
        a, b, c = s0 >> shift, s1 >> shift, s2 >> shift
        first4 = (j < 2)[None, :]
        sc = tl.where(first4, a & 63, (c & 15) | ((a >> 2) & 48))
        mn = tl.where(first4, b & 63, ((c >> 4) & 15) | ((b >> 2) & 48))
        return sc.to(tl.float32), mn.to(tl.float32)

    # Q6_K (ql[128], qh[64], int8 scales[16], f16 d): element 128h + 64n + 32p + l has its low
    # 4 bits in nibble n of ql byte 64h + 32p + l, its high 2 bits at bit 2(2n + p) of qh byte
    # 32h + l, and scale (element // 16); its value minus 32. A step takes SPAN super-blocks as
    # chunks u = (h, p) (4 a super-block) of 8 words t, each word a ql word: nibble n of its
    # bytes are four values in x's order. Q6_K's words are put together from halfwords;
    # Q6_K_224's (the same bytes, then 14 of padding) load whole.

    @triton.jit
    def _words(W, at, UNIT: tl.constexpr):
        """int32 words at `at` in W's units of UNIT bytes: words, or two halfwords (little-endian)."""
        if UNIT == 4:
            return tl.load(W + at)
        else:
            low = tl.load(W + at).to(tl.uint32)
            high = tl.load(W + at + 1).to(tl.uint32)
            return (low | (high << 16)).to(tl.int32, bitcast=True)

    @triton.jit
    def _q6_values(ql, qh, p):
        """The 6-bit values (n = 0, n = 1) of a ql word and its qh word, four to a word: qh's
        bits 4n + 2p, 4n + 2p + 1 of each byte go to bits 4, 5."""
        value0 = (ql & 0x0F0F0F0F) | ((qh << (4 - 2 * p)) & 0x30303030)
        value1 = ((ql >> 4) & 0x0F0F0F0F) | ((qh >> (2 * p)) & 0x30303030)
        return value0, value1

    @triton.jit
    def _q6_step(
        Q, X, W, rows, m, step, K, row_units,
        QTYPE: tl.constexpr, SPAN: tl.constexpr, EMULATE: tl.constexpr,
    ):  # fmt: skip
        """(BLOCK_N, chunks): each chunk's four 16-value groups' sum of w * x. A chunk's 16
        values a = (l < 16) and b load as (rows, chunks, 4) words each. W's units are
        halfwords (Q6_K, QTYPE 2) or words (Q6_K_224)."""
        UNIT: tl.constexpr = 2 if QTYPE == 2 else 4  # bytes
        u = tl.arange(0, 4 * SPAN)
        h, p = (u % 4) // 2, (u % 2)[None, :, None]
        ok = (step * SPAN + u // 4 < K // 256)[None, :]  # as in `_k45_step`
        sb = tl.minimum(step * SPAN + u // 4, K // 256 - 1)
        size: tl.constexpr = (210 if QTYPE == 2 else 224) // UNIT  # a block, in W's units
        start = rows[:, None] * row_units + (sb * size)[None, :]  # (BLOCK_N, U)
        block = start[:, :, None]
        four = tl.arange(0, 4)[None, None, :]
        word = (4 // UNIT) * four  # a chunk's words, in W's units
        ql = block + ((64 // UNIT) * h)[None, :, None] + (32 // UNIT) * p + word
        qh = block + 128 // UNIT + ((32 // UNIT) * h)[None, :, None] + word
        b: tl.constexpr = 16 // UNIT  # from a chunk's values a to its values b
        value0_a, value1_a = _q6_values(_words(W, ql, UNIT), _words(W, qh, UNIT), p)
        value0_b, value1_b = _q6_values(_words(W, ql + b, UNIT), _words(W, qh + b, UNIT), p)
        group = (sb * 8 + 4 * h)[None, :, None] + p + 0 * block  # x's group of 32 (n = 0)
        xw = Q + m * (K // 4) + group * 8 + four
        dot0_a = tl.sum(_dp4a(value0_a, tl.load(xw), 0, EMULATE), 2)
        dot0_b = tl.sum(_dp4a(value0_b, tl.load(xw + 4), 0, EMULATE), 2)
        dot1_a = tl.sum(_dp4a(value1_a, tl.load(xw + 16), 0, EMULATE), 2)
        dot1_b = tl.sum(_dp4a(value1_b, tl.load(xw + 20), 0, EMULATE), 2)
        info = X + (m * (K // 32) + group) * 4 + four
        dx0, sum0_a, sum0_b, _ = _columns(tl.load(info))
        dx1, sum1_a, sum1_b, _ = _columns(tl.load(info + 8))  # n = 1
        scales0, scales1, d = _q6_scales(W, start, h, u % 2, UNIT)
        part = _q6_scaled(scales0, dx0, dot0_a, dot0_b, sum0_a, sum0_b)
        part += _q6_scaled(scales1, dx1, dot1_a, dot1_b, sum1_a, sum1_b)
        return tl.where(ok, d * part, 0.0)

    @triton.jit
    def _q6_scales(W, start, h, p, UNIT: tl.constexpr):
        """A chunk's int8 scales (a, b) of n = 0 and of n = 1 in the low 16 bits of two int32
        (BLOCK_N, U), and the block's d as float32: scale bytes 8h + 2p + (0, 1) and 4 on,
        d at byte 208."""
        if UNIT == 4:
            at = start + (48 + 2 * h)[None, :]  # the word of scales 8h .. 8h + 3
            shift = (16 * p)[None, :]
            scales0 = tl.load(W + at) >> shift
            scales1 = tl.load(W + at + 1) >> shift
            d = _f16_low(tl.load(W + start + 52))
        else:
            at = start + (96 + 4 * h + p)[None, :]
            scales0 = tl.load(W + at).to(tl.int32)
            scales1 = tl.load(W + at + 2).to(tl.int32)
            d = tl.load(W + start + 104).to(tl.float16, bitcast=True).to(tl.float32)
        return scales0, scales1, d

    @triton.jit
    def _q6_scaled(scales, dx, dot_a, dot_b, sum_a, sum_b):
        """The two 16-groups' scale * (x-scaled dot product - 32 * sum of x)."""
        scale_a = ((scales << 24) >> 24).to(tl.float32)  # the low int8
        scale_b = ((scales << 16) >> 24).to(tl.float32)
        return scale_a * (dx * dot_a.to(tl.float32) - 32.0 * sum_a) + scale_b * (
            dx * dot_b.to(tl.float32) - 32.0 * sum_b
        )

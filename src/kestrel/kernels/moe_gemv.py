"""Decode's routed experts as GEMVs: each (token, expert) pair reads its expert's rows once.

kernels/moe.py's grouped GEMMs give a decode pair a 16-row tensor-core tile of which one row is
real, over wide column tiles: at one token, GLM-4.7-Flash's four pairs made 96-192 programs on
132 SMs, too few loads in flight to stream the weights (FP8 experts read at about 1.1 TB/s on the
H100). Here a program owns BLOCK_N outputs and walks K in the loop of the bf16 and FP8 GEMVs
(kernels/gemv.py's `row_sums`), in steps of CHUNKS chunks of 16 bytes; each thread loads a
(row, chunk) in one 16-byte load, with its own copy of x's values, and sums it on its own. Two kernels: the in projection
with the activation (act(gate) * up, or act(up) ungated) per pair, then per token the down
projections of its pairs, each times its routing weight, summed in float32: the layer's output
in x's dtype, with no separate sum or cast.

A single token (up to TOGETHER_TOKENS) reads the rows an output sums together, in the same loop
steps: an output's gate and up rows, and the down rows of all the token's k experts (k rounded
up to a power of two; the padding pairs weigh zero), LOADS (row, chunk) loads a step whatever
the row count. That keeps k times the loads in flight that one expert at a time would (at one
token the down projection has only H outputs to spread). Larger batches have loads enough in
flight and read one row set at a time (reading eight experts together slowed 8-token decode).

The stacks are kernels/moe.py's: bf16/fp16/fp32 (E, N, K), FP8 values with a float32 scale per
row per group of columns, MLX 4- or 8-bit int32 words with a scale and a bias per group. A chunk
lies in one group (`serves`), so its sum is scaled once: FP8 scale * sum(w * x), MLX
scale * sum(q * x) + bias * sum(x), in float32 (the dequantized stack instead rounds each weight
to x's dtype first). Imports nothing from kestrel outside kestrel.kernels.
"""

import torch

from kestrel.kernels import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

if triton is not None:
    from kestrel.kernels.gemv import row_sums

CHUNK_BYTES = 16  # a thread's load
BLOCK_N, CHUNKS, WARPS = 4, 32, 2  # rows per program, chunks per loop step, warps
MIN_PROGRAMS = 2048  # fewer rows a program until there are this many (15 per SM)
TOGETHER_TOKENS = 1  # batches up to this many tokens read an output's rows together
ROWS = 8  # rows of W a program reads at once when together (at most)
LOADS = 128  # (row, chunk) loads a step when together: CHUNKS = LOADS / the program's rows


def span(stack) -> int:
    """Columns in a chunk of a kernels/moe.py `KernelStack`."""
    if stack.QUANT == 2:  # MLX: four int32 words of 32 / BITS values
        return CHUNK_BYTES // 4 * (32 // stack.BITS)
    return CHUNK_BYTES // stack.w.element_size()


def serves(stack, K: int) -> bool:
    """Whether the GEMVs read `stack` over K inputs: whole chunks, each in one scale group."""
    columns, group = span(stack), stack.GROUP
    return K % columns == 0 and (stack.QUANT == 0 or group >= K or group % columns == 0)


def pair_gemvs(x, w_in, w_down, weights, ids, act, gated, H, inter):
    """x (T, H) and the stacks (kernels/moe.py's `KernelStack`s) -> (T, H) in x's dtype: each
    token's sum over its pairs of weight * down(act(in(x))), for expert ids (T, k), weights
    (T, k) and `act` an activation id (kernels/fused.py's `ACTIVATION_IDS`)."""
    flat = ids.reshape(-1)
    (T, k), P = ids.shape, flat.numel()
    together = T <= TOGETHER_TOKENS
    h = x.new_empty(P, inter)
    parts = 2 if gated and together else 1  # rows of W read together per output: gate and up
    block_n, chunks, grid = _plan(inter, P, parts, together)
    _gemv_in[grid](
        x, *w_in.pointers(), _shift(w_in, H), h, flat, k, H, inter,
        triton.cdiv(H, chunks * span(w_in)),
        GATED=gated, PARTS=parts, ACT=act, QUANT=w_in.QUANT, BITS=w_in.BITS, BLOCK_N=block_n,
        CHUNKS=chunks, SPAN=span(w_in), num_warps=WARPS,
    )  # fmt: skip
    out = torch.empty(T, H, device=x.device, dtype=x.dtype)
    pairs = triton.next_power_of_2(k) if together else 1  # a token's pairs read together
    block_n, chunks, grid = _plan(H, T, pairs, together)
    _gemv_down[grid](
        h, *w_down.pointers(), _shift(w_down, inter), out,
        weights.reshape(-1).float(), flat, k, H, inter, triton.cdiv(inter, chunks * span(w_down)),
        PAIRS=pairs, QUANT=w_down.QUANT, BITS=w_down.BITS, BLOCK_N=block_n, CHUNKS=chunks,
        SPAN=span(w_down), num_warps=WARPS,
    )  # fmt: skip
    return out


def _plan(N: int, count: int, parts: int, together: bool) -> tuple[int, int, tuple[int, int]]:
    """(outputs a program computes, chunks a step reads of each of its rows, the grid) for N
    outputs of each of `count` pairs or tokens, each output a sum over `parts` rows of W that a
    program reads together."""
    block_n = max(1, ROWS // parts) if together else BLOCK_N
    while block_n > 1 and triton.cdiv(N, block_n) * count < MIN_PROGRAMS:
        block_n //= 2  # few pairs or narrow experts: more programs, fewer rows each
    chunks = max(1, LOADS // (parts * block_n)) if together else CHUNKS
    return block_n, chunks, (triton.cdiv(N, block_n), count)


def _shift(stack, K: int) -> int:
    """A column's scale group is column >> shift (groups are powers of two or span the row)."""
    return 31 if stack.GROUP >= K else stack.GROUP.bit_length() - 1


if triton is not None:

    @triton.jit
    def _row_length(K, QUANT: tl.constexpr, BITS: tl.constexpr):
        """A stack row's length in its values' units: K, or K's MLX words. Derived from K, not
        passed beside it: a separate stride kept 16 more registers live at 8 rows a program."""
        if QUANT == 2:
            return K // (32 // BITS)
        else:
            return K

    @triton.jit
    def _gemv_in(
        x,  # (T, H)
        w, s, z, groups,  # the stack (E, 2I or I, H): gate rows then up rows when gated
        shift,  # a column's scale group is column >> shift
        h,  # (P, I) out
        ids,  # (P,) each pair's expert
        k, H, inter, steps,
        GATED: tl.constexpr, PARTS: tl.constexpr, ACT: tl.constexpr, QUANT: tl.constexpr,
        BITS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, SPAN: tl.constexpr,
    ):  # fmt: skip
        """Pair p = program_id(1) (token p // k): BLOCK_N columns of its act(gate) * up, the
        gate and up rows read together (PARTS 2) or one after the other, or act(up) ungated.
        Rows past I recompute row I - 1 and are not stored."""
        p = tl.program_id(1).to(tl.int64)
        first = tl.program_id(0) * BLOCK_N
        r = tl.arange(0, PARTS * BLOCK_N)  # output r // PARTS, gate (r % PARTS 0) or up
        n = tl.minimum(first + r // PARTS, inter - 1).to(tl.int64)
        base = tl.load(ids + p).to(tl.int64) * (2 * inter if GATED else inter)
        rows = (base + (r % PARTS) * inter + n)[:, None]
        xm = p // k + 0 * rows
        acc = row_sums(
            x, w, s, z, rows, xm, H, _row_length(H, QUANT, BITS), rows * groups, shift, steps,
            QUANT, BITS, PARTS * BLOCK_N, CHUNKS, SPAN,
        )  # fmt: skip
        if PARTS == 2:
            gate, up = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
            acc = fused.activate(gate, ACT) * up
        else:
            acc = fused.activate(acc, ACT)
            if GATED:  # the up rows follow the gate rows
                up = rows + inter
                acc *= row_sums(
                    x, w, s, z, up, xm, H, _row_length(H, QUANT, BITS), up * groups, shift, steps,
                    QUANT, BITS, BLOCK_N, CHUNKS, SPAN,
                )  # fmt: skip
        lanes = first + tl.arange(0, BLOCK_N)
        tl.store(h + p * inter + lanes, acc.to(h.dtype.element_ty), mask=lanes < inter)

    @triton.jit
    def _gemv_down(
        h,  # (P, I)
        w, s, z, groups,  # the stack (E, H, I)
        shift,
        out,  # (T, H)
        weights,  # (P,) float32 routing weights
        ids, k, H, inter, steps,
        PAIRS: tl.constexpr, QUANT: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
        CHUNKS: tl.constexpr, SPAN: tl.constexpr,
    ):  # fmt: skip
        """Token t = program_id(1): BLOCK_N columns of the sum over its k pairs of the pair's
        down projection times its weight, PAIRS pairs' rows read together (1, or k rounded up
        to a power of two: pairs past k read pair k - 1 again and weigh zero)."""
        t = tl.program_id(1).to(tl.int64)
        first = tl.program_id(0) * BLOCK_N
        r = tl.arange(0, PAIRS * BLOCK_N)  # pair j + r // BLOCK_N, output r % BLOCK_N
        n = tl.minimum(first + r % BLOCK_N, H - 1).to(tl.int64)
        y = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(0, k, PAIRS):
            pair = j + r // BLOCK_N
            p = t * k + tl.minimum(pair, k - 1)
            rows = (tl.load(ids + p).to(tl.int64) * H + n)[:, None]
            part = row_sums(
                h, w, s, z, rows, p[:, None], inter, _row_length(inter, QUANT, BITS),
                rows * groups, shift, steps, QUANT, BITS, PAIRS * BLOCK_N, CHUNKS, SPAN,
            )  # fmt: skip
            part *= tl.where(pair < k, tl.load(weights + p), 0.0)
            y += tl.sum(tl.reshape(part, (PAIRS, BLOCK_N)), 0)
        lanes = first + tl.arange(0, BLOCK_N)
        tl.store(out + t * H + lanes, y.to(out.dtype.element_ty), mask=lanes < H)

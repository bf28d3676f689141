"""LoRA for a batch that mixes adapters: y += B[slot] @ (A[slot] @ x) for each token's slot.

A projection's adapters are stacked per slot: A (S, P * R, K) and B (S, N, R) with P parts side
by side (a fused q/k/v has three: part p's rows of y take A's rows [pR, (p+1)R) and B's rows of
that part), slot 0 all zeros (the base model). `slots` (T,) is each token's slot.

- CUDA: two Triton kernels after Punica's BGMV/SGMV split. `shrink` computes s = x A[slot]^T
  for each block of tokens, one pass per slot present in the block (rows of other slots load as
  zeros), split along K so that a decode step fills the GPU, into float32 partial sums;
  `expand` sums them and adds s B[slot]^T into y in place, each block of output rows within one
  part. Slots absent from a block cost a branch: graphs capture them once for any mix.
- The CPU (and any shape the kernels do not take): the tokens grouped by slot, two matmuls each.
"""

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on the CPU: how they are tested
# without a GPU (slowly)
INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_K = 64
# input columns per shrink program: a decode step's few tokens still spread over K / SPLIT_K
# programs, and the expand kernel sums the K / SPLIT_K partial sums in one unrolled pass
SPLIT_K = 512


def add_lora(y, x, a, b, slots, parts: list[int], groups=None, part_of=None) -> None:
    """y (T, N) += each token's adapter delta, in place. x (T, K); a (S, P*R, K); b (S, N, R);
    slots (T,) int32; `parts`: the P parts' widths (sum N). `groups`: (slot, rows) of the
    adapted tokens, computed once a step on the host (the CPU path; None on CUDA). `part_of`:
    `part_blocks(parts)` on y's device (the kernels' map of output blocks to parts)."""
    if groups is None and part_of is not None and serves(y, parts):
        _triton_lora(y, x.contiguous(), a, b, slots, parts, part_of)
    elif groups is None:
        _masked_lora(y, x, a, b, slots, parts)
    else:
        grouped_lora(y, x, a, b, groups, parts)


def grouped_lora(y, x, a, b, groups, parts: list[int]) -> None:
    """The tokens of each slot together: (n, K) @ A^T -> (n, P*R), then per part @ B^T."""
    for slot, rows in groups:
        xs = x if rows is None else x.index_select(0, rows)
        delta = _delta(xs @ a[slot].T, b[slot], parts)
        if rows is None:
            y += delta
        else:
            y.index_add_(0, rows, delta)


def _delta(s: torch.Tensor, b: torch.Tensor, parts: list[int]) -> torch.Tensor:
    """(n, P*R) shrunk rows, (N, R) B -> (n, N): part p's columns from s's p-th R columns."""
    r = b.shape[-1]
    if len(parts) == 1:
        return s @ b.T
    outs, start = [], 0
    for p, width in enumerate(parts):
        outs.append(s[:, p * r : (p + 1) * r] @ b[start : start + width].T)
        start += width
    return torch.cat(outs, dim=-1)


def _masked_lora(y, x, a, b, slots, parts: list[int]) -> None:
    """Graph-safe fallback: every slot over every token, the rows of other slots zeroed."""
    for slot in range(1, a.shape[0]):
        mine = (slots == slot).to(x.dtype)[:, None]
        y += _delta((x @ a[slot].T) * mine, b[slot], parts)


def serves(y: torch.Tensor, parts: list[int]) -> bool:
    """Whether the Triton kernels take this projection: CUDA, parts in blocks of 16 rows."""
    on_device = y.is_cuda or INTERPRETED
    return triton is not None and on_device and y.stride(1) == 1 and _block_n(parts) >= 16


def part_blocks(parts: list[int]) -> torch.Tensor:
    """(N / block_n,) int32: the part each expand program's block of output rows is in."""
    n = _block_n(parts)
    return torch.cat([torch.full((w // n,), p, dtype=torch.int32) for p, w in enumerate(parts)])


def _block_n(parts: list[int]) -> int:
    """Output rows per expand program: a power of two (<= 64) dividing every part's width."""
    g = math.gcd(*parts)
    return min(64, g & -g)


def _triton_lora(y, x, a, b, slots, parts: list[int], part_of: torch.Tensor) -> None:
    t, k = x.shape
    r_total, r = a.shape[1], b.shape[-1]
    block_m = 16 if t <= 64 else 64
    m_blocks = triton.cdiv(t, block_m)
    split = triton.cdiv(k, SPLIT_K)
    partial = torch.empty(split, t, r_total, dtype=torch.float32, device=x.device)
    ieee = x.dtype == torch.float32  # float32 models: no TF32 rounding in the dots
    _shrink[(m_blocks, split)](
        x, a, slots, partial, t, k, r_total, x.stride(0), a.stride(0), a.stride(1),
        a.shape[0], SPLIT_K, block_m, BLOCK_K, max(16, triton.next_power_of_2(r_total)), ieee,
    )  # fmt: skip
    block_n = _block_n(parts)
    _expand[(m_blocks, y.shape[1] // block_n)](
        partial, b, slots, y, part_of, t, r, r_total, b.stride(0), b.stride(1), y.stride(0),
        b.shape[0], split, block_m, block_n, max(16, triton.next_power_of_2(r)), ieee,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _token_rows(slot_ptr, T, BLOCK_M: tl.constexpr):
        """This program's token rows, which of them exist, and their slots (0 past T)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < T
        return rows, row_ok, tl.load(slot_ptr + rows, mask=row_ok, other=0)

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _shrink(
        x_ptr, a_ptr, slot_ptr, out_ptr, T, K, R_TOTAL, stride_x, stride_as, stride_ar,
        NUM_SLOTS, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # out[split, rows] = x[rows, split's K] @ A[slot of the row]^T (float32 partial sums);
        # rows of other slots load as zeros, so each slot's pass adds only its own rows
        rows, row_ok, slots = _token_rows(slot_ptr, T, BLOCK_M)
        r = tl.arange(0, BLOCK_R)
        r_ok = r < R_TOTAL
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k_start = tl.program_id(1) * SPLIT_K
        for s in range(1, NUM_SLOTS):
            mine = (slots == s) & row_ok
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                for k0 in tl.static_range(0, SPLIT_K, BLOCK_K):
                    ks = k_start + k0 + tl.arange(0, BLOCK_K)
                    k_ok = ks < K
                    xb = tl.load(
                        x_ptr + rows[:, None] * stride_x + ks[None, :],
                        mask=mine[:, None] & k_ok[None, :],
                        other=0.0,
                    )
                    ab = tl.load(
                        a_ptr + s * stride_as + r[None, :] * stride_ar + ks[:, None],
                        mask=r_ok[None, :] & k_ok[:, None],
                        other=0.0,
                    )
                    acc += _dot(xb, ab, IEEE)
        out = out_ptr + tl.program_id(1) * T * R_TOTAL + rows[:, None] * R_TOTAL + r[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & r_ok[None, :])

    @triton.jit
    def _expand(
        s_ptr, b_ptr, slot_ptr, y_ptr, part_ptr, T, R, R_TOTAL, stride_bs, stride_bn, stride_y,
        NUM_SLOTS, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # y[rows, cols] += (the splits' sum of s[rows, the part's R]) @ B[slot, cols]^T
        rows, row_ok, slots = _token_rows(slot_ptr, T, BLOCK_M)
        if tl.max(slots, axis=0) > 0:  # a block of base-model tokens adds nothing
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            r = tl.arange(0, BLOCK_R)
            r_ok = r < R
            part = tl.load(part_ptr + tl.program_id(1))
            s_rows = s_ptr + rows[:, None] * R_TOTAL + part * R + r[None, :]
            sv = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for i in tl.static_range(SPLIT):  # unrolled: the loads go out together
                sv += tl.load(s_rows + i * T * R_TOTAL, mask=row_ok[:, None] & r_ok[None, :])
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(1, NUM_SLOTS):
                mine = (slots == s) & row_ok
                if tl.max(mine.to(tl.int32), axis=0) > 0:
                    bb = tl.load(
                        b_ptr + s * stride_bs + cols[None, :] * stride_bn + r[:, None],
                        mask=r_ok[:, None],
                        other=0.0,
                    )
                    sm = tl.where(mine[:, None], sv, 0.0).to(bb.dtype)
                    acc += _dot(sm, bb, IEEE)
            y = y_ptr + rows[:, None] * stride_y + cols[None, :]
            old = tl.load(y, mask=row_ok[:, None])
            tl.store(y, (old.to(tl.float32) + acc).to(old.dtype), mask=row_ok[:, None])

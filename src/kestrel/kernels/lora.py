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

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK_K = 64
TARGET_PROGRAMS = 256  # shrink programs a step aims for (split-K fills the GPU at decode)


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
    return triton is not None and y.is_cuda and y.stride(1) == 1 and _block_n(parts) >= 16


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
    k_blocks = triton.cdiv(k, BLOCK_K)
    split = max(1, min(k_blocks, TARGET_PROGRAMS // m_blocks))
    split_k = triton.cdiv(k_blocks, split) * BLOCK_K  # columns per split
    split = triton.cdiv(k, split_k)
    partial = torch.empty(split, t, r_total, dtype=torch.float32, device=x.device)
    _shrink[(m_blocks, split)](
        x, a, slots, partial, t, k, r_total, x.stride(0), a.stride(0), a.stride(1),
        a.shape[0], split_k, block_m, BLOCK_K, max(16, triton.next_power_of_2(r_total)),
    )  # fmt: skip
    block_n = _block_n(parts)
    n = y.shape[1]
    _expand[(m_blocks, n // block_n)](
        partial, b, slots, y, part_of, t, r, r_total, split, b.stride(0), b.stride(1),
        y.stride(0), b.shape[0], block_m, block_n, max(16, triton.next_power_of_2(r)),
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _shrink(
        x_ptr, a_ptr, slot_ptr, out_ptr, T, K, R_TOTAL, stride_x, stride_as, stride_ar,
        NUM_SLOTS, SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        # out[split, rows] = x[rows, split's K] @ A[slot of the row]^T (float32 partial sums)
        pid_m, pid_k = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < T
        slots = tl.load(slot_ptr + rows, mask=row_ok, other=0)
        r = tl.arange(0, BLOCK_R)
        r_ok = r < R_TOTAL
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k_start = pid_k * SPLIT_K
        for s in range(1, NUM_SLOTS):
            mine = (slots == s) & row_ok
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                for k0 in range(k_start, k_start + SPLIT_K, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
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
                    acc += tl.dot(xb, ab)
        out = out_ptr + pid_k * T * R_TOTAL + rows[:, None] * R_TOTAL + r[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & r_ok[None, :])

    @triton.jit
    def _expand(
        s_ptr, b_ptr, slot_ptr, y_ptr, part_ptr, T, R, R_TOTAL, SPLIT, stride_bs, stride_bn,
        stride_y, NUM_SLOTS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        # y[rows, cols] += sum over splits of s[rows, part's R] @ B[slot, cols]^T
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < T
        slots = tl.load(slot_ptr + rows, mask=row_ok, other=0)
        if tl.max(slots, axis=0) > 0:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            r = tl.arange(0, BLOCK_R)
            r_ok = r < R
            part = tl.load(part_ptr + pid_n)
            s_rows = s_ptr + rows[:, None] * R_TOTAL + part * R + r[None, :]
            sv = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for i in range(SPLIT):
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
                    acc += tl.dot(sm, bb)
            y = y_ptr + rows[:, None] * stride_y + cols[None, :]
            old = tl.load(y, mask=row_ok[:, None])
            tl.store(y, (old.to(tl.float32) + acc).to(old.dtype), mask=row_ok[:, None])

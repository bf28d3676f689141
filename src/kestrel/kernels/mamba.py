"""Triton kernels for one decode step of Mamba layers, reading and writing each sequence's state
in place in the paged runner's state pool (by slot): one read and one write of the state per
layer, where a gather, the step and a scatter would move it four times and launch a dozen kernels.

Their PyTorch fallbacks are the models' own step functions (models/layers/mamba.py: `ssd_step`,
`selective_scan`, `causal_conv` over gathered states), which the CPU runs and the GPU tests compare
these with. This module imports nothing from kestrel outside kestrel.kernels: kernels are the
bottom of the import graph.
"""

import torch

from kestrel.kernels.backend import on_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the fallback serves
    triton = None


def available(store: torch.Tensor) -> bool:
    """Whether the in-place kernels serve a state store (on CUDA, with Triton)."""
    return on_triton(store)


if triton is not None:

    @triton.jit
    def _ssd_update(
        state,  # (S, H, P, N), fp32 or half (math in fp32)
        slots,  # (b,)
        x,  # (b, H, P)
        dt,  # (b, H)
        A,  # (H,)
        B,  # (b, H, N)
        C,  # (b, H, N)
        y,  # (b, H, P) fp32
        H,
        P,
        N,
        BLOCK_P: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        b, h, pb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(slots + b).to(tl.int64)
        p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        mp, mn = p < P, n < N
        at = state + ((slot * H + h) * P + p[:, None]) * N + n[None, :]
        mask = mp[:, None] & mn[None, :]
        s = tl.load(at, mask=mask, other=0.0).to(tl.float32)  # any stored dtype, fp32 math
        row = b * H + h
        xv = tl.load(x + row * P + p, mask=mp, other=0.0).to(tl.float32)
        d = tl.load(dt + row).to(tl.float32)
        a = tl.load(A + h).to(tl.float32)
        bv = tl.load(B + row * N + n, mask=mn, other=0.0).to(tl.float32)
        cv = tl.load(C + row * N + n, mask=mn, other=0.0).to(tl.float32)
        s = s * tl.exp(d * a) + (d * xv)[:, None] * bv[None, :]
        tl.store(at, s.to(state.dtype.element_ty), mask=mask)
        tl.store(y + row * P + p, tl.sum(s * cv[None, :], axis=1), mask=mp)

    @triton.jit
    def _selective_update(
        state,  # (S, D, N), fp32 or half (math in fp32)
        slots,  # (b,)
        x,  # (b, D)
        dt,  # (b, D)
        A,  # (D, N)
        B,  # (b, N)
        C,  # (b, N)
        y,  # (b, D) fp32
        D,
        N,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        b, db = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slots + b).to(tl.int64)
        d = db * BLOCK_D + tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        md, mn = d < D, n < N
        mask = md[:, None] & mn[None, :]
        at = state + (slot * D + d[:, None]) * N + n[None, :]
        s = tl.load(at, mask=mask, other=0.0).to(tl.float32)  # any stored dtype, fp32 math
        a = tl.load(A + d[:, None] * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
        xv = tl.load(x + b * D + d, mask=md, other=0.0).to(tl.float32)
        dv = tl.load(dt + b * D + d, mask=md, other=0.0).to(tl.float32)
        bv = tl.load(B + b * N + n, mask=mn, other=0.0).to(tl.float32)
        cv = tl.load(C + b * N + n, mask=mn, other=0.0).to(tl.float32)
        s = s * tl.exp(dv[:, None] * a) + (dv * xv)[:, None] * bv[None, :]
        tl.store(at, s.to(state.dtype.element_ty), mask=mask)
        tl.store(y + b * D + d, tl.sum(s * cv[None, :], axis=1), mask=md)

    @triton.jit
    def _conv_update(
        window,  # (S, K-1, C), the model's dtype
        slots,  # (b,)
        rows,  # (b,): the batch rows of x and y (HAS_ROWS), else rows 0..b-1
        x,  # (T, >= C), rows `x_stride` apart
        weight,  # (C, K)
        bias,  # (C,) or a dummy when HAS_BIAS is False
        y,  # (T, C)
        x_stride,
        C,
        K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        SILU: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        b, cb = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slots + b).to(tl.int64)
        if HAS_ROWS:
            r = tl.load(rows + b).to(tl.int64)
        else:
            r = b.to(tl.int64)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        mc = c < C
        xv = tl.load(x + r * x_stride + c, mask=mc, other=0.0)
        acc = xv.to(tl.float32) * tl.load(weight + c * K + K - 1, mask=mc, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias + c, mask=mc, other=0.0).to(tl.float32)
        base = window + slot * (K - 1) * C + c
        for k in tl.static_range(K - 1):  # the window, oldest first, then shifted by one
            w = tl.load(base + k * C, mask=mc, other=0.0)
            acc += w.to(tl.float32) * tl.load(weight + c * K + k, mask=mc, other=0.0).to(tl.float32)
            if k > 0:
                tl.store(base + (k - 1) * C, w, mask=mc)
        tl.store(base + (K - 2) * C, xv, mask=mc)
        if SILU:  # F.silu of the conv's output rounded to the model's dtype, as PyTorch runs it
            acc = acc.to(y.dtype.element_ty).to(tl.float32)
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y + r * C + c, acc.to(y.dtype.element_ty), mask=mc)

    @triton.jit
    def _ssd_decode(
        state,  # (S, H, P, N), fp32 or half (math in fp32)
        slots,  # (b,)
        rows,  # (b,): the batch rows of xbc, dt and y
        xbc,  # (T, H*P + 2*G*N): x, B, C after the conv, rows `xbc_stride` apart
        dt,  # (T, >= H) before its bias and softplus, rows `dt_stride` apart
        dt_bias,  # (H,)
        A_log,  # (H,)
        D,  # (H,)
        y,  # (T, H, P) fp32
        xbc_stride,
        dt_stride,
        dt_min,
        dt_max,
        H,
        P,
        N,
        G,
        BLOCK_P: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        b, h, pb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(slots + b).to(tl.int64)
        r = tl.load(rows + b).to(tl.int64)
        g = h // (H // G)  # B and C are shared by the heads of a group
        p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        mp, mn = p < P, n < N
        src = xbc + r * xbc_stride
        xv = tl.load(src + h * P + p, mask=mp, other=0.0).to(tl.float32)
        bv = tl.load(src + H * P + g * N + n, mask=mn, other=0.0).to(tl.float32)
        cv = tl.load(src + H * P + (G + g) * N + n, mask=mn, other=0.0).to(tl.float32)
        d = tl.load(dt + r * dt_stride + h).to(tl.float32) + tl.load(dt_bias + h).to(tl.float32)
        d = tl.where(d > 20.0, d, tl.log(1.0 + tl.exp(d)))  # softplus, PyTorch's threshold
        d = tl.minimum(tl.maximum(d, dt_min), dt_max)
        a = -tl.exp(tl.load(A_log + h).to(tl.float32))
        at = state + ((slot * H + h) * P + p[:, None]) * N + n[None, :]
        mask = mp[:, None] & mn[None, :]
        s = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        s = s * tl.exp(d * a) + (d * xv)[:, None] * bv[None, :]
        tl.store(at, s.to(state.dtype.element_ty), mask=mask)
        out = tl.sum(s * cv[None, :], axis=1) + tl.load(D + h).to(tl.float32) * xv
        tl.store(y + (r * H + h) * P + p, out, mask=mp)

    @triton.jit
    def _gated_rms_norm(
        x,  # (T, W * groups)
        gate,  # (T, >= W * groups), rows `gate_stride` apart
        weight,  # (W * groups,)
        out,  # (T, W * groups)
        gate_stride,
        W,
        eps,
        BLOCK: tl.constexpr,
    ):
        r, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
        width = W * tl.num_programs(1)
        c = g * W + tl.arange(0, BLOCK)
        m = tl.arange(0, BLOCK) < W
        z = tl.load(gate + r * gate_stride + c, mask=m, other=0.0).to(tl.float32)
        v = tl.load(x + r * width + c, mask=m, other=0.0).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
        v = v * tl.rsqrt(tl.sum(v * v, axis=0) / W + eps)
        v = v.to(x.dtype.element_ty).to(tl.float32)  # rounded to x's dtype, then weighted
        w = tl.load(weight + c, mask=m, other=0.0).to(tl.float32)
        tl.store(out + r * width + c, (w * v).to(out.dtype.element_ty), mask=m)


def ssd_update(state, slots, x, dt, B, C, A) -> torch.Tensor:
    """Mamba2's step for b sequences, their states updated in place. state: (S, H, P, N) (any float),
    slots: (b,), x: (b, H, P), dt: (b, H) (after softplus), B/C: (b, H, N), A: (H,) -> y (b, H, P)
    fp32 (before the D skip)."""
    b, H, P = x.shape
    N = state.shape[-1]
    y = torch.empty(b, H, P, device=x.device, dtype=torch.float32)
    block_p = min(32, triton.next_power_of_2(P))
    grid = (b, H, triton.cdiv(P, block_p))
    x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
    _ssd_update[grid](state, slots, x, dt, A, B, C, y, H, P, N, block_p, triton.next_power_of_2(N))
    return y


def selective_update(state, slots, x, dt, B, C, A) -> torch.Tensor:
    """Mamba's step for b sequences, their states updated in place. state: (S, D, N) (any float), slots:
    (b,), x/dt: (b, D), B/C: (b, N), A: (D, N) -> y (b, D) fp32 (before the D skip)."""
    b, D = x.shape
    N = state.shape[-1]
    y = torch.empty(b, D, device=x.device, dtype=torch.float32)
    block_d = 64
    x, dt, A, B, C = (t.contiguous() for t in (x, dt, A, B, C))
    grid = (b, triton.cdiv(D, block_d))
    _selective_update[grid](
        state, slots, x, dt, A, B, C, y, D, N, block_d, triton.next_power_of_2(N)
    )
    return y


def conv_update(window, slots, x, weight, bias, rows=None, silu=False) -> torch.Tensor:
    """The depthwise causal conv of one token per sequence, each window shifted in place.
    window: (S, K-1, C), slots: (b,), x: (b, C) (or, with `rows`, (T, >= C) whose rows[i] is
    sequence i's: a column slice of a fused projection serves), weight: (C, 1, K), bias: (C,) or
    None -> (b, C), or (T, C) with those rows written; `silu` applies F.silu to the output."""
    C, K = weight.shape[0], weight.shape[-1]
    assert x.stride(-1) == 1
    b = x.shape[0] if rows is None else rows.shape[0]
    y = x.new_empty(x.shape[0], C)
    block_c = 256
    weight = weight.reshape(C, K).contiguous()
    has_bias, has_rows = bias is not None, rows is not None
    grid = (b, triton.cdiv(C, block_c))
    _conv_update[grid](
        window,
        slots,
        rows if has_rows else slots,
        x,
        weight,
        bias if has_bias else x,
        y,
        x.stride(0),
        C,
        K,
        has_bias,
        has_rows,
        silu,
        block_c,
    )
    return y


def ssd_decode(state, slots, rows, xbc, dt, dt_bias, A_log, D, groups: int, dt_limit):
    """Mamba2's whole step for one token per sequence, from the conv's output to the D skip, each
    state updated in place: dt's bias, softplus and clamp, A = -exp(A_log), and B/C read by group
    (never repeated per head) are all done here. state: (S, H, P, N), slots/rows: (b,), xbc: (T,
    H*P + 2*groups*N), dt: (T, >= H) (a column slice serves) -> y (T, H*P) fp32 at `rows`."""
    H, P, N = state.shape[1:]
    y = torch.empty(xbc.shape[0], H * P, device=xbc.device, dtype=torch.float32)
    assert xbc.stride(-1) == 1 and dt.stride(-1) == 1
    block_p = min(32, triton.next_power_of_2(P))
    grid = (rows.shape[0], H, triton.cdiv(P, block_p))
    low, high = (float(v) for v in dt_limit)
    args = (xbc.stride(0), dt.stride(0), low, min(high, 3.0e38), H, P, N, groups)
    _ssd_decode[grid](
        state, slots, rows, xbc, dt, dt_bias, A_log, D, y, *args, block_p, triton.next_power_of_2(N)
    )
    return y


def gated_rms_norm(x, gate, weight, group_size: int, eps: float, out_dtype) -> torch.Tensor:
    """Mamba2's gated norm (layers/mamba.py's GatedRMSNorm) in one kernel: x: (T, C) contiguous,
    gate: (T, >= C) (a column slice serves) -> (T, C) in `out_dtype`, with the module's roundings."""
    T, width = x.shape
    assert x.is_contiguous() and gate.stride(-1) == 1
    out = torch.empty(T, width, device=x.device, dtype=out_dtype)
    grid = (T, width // group_size)
    _gated_rms_norm[grid](
        x, gate, weight, out, gate.stride(0), group_size, eps, triton.next_power_of_2(group_size)
    )
    return out

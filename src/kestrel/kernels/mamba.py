"""Triton kernels for one decode step of Mamba layers, reading and writing each sequence's state
in place in the paged runner's state pool (by slot): one read and one write of the state per
layer, where a gather, the step and a scatter would move it four times and launch a dozen kernels.

Their PyTorch fallbacks are the models' own step functions (models/layers/mamba.py: `ssd_step`,
`selective_scan`, `causal_conv` over gathered states), which the CPU runs and the GPU tests compare
these with. This module imports nothing from kestrel: kernels are the bottom of the import graph.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the fallback serves
    triton = None


def available(store: torch.Tensor) -> bool:
    """Whether the in-place kernels serve a state store (on CUDA, with Triton)."""
    return triton is not None and store.is_cuda


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
        x,  # (b, C)
        weight,  # (C, K)
        bias,  # (C,) or a dummy when HAS_BIAS is False
        y,  # (b, C)
        C,
        K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        b, cb = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slots + b).to(tl.int64)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        mc = c < C
        xv = tl.load(x + b * C + c, mask=mc, other=0.0)
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
        tl.store(y + b * C + c, acc.to(y.dtype.element_ty), mask=mc)


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


def conv_update(window, slots, x, weight, bias) -> torch.Tensor:
    """The depthwise causal conv of one token per sequence, each window shifted in place.
    window: (S, K-1, C), slots: (b,), x: (b, C), weight: (C, 1, K), bias: (C,) or None -> (b, C)."""
    b, C = x.shape
    K = weight.shape[-1]
    y = torch.empty_like(x)
    block_c = 256
    x, weight = x.contiguous(), weight.reshape(C, K).contiguous()
    grid = (b, triton.cdiv(C, block_c))
    has_bias = bias is not None
    _conv_update[grid](
        window, slots, x, weight, bias if has_bias else x, y, C, K, has_bias, block_c
    )
    return y

"""Fused kernels for the decode-bound path, each with the PyTorch fallback it equals: RMSNorm (one
kernel instead of seven), the gated MLP's activation-times-up, and RoPE on q and k of a fused qkv
projection. Triton on CUDA; kestrel's native CPU kernels (kernels/cpu_native.py) on the CPU.

The layers' fused paths call them (`fuse`: models/layers/norm.py, mlp.py, attention.py). This
module imports nothing from kestrel outside kestrel.kernels: kernels are the bottom of the import
graph.
"""

import torch
import torch.nn.functional as F

from kestrel.kernels import cpu_native
from kestrel.kernels.backend import on_cpu_native, on_triton

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


# the activations of gated MLPs, by their config names
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu2": lambda x: F.relu(x).square(),
}


# the activations the native CPU kernels compute
KERNEL_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_tanh")
# the activations the Triton kernels compute (`activate`: act_mul's and the MoE kernels'), by id
ACTIVATION_IDS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1, "relu2": 2}


# -- RMSNorm ------------------------------------------------------------------------------------


def rms_norm(x, weight, eps: float, unit_offset: bool) -> torch.Tensor:
    """x: (..., H) -> (..., H), the same arithmetic as layers.RMSNorm."""
    rowwise = x.dim() == 2 and x.stride(-1) == 1  # e.g. a column slice of a fused GEMM
    if not (x.is_contiguous() or rowwise):
        return rms_norm_torch(x, weight, eps, unit_offset)
    if on_cpu_native(x):
        rows = x if rowwise else x.view(-1, x.shape[-1])
        return cpu_native.rms_norm(rows, weight, eps, unit_offset).view(x.shape)
    if not on_triton(x):
        return rms_norm_torch(x, weight, eps, unit_offset)
    h = x.shape[-1]
    rows = x.numel() // h
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(rows,)](
        x,
        weight,
        out,
        h,
        x.stride(0) if rowwise else h,
        eps,
        UNIT=unit_offset,
        BLOCK=triton.next_power_of_2(h),
        num_warps=8 if h >= 4096 else 4,
    )
    return out


def add_rms_norm(x, branch, weight, eps: float, unit_offset: bool, scale: float = 1.0):
    """(x + branch * scale, its RMSNorm), the arithmetic of layers.RMSNorm.add_norm: one kernel
    where two (three with a scale) ran. x, branch: (T, H) of one dtype."""
    alike = (
        x.dtype == branch.dtype and x.dim() == 2 and x.is_contiguous() and branch.is_contiguous()
    )
    if not (alike and on_triton(x)):
        x = x + branch * scale if scale != 1.0 else x + branch
        return x, rms_norm(x, weight, eps, unit_offset)
    h = x.shape[-1]
    stream, out = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm_kernel[(x.shape[0],)](
        x, branch, weight, stream, out, h, eps, scale,
        UNIT=unit_offset, SCALED=scale != 1.0, BLOCK=triton.next_power_of_2(h),
        num_warps=8 if h >= 4096 else 4,
    )  # fmt: skip
    return stream, out


def rms_norm_add(branch, x, weight, eps: float, unit_offset: bool) -> torch.Tensor:
    """x + RMSNorm(branch), the arithmetic of layers.RMSNorm.norm_add: one kernel where two ran.
    branch, x: (T, H) of one dtype."""
    alike = (
        x.dtype == branch.dtype and x.dim() == 2 and x.is_contiguous() and branch.is_contiguous()
    )
    if not (alike and on_triton(x)):
        return x + rms_norm(branch, weight, eps, unit_offset)
    h = x.shape[-1]
    out = torch.empty_like(x)
    _rms_norm_add_kernel[(x.shape[0],)](
        branch, x, weight, out, h, eps, UNIT=unit_offset, BLOCK=triton.next_power_of_2(h),
        num_warps=8 if h >= 4096 else 4,
    )  # fmt: skip
    return out


def rms_norm_torch(x, weight, eps, unit_offset) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.float())).to(dtype)
    return weight * xf.to(dtype)


# -- activation * up ----------------------------------------------------------------------------


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """(T, 2I) [gate | up] -> (T, I) act(gate) * up."""
    if act in KERNEL_ACTIVATIONS and on_cpu_native(gate_up) and gate_up.stride(-1) == 1:
        return cpu_native.act_mul(gate_up, act != "silu")
    if not on_triton(gate_up) or act not in ACTIVATION_IDS:
        return act_mul_torch(gate_up, act)
    t, two_i = gate_up.shape
    out = gate_up.new_empty(t, two_i // 2)
    block = 1024
    _act_mul_kernel[(t, triton.cdiv(two_i // 2, block))](
        gate_up, out, two_i // 2, gate_up.stride(0), ACT=ACTIVATION_IDS[act], BLOCK=block
    )
    return out


def act_mul_torch(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


# -- RoPE on q and k ----------------------------------------------------------------------------


# `norms` below: (q_norm's weight, k_norm's weight, eps, unit_offset), each head's RMSNorm (as
# layers.RMSNorm rounds it) before RoPE, as Qwen3, Gemma 3 and EXAONE normalize q and k; or None


def rope_qk(
    qkv, cos, sin, hq: int, hkv: int, d: int, norms=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv: (T, (hq + 2 hkv) d) -> rotated q (T, hq, d), k (T, hkv, d) (HF rotate-half)."""
    t = qkv.shape[0]
    if not on_triton(qkv):
        qkv = qkv if norms is None else _prepared_qkv(qkv, hq, hkv, d, norms)
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        return rope_torch(q, cos, sin), rope_torch(k, cos, sin)
    q = qkv.new_empty(t, hq, d)
    k = qkv.new_empty(t, hkv, d)
    _rope_kernel[(t, hq + hkv)](
        qkv, cos, sin, q, k, qkv.stride(0), cos.stride(0), hq, *_norm_args(qkv, norms),
        HALF=d // 2, num_warps=1,
    )  # fmt: skip
    return q, k


def rope_store(
    qkv, cos, sin, hq, hkv, d, store, slot_mapping, norms=None, v_norm=None, v_col=None,
    calibrate_first: bool = False,
) -> torch.Tensor:  # fmt: skip
    """rope_qk, but k (rotated) and v go straight into their slots of `store` (attention.KVStore);
    returns q (T, hq, d). The same arithmetic as rope_qk followed by attention.write_kv (which an
    FP8 store's first chunk takes, `calibrate_first`, to set its scales). v is read from column
    `v_col` (default: after k; Gemma 4's k-equals-v layers read k's raw columns) and, with
    `v_norm` (an eps), RMS-normed without a weight first, as Gemma 4 does."""
    t, plain = qkv.shape[0], v_col is None and v_norm is None
    fp8 = store.k_scale is not None
    if not on_triton(qkv) or calibrate_first:
        if not (norms is None and plain):
            qkv, norms = _prepared_qkv(qkv, hq, hkv, d, norms, v_norm, v_col), None
        native = on_cpu_native(qkv) and qkv.stride(-1) == 1 and cos.dtype == torch.float32
        if native and not fp8:
            return cpu_native.rope_store(qkv, cos, sin, hq, hkv, d, store.k, store.v, slot_mapping)
        from kestrel.kernels.attention import write_kv

        q, k = rope_qk(qkv, cos, sin, hq, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        write_kv(store, k, v, slot_mapping, calibrate_first)
        return q
    q = qkv.new_empty(t, hq, d)
    v_args = ((hq + hkv) * d if v_col is None else v_col, v_norm or 0.0, v_norm is not None)
    scales = (store.k_scale, store.v_scale) if fp8 else (qkv, qkv)
    _rope_store_kernel[(t, hq + hkv)](
        qkv, cos, sin, q, store.k, store.v, *scales, slot_mapping, qkv.stride(0), cos.stride(0),
        hq, hkv, *_norm_args(qkv, norms), *v_args, FP8=fp8, HALF=d // 2, num_warps=1,
    )  # fmt: skip
    return q


def _prepared_qkv(qkv, hq: int, hkv: int, d: int, norms, v_norm=None, v_col=None):
    """[q | k | v] as the RoPE kernels see it: q's and k's heads RMS-normed, v from `v_col`
    and normed without a weight with `v_norm` (the paths without the Triton kernels)."""
    t, qk = qkv.shape[0], (hq + hkv) * d
    q, k = qkv[:, : hq * d].reshape(t, hq, d), qkv[:, hq * d : qk].reshape(t, hkv, d)
    if norms is not None:
        q_weight, k_weight, eps, unit = norms
        q, k = rms_norm(q, q_weight, eps, unit), rms_norm(k, k_weight, eps, unit)
    start = qk if v_col is None else v_col
    v = qkv[:, start : start + hkv * d]
    if v_norm is not None:
        v = rms_norm_torch(v.reshape(t, hkv, d), 1.0, v_norm, False)  # no weight
    return torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)


def _norm_args(qkv, norms) -> tuple:
    """The RoPE kernels' q/k norm arguments: QW, KW, eps, NORM, UNIT."""
    if norms is None:
        return qkv, qkv, 0.0, False, False
    q_weight, k_weight, eps, unit = norms
    return q_weight, k_weight, float(eps), True, bool(unit)


def mla_rope_norm_serves(kv_a: torch.Tensor) -> bool:
    """Whether `mla_rope_norm` runs for these projections (CUDA, Triton, contiguous rows)."""
    return on_triton(kv_a) and kv_a.stride(-1) == 1


def mla_rope_norm(q, kv_a, weight, eps: float, cos, sin, rank: int, interleaved: bool):
    """Multi-head latent attention's per-token work between its projections, in one kernel:
    q (T, H, dn + dr) has its RoPE part rotated in place; kv_a (T, r + dr) -> kv (T, r + dr), the
    RMS-normed latent and the rotated shared key. Interleaved pairs come out de-interleaved, as
    layers/rope.py's apply_rope_interleaved gives them; products are rounded to the dtype as
    there. CUDA only (layers/mla.py keeps the PyTorch path)."""
    T, H, D = q.shape
    dr = kv_a.shape[1] - rank
    kv = torch.empty_like(kv_a)
    _mla_rope_norm_kernel[(T,)](
        q, kv_a, weight, cos, sin, kv, q.stride(0), q.stride(1), kv_a.stride(0), cos.stride(0),
        H, D - dr, rank, eps,
        INTERLEAVED=interleaved, HALF=dr // 2, BLOCK_H=triton.next_power_of_2(H),
        BLOCK_R=triton.next_power_of_2(rank),
    )  # fmt: skip
    return kv


def rope_torch(x, cos, sin) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :].to(x.dtype) + rotated * sin[:, None, :].to(x.dtype)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, W, OUT, h, stride, eps, UNIT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < h
        x = tl.load(X + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
        y = _normed(x, W, cols, ok, h, eps, UNIT, OUT.dtype.element_ty)
        tl.store(OUT + row * h + cols, y.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _normed(x, W, cols, ok, h, eps, UNIT: tl.constexpr, dt: tl.constexpr):
        """A row's RMSNorm in fp32 (x: fp32 values of dtype `dt`), as layers.RMSNorm computes it
        up to its last rounding to `dt`."""
        rstd = tl.rsqrt(tl.sum(x * x, 0) / h + eps)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        if UNIT:
            return x * rstd * (1.0 + w)
        else:  # rounded to the input dtype before the weight, as the PyTorch module does
            return (x * rstd).to(dt).to(tl.float32) * w

    @triton.jit
    def _add_rms_norm_kernel(
        X, B, W, STREAM, OUT, h, eps, scale,
        UNIT: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < h
        dt = X.dtype.element_ty
        b = tl.load(B + row * h + cols, mask=ok, other=0.0).to(tl.float32)
        if SCALED:  # rounded, as PyTorch rounds branch * scale before the add
            b = (b * scale).to(dt).to(tl.float32)
        x = (tl.load(X + row * h + cols, mask=ok, other=0.0).to(tl.float32) + b).to(dt)
        tl.store(STREAM + row * h + cols, x, mask=ok)
        y = _normed(x.to(tl.float32), W, cols, ok, h, eps, UNIT, dt)
        tl.store(OUT + row * h + cols, y.to(dt), mask=ok)

    @triton.jit
    def _rms_norm_add_kernel(
        B, X, W, OUT, h, eps, UNIT: tl.constexpr, BLOCK: tl.constexpr
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < h
        dt = X.dtype.element_ty
        b = tl.load(B + row * h + cols, mask=ok, other=0.0).to(tl.float32)
        y = _normed(b, W, cols, ok, h, eps, UNIT, dt).to(dt)
        x = tl.load(X + row * h + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + row * h + cols, (x + y.to(tl.float32)).to(dt), mask=ok)

    @triton.jit
    def activate(acc, ACT: tl.constexpr):
        """silu (0), gelu's tanh approximation (1) or squared relu (2) of float32 acc
        (`ACTIVATION_IDS`)."""
        if ACT == 0:
            return acc * tl.sigmoid(acc)
        elif ACT == 1:
            inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            return 0.5 * acc * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
        else:
            acc = tl.maximum(acc, 0.0)
            return acc * acc

    @triton.jit
    def _act_mul_kernel(GU, OUT, inter, stride, ACT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        g = tl.load(GU + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride + inter + cols, mask=ok, other=0.0)
        # the module rounds act(gate) to the dtype before multiplying by up
        y = activate(g, ACT).to(OUT.dtype.element_ty).to(tl.float32) * u.to(tl.float32)
        tl.store(OUT + row * inter + cols, y.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _head_norm(x1, x2, W, eps, i, HALF: tl.constexpr, UNIT: tl.constexpr, dt: tl.constexpr):
        """One head's RMSNorm (x1, x2: its halves in fp32), rounded as layers.RMSNorm rounds."""
        rstd = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        w1 = tl.load(W + i).to(tl.float32)
        w2 = tl.load(W + HALF + i).to(tl.float32)
        if UNIT:
            y1, y2 = x1 * rstd * (1.0 + w1), x2 * rstd * (1.0 + w2)
        else:  # rounded to the input dtype before the weight
            y1 = (x1 * rstd).to(dt).to(tl.float32) * w1
            y2 = (x2 * rstd).to(dt).to(tl.float32) * w2
        return y1.to(dt).to(tl.float32), y2.to(dt).to(tl.float32)

    @triton.jit
    def _load_head(
        QKV, t, h, hq, stride_t, QW, KW, eps,
        NORM: tl.constexpr, UNIT: tl.constexpr, HALF: tl.constexpr,
    ):  # fmt: skip
        """Head h of token t's q and k as fp32 halves, RMS-normed first with NORM."""
        i = tl.arange(0, HALF)
        src = QKV + t * stride_t + h * 2 * HALF
        x1 = tl.load(src + i).to(tl.float32)
        x2 = tl.load(src + HALF + i).to(tl.float32)
        if NORM:
            dt = QKV.dtype.element_ty
            if h < hq:
                x1, x2 = _head_norm(x1, x2, QW, eps, i, HALF, UNIT, dt)
            else:
                x1, x2 = _head_norm(x1, x2, KW, eps, i, HALF, UNIT, dt)
        return x1, x2

    @triton.jit
    def _rope_kernel(
        QKV, COS, SIN, Q, K, stride_t, stride_c, hq, QW, KW, eps,
        NORM: tl.constexpr, UNIT: tl.constexpr, HALF: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, HALF)
        x1, x2 = _load_head(QKV, t, h, hq, stride_t, QW, KW, eps, NORM, UNIT, HALF)
        dt = QKV.dtype.element_ty
        # cos/sin rounded to the dtype and each product rounded, as rope_torch computes them
        c1 = tl.load(COS + t * stride_c + i).to(dt).to(tl.float32)
        c2 = tl.load(COS + t * stride_c + HALF + i).to(dt).to(tl.float32)
        s1 = tl.load(SIN + t * stride_c + i).to(dt).to(tl.float32)
        s2 = tl.load(SIN + t * stride_c + HALF + i).to(dt).to(tl.float32)
        f32 = tl.float32
        y1 = (x1 * c1).to(dt).to(f32) + (-x2 * s1).to(dt).to(f32)
        y2 = (x2 * c2).to(dt).to(f32) + (x1 * s2).to(dt).to(f32)
        if h < hq:
            dst = Q + (t * hq + h) * 2 * HALF
        else:
            dst = K + (t * (tl.num_programs(1) - hq) + h - hq) * 2 * HALF
        tl.store(dst + i, y1.to(dt))
        tl.store(dst + HALF + i, y2.to(dt))


if triton is not None:

    @triton.jit
    def _rope_store_kernel(
        QKV, COS, SIN, Q, KC, VC, KS, VS, SLOTS, stride_t, stride_c, hq, hkv,
        QW, KW, eps, NORM: tl.constexpr, UNIT: tl.constexpr,  # `_norm_args`
        v_col, v_eps, V_NORM: tl.constexpr, FP8: tl.constexpr, HALF: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, HALF)
        x1, x2 = _load_head(QKV, t, h, hq, stride_t, QW, KW, eps, NORM, UNIT, HALF)
        dt = QKV.dtype.element_ty
        f32 = tl.float32
        c1 = tl.load(COS + t * stride_c + i).to(dt).to(f32)
        c2 = tl.load(COS + t * stride_c + HALF + i).to(dt).to(f32)
        s1 = tl.load(SIN + t * stride_c + i).to(dt).to(f32)
        s2 = tl.load(SIN + t * stride_c + HALF + i).to(dt).to(f32)
        y1 = ((x1 * c1).to(dt).to(f32) + (-x2 * s1).to(dt).to(f32)).to(dt)
        y2 = ((x2 * c2).to(dt).to(f32) + (x1 * s2).to(dt).to(f32)).to(dt)
        if h < hq:
            dst = Q + (t * hq + h) * 2 * HALF
            tl.store(dst + i, y1)
            tl.store(dst + HALF + i, y2)
        else:
            kh = h - hq
            slot = tl.load(SLOTS + t).to(tl.int64)
            kdst = KC + (slot * hkv + kh) * 2 * HALF
            tl.store(kdst + i, _stored(y1, KS, kh, FP8, KC.dtype.element_ty))
            tl.store(kdst + HALF + i, _stored(y2, KS, kh, FP8, KC.dtype.element_ty))
            vsrc = QKV + t * stride_t + v_col + kh * 2 * HALF
            v = tl.load(vsrc + i)
            v2 = tl.load(vsrc + HALF + i)
            if V_NORM:  # no weight; rounded to the input dtype, as Gemma 4's v norm
                vf, vf2 = v.to(f32), v2.to(f32)
                rstd = tl.rsqrt((tl.sum(vf * vf, 0) + tl.sum(vf2 * vf2, 0)) / (2 * HALF) + v_eps)
                v, v2 = (vf * rstd).to(dt), (vf2 * rstd).to(dt)
            vdst = VC + (slot * hkv + kh) * 2 * HALF
            tl.store(vdst + i, _stored(v, VS, kh, FP8, VC.dtype.element_ty))
            tl.store(vdst + HALF + i, _stored(v2, VS, kh, FP8, VC.dtype.element_ty))

    @triton.jit
    def _stored(x, SCALES, head, FP8: tl.constexpr, dtype: tl.constexpr):
        # the number a cache of `dtype` stores for x: an FP8 one's over its head's scale, saturated
        if FP8:
            y = x.to(tl.float32) / tl.load(SCALES + head)
            return tl.minimum(tl.maximum(y, -448.0), 448.0).to(dtype)
        return x.to(dtype)


if triton is not None:

    @triton.jit
    def _rotate(x1, x2, c1, s1, c2, s2, dt: tl.constexpr):
        # (x1, x2) -> (x1 c1 - x2 s1, x2 c2 + x1 s2), each product rounded to dt as PyTorch does
        f32 = tl.float32
        y1 = (x1 * c1).to(dt).to(f32) - (x2 * s1).to(dt).to(f32)
        y2 = (x2 * c2).to(dt).to(f32) + (x1 * s2).to(dt).to(f32)
        return y1.to(dt), y2.to(dt)

    @triton.jit
    def _mla_rope_norm_kernel(
        Q, KVA, W, COS, SIN, KV, stride_qt, stride_qh, stride_kt, stride_c, H, nope, rank, eps,
        INTERLEAVED: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        dt = Q.dtype.element_ty
        i = tl.arange(0, HALF)
        cs = COS + t * stride_c
        sn = SIN + t * stride_c
        c1 = tl.load(cs + i).to(dt).to(tl.float32)
        s1 = tl.load(sn + i).to(dt).to(tl.float32)
        # interleaved pairs are (2i, 2i+1) and use cos[:half]; rotate-half pairs are (i, half+i)
        if INTERLEAVED:
            first, second = 2 * i, 2 * i + 1
            c2, s2 = c1, s1
        else:
            first, second = i, HALF + i
            c2 = tl.load(cs + HALF + i).to(dt).to(tl.float32)
            s2 = tl.load(sn + HALF + i).to(dt).to(tl.float32)
        # the queries' RoPE parts, every head at once: (BLOCK_H, HALF), rotated in place
        h = tl.arange(0, BLOCK_H)[:, None]
        at = Q + t * stride_qt + h * stride_qh + nope
        live = (h < H) & (i[None, :] < HALF)
        x1 = tl.load(at + first[None, :], mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(at + second[None, :], mask=live, other=0.0).to(tl.float32)
        y1, y2 = _rotate(x1, x2, c1[None, :], s1[None, :], c2[None, :], s2[None, :], dt)
        tl.debug_barrier()  # every head's pairs are read before any is overwritten
        tl.store(at + i[None, :], y1, mask=live)
        tl.store(at + HALF + i[None, :], y2, mask=live)
        # the shared key after the latent
        row = KVA + t * stride_kt
        x1 = tl.load(row + rank + first).to(tl.float32)
        x2 = tl.load(row + rank + second).to(tl.float32)
        y1, y2 = _rotate(x1, x2, c1, s1, c2, s2, dt)
        out = KV + t * (rank + 2 * HALF)
        tl.store(out + rank + i, y1)
        tl.store(out + rank + HALF + i, y2)
        # the latent, RMS-normed as layers.RMSNorm: rounded to dt before the weight
        r = tl.arange(0, BLOCK_R)
        mr = r < rank
        x = tl.load(row + r, mask=mr, other=0.0).to(tl.float32)
        tl.store(out + r, _normed(x, W, r, mr, rank, eps, False, dt).to(dt), mask=mr)

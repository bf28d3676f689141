"""Fused kernels for the decode-bound GPU path, each with the PyTorch fallback it equals:
RMSNorm (one kernel instead of seven), the gated MLP's activation-times-up, and RoPE on q and k
of a fused qkv projection.

`fuse_model` rewires a loaded model's Attention / GatedMLP / RMSNorm instances to use them: q/k/v
(and gate/up) weights become views of one concatenated tensor, so names and memory stay the same
and one GEMM replaces three (two). Model files are untouched; the CPU path never calls this.
"""

import types

import torch
import torch.nn.functional as F

from kestrel.models.layers import ACTIVATIONS, Attention, GatedMLP, RMSNorm, RotaryEmbedding

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def _triton_ok(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


# -- RMSNorm ------------------------------------------------------------------------------------


def rms_norm(x, weight, eps: float, unit_offset: bool) -> torch.Tensor:
    """x: (..., H) -> (..., H), the same arithmetic as layers.RMSNorm."""
    if not _triton_ok(x) or not x.is_contiguous():
        return rms_norm_torch(x, weight, eps, unit_offset)
    h = x.shape[-1]
    rows = x.numel() // h
    out = torch.empty_like(x)
    _rms_norm_kernel[(rows,)](
        x,
        weight,
        out,
        h,
        eps,
        UNIT=unit_offset,
        BLOCK=triton.next_power_of_2(h),
        num_warps=8 if h >= 4096 else 4,
    )
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
    if not _triton_ok(gate_up) or act not in ("silu", "gelu_pytorch_tanh", "gelu_tanh"):
        return act_mul_torch(gate_up, act)
    t, two_i = gate_up.shape
    out = gate_up.new_empty(t, two_i // 2)
    block = 1024
    _act_mul_kernel[(t, triton.cdiv(two_i // 2, block))](
        gate_up, out, two_i // 2, gate_up.stride(0), GELU=act != "silu", BLOCK=block
    )
    return out


def act_mul_torch(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


# -- RoPE on q and k ----------------------------------------------------------------------------


def rope_qk(qkv, cos, sin, hq: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv: (T, (hq + 2 hkv) d) -> rotated q (T, hq, d), k (T, hkv, d) (HF rotate-half)."""
    t = qkv.shape[0]
    if not _triton_ok(qkv):
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        return rope_torch(q, cos, sin), rope_torch(k, cos, sin)
    q = qkv.new_empty(t, hq, d)
    k = qkv.new_empty(t, hkv, d)
    _rope_kernel[(t, hq + hkv)](
        qkv, cos, sin, q, k, qkv.stride(0), cos.stride(0), hq, HALF=d // 2, num_warps=1
    )
    return q, k


def rope_store(qkv, cos, sin, hq, hkv, d, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """rope_qk, but k (rotated) and v go straight into their cache slots; returns q (T, hq, d).
    The same arithmetic as rope_qk followed by attention.write_kv."""
    t = qkv.shape[0]
    if not _triton_ok(qkv):
        from kestrel.kernels.attention import write_kv

        q, k = rope_qk(qkv, cos, sin, hq, hkv, d)
        write_kv(k_cache, v_cache, k, qkv[:, (hq + hkv) * d :].view(t, hkv, d), slot_mapping)
        return q
    q = qkv.new_empty(t, hq, d)
    _rope_store_kernel[(t, hq + hkv)](
        qkv,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        slot_mapping,
        qkv.stride(0),
        cos.stride(0),
        hq,
        hkv,
        HALF=d // 2,
        num_warps=1,
    )
    return q


def rope_torch(x, cos, sin) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :].to(x.dtype) + rotated * sin[:, None, :].to(x.dtype)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, W, OUT, h, eps, UNIT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < h
        x = tl.load(X + row * h + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / h + eps)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        if UNIT:
            y = x * rstd * (1.0 + w)
        else:  # round to the input dtype before the weight, as the PyTorch module does
            y = (x * rstd).to(OUT.dtype.element_ty).to(tl.float32) * w
        tl.store(OUT + row * h + cols, y.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _act_mul_kernel(GU, OUT, inter, stride, GELU: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        g = tl.load(GU + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride + inter + cols, mask=ok, other=0.0)
        if GELU:  # tanh approximation
            inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
        else:
            a = g * tl.sigmoid(g)
        # the module rounds act(gate) to the dtype before multiplying by up
        y = a.to(OUT.dtype.element_ty).to(tl.float32) * u.to(tl.float32)
        tl.store(OUT + row * inter + cols, y.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_kernel(QKV, COS, SIN, Q, K, stride_t, stride_c, hq, HALF: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, HALF)
        src = QKV + t * stride_t + h * 2 * HALF
        x1 = tl.load(src + i).to(tl.float32)
        x2 = tl.load(src + HALF + i).to(tl.float32)
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
        QKV, COS, SIN, Q, KC, VC, SLOTS, stride_t, stride_c, hq, hkv, HALF: tl.constexpr
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, HALF)
        src = QKV + t * stride_t + h * 2 * HALF
        x1 = tl.load(src + i).to(tl.float32)
        x2 = tl.load(src + HALF + i).to(tl.float32)
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
            dst = KC + (slot * hkv + kh) * 2 * HALF
            tl.store(dst + i, y1.to(KC.dtype.element_ty))
            tl.store(dst + HALF + i, y2.to(KC.dtype.element_ty))
            v = tl.load(src + hkv * 2 * HALF + i)
            v2 = tl.load(src + hkv * 2 * HALF + HALF + i)
            vdst = VC + (slot * hkv + kh) * 2 * HALF
            tl.store(vdst + i, v.to(VC.dtype.element_ty))
            tl.store(vdst + HALF + i, v2.to(VC.dtype.element_ty))


# -- rewiring a loaded model --------------------------------------------------------------------


def fuse_model(model: torch.nn.Module) -> None:
    """Point the model's norms, MLPs and attention projections at the fused kernels."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = types.MethodType(_norm_forward, module)
        elif isinstance(module, GatedMLP) and module.gate_proj.bias is None:
            module.gate_up = _concat_weights(module, ["gate_proj", "up_proj"])
            module.forward = types.MethodType(_mlp_forward, module)
        elif isinstance(module, Attention) and _fusable(module):
            module.qkv_weight = _concat_weights(module, ["q_proj", "k_proj", "v_proj"])
            biases = [getattr(module, n).bias for n in ("q_proj", "k_proj", "v_proj")]
            module.qkv_bias = None if biases[0] is None else torch.cat(biases)
            module.forward = types.MethodType(_attention_forward, module)


def _concat_weights(module, names: list[str]) -> torch.Tensor:
    """Concatenate the Linear weights along the output axis; the Linears keep views of it."""
    fused = torch.cat([getattr(module, n).weight for n in names])
    start = 0
    for n in names:
        linear = getattr(module, n)
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


def _fusable(attn: Attention) -> bool:
    return (
        attn.q_norm is None
        and type(attn.rope) is RotaryEmbedding
        and attn.rope.attention_scaling == 1.0
    )


def _norm_forward(self, x):
    return rms_norm(x, self.weight, self.eps, self.unit_offset)


def _mlp_forward(self, x):
    return self.down_proj(act_mul(F.linear(x, self.gate_up), _act_name(self.act)))


def _act_name(act) -> str:
    return next((name for name, fn in ACTIVATIONS.items() if fn is act), "silu")


def _attention_forward(self, x, batch, rope_cos_sin=None):
    from kestrel.models.layers import cached_attention

    t = x.shape[0]
    qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # (T, (Hq + 2 Hkv) D)
    hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
    cos, sin = rope_cos_sin if rope_cos_sin is not None else self.rope(batch.positions)
    meta = getattr(batch, "attention", None)
    if meta is not None:  # paged pool: k/v stored by the RoPE kernel, one launch for all three
        from kestrel.kernels.attention import paged_attention

        kc, vc = meta.pool.k[self.layer_idx], meta.pool.v[self.layer_idx]
        q = rope_store(qkv, cos, sin, hq, hkv, d, kc, vc, meta.slot_mapping)
        out = paged_attention(q, kc, vc, meta, self.scale, self.window, meta.use_triton)
        return self.o_proj(out.reshape(t, -1))
    q, k = rope_qk(qkv, cos, sin, hq, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    out = cached_attention(q, k, v, self.layer_idx, batch, self.scale, self.window)
    return self.o_proj(out.reshape(t, -1))

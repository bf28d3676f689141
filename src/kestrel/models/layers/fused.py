"""`fuse_model`: rewire a loaded model's Attention / GatedMLP / RMSNorm / Linear instances to the
fused kernels of kernels/fused.py (Triton on CUDA, the native kernels on the CPU) and the small
GEMVs of kernels/gemv.py (one row of x on CUDA, where cuBLAS is slow): q/k/v (and gate/up)
weights, their GGUF blocks where they are of one type, or their FP8 weights and scales where the
scale tiles line up, become views of one concatenated tensor, so names and memory stay the same
and one matmul replaces three (two); LoRA adapters on them add to the fused output (one
kernel pair for the group: models/layers/lora.py). Model files are untouched; the paged runner calls this,
the reference runner never does.
"""

import types
from collections.abc import Callable

import torch

from kestrel.cache.paged import paged_attention
from kestrel.kernels import gemv
from kestrel.kernels.fused import (
    ACTIVATIONS,
    act_mul,
    add_rms_norm,
    rms_norm,
    rms_norm_add,
    rope_qk,
    rope_store,
)
from kestrel.models.layers.attention import Attention, cached_attention
from kestrel.models.layers.lora import fused_with_lora
from kestrel.models.layers.mla import MultiHeadLatentAttention
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.mrope import MRotaryEmbedding
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.quant import QuantLinear
from kestrel.models.layers.rope import RotaryEmbedding


def fuse_model(model: torch.nn.Module) -> None:
    """Point the model's norms, MLPs and attention projections at the fused kernels."""
    for module in model.modules():
        if callable(getattr(module, "fuse", None)):  # a layer that knows its fused path
            module.fuse()
        elif isinstance(module, RMSNorm):
            module.forward = types.MethodType(_norm_forward, module)
            module.add_norm = types.MethodType(_add_norm_forward, module)
            module.norm_add = types.MethodType(_norm_add_forward, module)
        elif isinstance(module, GatedMLP):
            module.gate_up = concat_projection(module, ["gate_proj", "up_proj"])
            module.forward = types.MethodType(_mlp_forward, module)
        elif isinstance(module, MultiHeadLatentAttention) and _latent_fusable(module):
            module.latent_down = concat_projection(module, LATENT_DOWN)
            module.project = types.MethodType(_latent_project, module)
        elif isinstance(module, Attention) and _fusable(module):
            module.qkv = concat_projection(module, ["q_proj", "k_proj", "v_proj"])
            module.forward = types.MethodType(_attention_forward, module)
        elif type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_linear_forward, module)


# MLA's two down-projections of the hidden state (low-rank queries, latent + rope key)
LATENT_DOWN = ["q_a_proj", "kv_a_proj_with_mqa"]


def concat_projection(module, names: list[str]) -> Callable:
    """x -> the Linears `names`' outputs side by side. Each run of neighbours that stack (plain
    Linears, or quantized ones of one kind: `_stackable`) becomes one weight the Linears keep
    views of; where the runs differ (llama.cpp's Q4_K_M keeps v in Q6_K in half the layers,
    q and k in Q4_K) each runs apart and their outputs are concatenated."""
    linears = [getattr(module, n) for n in names]
    parts = [_stack(run) for run in _runs(linears)]
    if len(parts) == 1:
        return fused_with_lora(linears, parts[0])
    return fused_with_lora(linears, lambda x: torch.cat([part(x) for part in parts], dim=-1))


def _runs(linears: list) -> list[list]:
    """The Linears cut into runs of neighbours that stack."""
    runs = [[linears[0]]]
    for linear in linears[1:]:
        if _stackable([*runs[-1], linear]):
            runs[-1].append(linear)
        else:
            runs.append([linear])
    return runs


def _stack(linears: list) -> Callable:
    """x -> the outputs of a run of Linears that stack, from one weight and bias."""
    if len(linears) == 1:
        linear = linears[0]
        return lambda x: linear(x)  # its forward when called: fuse_model may rewire it later
    first = linears[0]
    bias = None if first.bias is None else torch.cat([linear.bias for linear in linears])
    if type(first) is torch.nn.Linear:
        weight = _concat_into(linears, "weight")
        return lambda x: gemv.linear(x, weight, bias)
    tensors = {role: _concat_into(linears, role) for role in first.roles}
    qweight = tensors.pop("qweight")
    return QuantLinear(qweight, first.fmt, first.in_features, bias, **tensors).forward


def _stackable(linears: list) -> bool:
    """Whether Linears stack into one weight: plain ones, or quantized ones of one format whose
    tensors stack along the rows (`QuantFormat.stacks_rows`: GGUF blocks of one type, FP8 whose
    tiles never straddle two of them); all with biases or none."""
    first = linears[0]
    if len({linear.bias is None for linear in linears}) > 1:
        return False
    if all(type(linear) is torch.nn.Linear for linear in linears):
        return True
    if not all(isinstance(linear, QuantLinear) for linear in linears):
        return False
    alike = all((q.fmt, q.in_features) == (first.fmt, first.in_features) for q in linears)
    return alike and first.fmt.stacks_rows([q.out_features for q in linears])


def _concat_into(linears, name: str) -> torch.Tensor:
    """Concatenate the Linears' tensors `name` along the output axis; they keep views of it."""
    fused = torch.cat([getattr(linear, name) for linear in linears])
    start = 0
    for linear in linears:
        rows = getattr(linear, name).shape[0]
        view = fused[start : start + rows]
        if name == "weight":
            linear.weight = torch.nn.Parameter(view, requires_grad=False)
        else:
            setattr(linear, name, view)  # a buffer: reassigning keeps it registered
        start += rows
    return fused


def _fusable(attn: Attention) -> bool:
    """RoPE the kernels compute (the caller's M-RoPE cos/sin too), and q/k norms they apply."""
    rope = type(attn.rope) is MRotaryEmbedding or (
        type(attn.rope) is RotaryEmbedding and attn.rope.attention_scaling == 1.0
    )
    norms = attn.q_norm is None or (
        type(attn.q_norm) is type(attn.k_norm) is RMSNorm
        and (attn.q_norm.eps, attn.q_norm.unit_offset) == (attn.k_norm.eps, attn.k_norm.unit_offset)
    )
    return rope and norms


def _qk_norms(attn: Attention) -> tuple | None:
    """The RoPE kernels' `norms` for this attention's q/k norms, or None."""
    if attn.q_norm is None:
        return None
    q, k = attn.q_norm, attn.k_norm
    return q.weight, k.weight, q.eps, q.unit_offset


def _latent_project(self, x):
    # one GEMM for both down-projections; their outputs are row-strided views of it
    q_a, kv_a = self.latent_down(x).split(
        [self.q_a_proj.out_features, self.kv_a_proj_with_mqa.out_features], dim=-1
    )
    q = self.q_b_proj(self.q_a_layernorm(q_a))
    return q.view(x.shape[0], self.num_heads, -1), kv_a


def _latent_fusable(attn: MultiHeadLatentAttention) -> bool:
    # low-rank queries (not minicpm3-style q_proj), Linears without biases
    return hasattr(attn, "q_a_proj") and all(getattr(attn, n).bias is None for n in LATENT_DOWN)


def _linear_forward(self, x):
    return gemv.linear(x, self.weight, self.bias)


def _norm_forward(self, x):
    return rms_norm(x, self.weight, self.eps, self.unit_offset)


def _add_norm_forward(self, x, branch, scale: float = 1.0):
    return add_rms_norm(x, branch, self.weight, self.eps, self.unit_offset, scale)


def _norm_add_forward(self, branch, x):
    return rms_norm_add(branch, x, self.weight, self.eps, self.unit_offset)


def _mlp_forward(self, x):
    return self.down_proj(act_mul(self.gate_up(x), _act_name(self.act)))


def _act_name(act) -> str:
    return next((name for name, fn in ACTIVATIONS.items() if fn is act), "silu")


def _attention_forward(self, x, batch, rope_cos_sin=None):
    t = x.shape[0]
    qkv = self.qkv(x)  # (T, (Hq + 2 Hkv) D)
    hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
    cos, sin = rope_cos_sin if rope_cos_sin is not None else self.rope(batch.positions)
    meta, norms = getattr(batch, "attention", None), _qk_norms(self)
    if meta is not None:  # paged pool: k/v stored by the RoPE kernel, one launch for all three
        store, slots = meta.pool.store(self.layer_idx), meta.slot_mapping
        q = rope_store(
            qkv, cos, sin, hq, hkv, d, store, slots, norms, calibrate_first=meta.calibrate
        )
        out = paged_attention(q, store, meta, self.scale, self.window, meta.use_triton)
        return self.o_proj(out.reshape(t, -1))
    q, k = rope_qk(qkv, cos, sin, hq, hkv, d, norms)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    out = cached_attention(q, k, v, self.layer_idx, batch, self.scale, self.window)
    return self.o_proj(out.reshape(t, -1))

"""`fuse_model`: rewire a loaded model's Attention / GatedMLP / RMSNorm instances to the fused
kernels of kernels/fused.py on CUDA: q/k/v (and gate/up) weights become views of one concatenated
tensor, so names and memory stay the same and one GEMM replaces three (two). Model files are
untouched; the CPU path never calls this.
"""

import types

import torch
import torch.nn.functional as F

from kestrel.cache.paged import paged_attention
from kestrel.kernels.fused import ACTIVATIONS, act_mul, rms_norm, rope_qk, rope_store
from kestrel.models.layers.attention import Attention, cached_attention
from kestrel.models.layers.mla import MultiHeadLatentAttention
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.rope import RotaryEmbedding


def fuse_model(model: torch.nn.Module) -> None:
    """Point the model's norms, MLPs and attention projections at the fused kernels."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = types.MethodType(_norm_forward, module)
        elif (
            isinstance(module, GatedMLP)
            and module.gate_proj.bias is None
            and _dense(module, ["gate_proj", "up_proj"])
        ):
            module.gate_up = _concat_weights(module, ["gate_proj", "up_proj"])
            module.forward = types.MethodType(_mlp_forward, module)
        elif isinstance(module, MultiHeadLatentAttention) and _latent_fusable(module):
            module.down_weight = _concat_weights(module, LATENT_DOWN)
            module.project = types.MethodType(_latent_project, module)
        elif isinstance(module, Attention) and _fusable(module):
            module.qkv_weight = _concat_weights(module, ["q_proj", "k_proj", "v_proj"])
            biases = [getattr(module, n).bias for n in ("q_proj", "k_proj", "v_proj")]
            module.qkv_bias = None if biases[0] is None else torch.cat(biases)
            module.forward = types.MethodType(_attention_forward, module)


# MLA's two down-projections of the hidden state (low-rank queries, latent + rope key)
LATENT_DOWN = ["q_a_proj", "kv_a_proj_with_mqa"]


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


def _dense(module, names: list[str]) -> bool:
    """Whether the projections are plain Linears: packed (quantized) ones have no weight tensor
    to concatenate and keep their own forward."""
    return all(isinstance(getattr(module, n), torch.nn.Linear) for n in names)


def _fusable(attn: Attention) -> bool:
    return (
        _dense(attn, ["q_proj", "k_proj", "v_proj"])
        and attn.q_norm is None
        and type(attn.rope) is RotaryEmbedding
        and attn.rope.attention_scaling == 1.0
    )


def _latent_project(self, x):
    # one GEMM for both down-projections; their outputs are row-strided views of it
    q_a, kv_a = F.linear(x, self.down_weight).split(
        [self.q_a_proj.out_features, self.kv_a_proj_with_mqa.out_features], dim=-1
    )
    q = self.q_b_proj(self.q_a_layernorm(q_a))
    return q.view(x.shape[0], self.num_heads, -1), kv_a


def _latent_fusable(attn: MultiHeadLatentAttention) -> bool:
    # low-rank queries (not minicpm3-style q_proj), plain Linears without biases
    return (
        hasattr(attn, "q_a_proj")
        and _dense(attn, LATENT_DOWN)
        and all(getattr(attn, n).bias is None for n in LATENT_DOWN)
    )


def _norm_forward(self, x):
    return rms_norm(x, self.weight, self.eps, self.unit_offset)


def _mlp_forward(self, x):
    return self.down_proj(act_mul(F.linear(x, self.gate_up), _act_name(self.act)))


def _act_name(act) -> str:
    return next((name for name, fn in ACTIVATIONS.items() if fn is act), "silu")


def _attention_forward(self, x, batch, rope_cos_sin=None):
    t = x.shape[0]
    qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # (T, (Hq + 2 Hkv) D)
    hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
    cos, sin = rope_cos_sin if rope_cos_sin is not None else self.rope(batch.positions)
    meta = getattr(batch, "attention", None)
    if meta is not None:  # paged pool: k/v stored by the RoPE kernel, one launch for all three
        kc, vc = meta.pool.k[self.layer_idx], meta.pool.v[self.layer_idx]
        q = rope_store(qkv, cos, sin, hq, hkv, d, kc, vc, meta.slot_mapping)
        out = paged_attention(q, kc, vc, meta, self.scale, self.window, meta.use_triton)
        return self.o_proj(out.reshape(t, -1))
    q, k = rope_qk(qkv, cos, sin, hq, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    out = cached_attention(q, k, v, self.layer_idx, batch, self.scale, self.window)
    return self.o_proj(out.reshape(t, -1))

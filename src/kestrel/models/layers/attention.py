"""GQA self-attention over the cache. Tensors are packed across sequences: (T, ...) where T is
the total tokens of the batch; the mask comes from the positions of the keys the cache returned.

Fused (the paged runner's path, `Attention.fuse`): q/k/v are one matmul over views of one weight,
and the q/k norms, RoPE and (on the paged pool) the cache write are one kernel
(kernels/fused.py), where the layer's RoPE and norms are ones those kernels compute.
"""

import torch
from torch import nn

from kestrel.cache.mask import visible_mask
from kestrel.cache.paged import paged_attention
from kestrel.cache.sequence import KVShape
from kestrel.kernels.attention import attend
from kestrel.kernels.backend import Backend
from kestrel.kernels.fused import rope_qk, rope_store
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.linear import Linear, concat_projection
from kestrel.models.layers.mrope import MRotaryEmbedding
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.rope import RotaryEmbedding, apply_rope


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    batch: ForwardBatch,
    scale: float,
    window: int | None = None,
    cache_layer_idx: int | None = None,
) -> torch.Tensor:
    """Append k/v to each sequence's cache and attend. q: (T, Hq, D), k/v: (T, Hkv, D) -> (T, Hq, Dv).

    The mask comes from the positions of the keys the cache returned (docs/architecture.md §1).
    `cache_layer_idx` lets a layer read another layer's cache (KV sharing) without appending;
    k/v are then None (values are taken to have q's head dim).
    """
    if batch.attention is not None:  # the paged runner's KV pool
        return batch.attention(q, k, v, layer_idx, scale, window, cache_layer_idx)
    out = q.new_empty(q.shape[0], q.shape[1], q.shape[-1] if v is None else v.shape[-1])
    for chunk in batch.chunks:
        rows = chunk.rows
        q_pos = batch.positions[rows]
        if cache_layer_idx is None:
            layer = chunk.cache.layers[layer_idx]
            keys, values, k_pos = layer.update(
                k[rows].transpose(0, 1), v[rows].transpose(0, 1), q_pos
            )
        else:
            layer = chunk.cache.layers[cache_layer_idx]
            keys, values, k_pos = layer.keys, layer.values, layer.positions
        mask = visible_mask(q_pos, k_pos, window)
        out[rows] = attend(q[rows].transpose(0, 1), keys, values, mask, scale).transpose(0, 1)
    return out


class Attention(nn.Module):
    """GQA self-attention over the cache: optional qkv bias, per-head q/k norms, RoPE, window."""

    def __init__(
        self,
        layer_idx: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RotaryEmbedding | None,
        scale: float | None = None,
        window: int | None = None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_factory=None,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden, bias=o_bias)
        if qk_norm_factory is not None:
            self.q_norm = qk_norm_factory(head_dim)
            self.k_norm = qk_norm_factory(head_dim)
        else:
            self.q_norm = self.k_norm = None
        self.rope = rope
        self.scale = scale if scale is not None else head_dim**-0.5
        self.window = window
        self.fused = False

    def kv_shape(self) -> KVShape:
        return KVShape(self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope_cos_sin=None) -> torch.Tensor:
        if self.fused:
            return self._forward_fused(x, batch, rope_cos_sin)
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            cos, sin = rope_cos_sin if rope_cos_sin is not None else self.rope(batch.positions)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = cached_attention(q, k, v, self.layer_idx, batch, self.scale, self.window)
        return self.o_proj(out.reshape(T, -1))

    def fuse(self, backend: Backend) -> None:
        """q/k/v as one projection and the kernels' norms, RoPE and cache write, where they
        compute this layer's (`_fusable`); else the layer stays as it is."""
        if self._fusable():
            self.qkv = concat_projection(self, ["q_proj", "k_proj", "v_proj"])
            self.fused = True

    def _fusable(self) -> bool:
        """RoPE the kernels compute (the caller's M-RoPE cos/sin too), and q/k norms they apply."""
        rope = type(self.rope) is MRotaryEmbedding or (
            type(self.rope) is RotaryEmbedding and self.rope.attention_scaling == 1.0
        )
        q, k = self.q_norm, self.k_norm
        norms = q is None or (
            type(q) is type(k) is RMSNorm and (q.eps, q.unit_offset) == (k.eps, k.unit_offset)
        )
        return rope and norms

    def _qk_norms(self) -> tuple | None:
        """The RoPE kernels' `norms` for this layer's q/k norms, or None."""
        if self.q_norm is None:
            return None
        q, k = self.q_norm, self.k_norm
        return q.weight, k.weight, q.eps, q.unit_offset

    def _forward_fused(self, x, batch: ForwardBatch, rope_cos_sin=None) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x)  # (T, (Hq + 2 Hkv) D)
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rope_cos_sin if rope_cos_sin is not None else self.rope(batch.positions)
        meta, norms = batch.attention, self._qk_norms()
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

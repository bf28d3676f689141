"""Multi-head latent attention (MLA, DeepSeek-V2), shared by mistral4, glm4_moe_lite and minicpm3.

Follows transformers' `Mistral4Attention` / `Glm4MoeLiteAttention` / `MiniCPM3Attention`. Each
token's keys and values come from one low-rank latent: `kv_a_proj_with_mqa` gives the latent
(`kv_lora_rank`, RMS-normed) and one RoPE key (`qk_rope_head_dim`) shared by all heads;
`kv_b_proj` expands the latent into per-head no-RoPE keys and values. Queries come from `q_proj`
or the low-rank `q_a_proj -> q_a_layernorm -> q_b_proj`, split into a no-RoPE and a RoPE part.

The cache keeps the latent and the RoPE key (kind "latent"), so KV memory per token is
`kv_lora_rank + qk_rope_head_dim`, not `2 * heads * head_dim`. Attention then either expands the
cached latents into per-head keys/values (long chunks), or, for short chunks (decode), folds
`kv_b_proj` into the query and the output and attends in latent space: q_nope . (W_uk c) equals
(W_uk^T q_nope) . c, so every head attends one shared (MQA) latent key/value. On the paged pool
every chunk attends in latent space (one kernel for the batch; the latent is never expanded).
Fused (the paged runner's path), the two down-projections of the hidden state are one matmul.
"""

import torch
from torch import nn

from kestrel.cache.kv import LayerKVCache
from kestrel.cache.mask import visible_mask
from kestrel.cache.sequence import CACHE_KINDS, CacheSpec, KVShape
from kestrel.kernels import fused
from kestrel.kernels.attention import attend
from kestrel.kernels.backend import Backend
from kestrel.models.base import CausalLM, Slot, rope_parameters
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.linear import Linear, concat_projection
from kestrel.models.layers.mtp import final_norm
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.rope import (
    RotaryEmbedding,
    apply_rope,
    apply_rope_interleaved,
    rope_attention_factor,
    yarn_mscale,
)


class LatentKVCache(LayerKVCache):
    """A LayerKVCache whose `keys` are the normed latents (1, L, kv_lora_rank) and whose `values`
    are the roped shared keys (1, L, qk_rope_head_dim), each with its absolute position.

    Storage, trimming, window eviction and checkpoints are LayerKVCache's; the separate kind
    tells the runner these layers cost `kv_lora_rank + qk_rope_head_dim` per token and hold no
    per-head K/V (a paged pool or kernel must not treat them as heads).
    """


CACHE_KINDS["latent"] = lambda spec: LatentKVCache(spec.window)


def latent_cache_specs(num_layers: int) -> list[CacheSpec]:
    return [CacheSpec("latent") for _ in range(num_layers)]


# MLA's two down-projections of the hidden state (low-rank queries, latent + rope key)
LATENT_DOWN = ["q_a_proj", "kv_a_proj_with_mqa"]


def mla_scale(qk_head_dim: int, rope: dict) -> float:
    """Softmax scale: 1/sqrt(qk_head_dim), times YaRN's mscale^2 when `mscale_all_dim` is set."""
    scale = qk_head_dim**-0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


class MultiHeadLatentAttention(nn.Module):
    """MLA over the latent cache. `interleaved`: RoPE pairs are interleaved (DeepSeek layout).

    Parameter names follow transformers; config keys: hidden_size, num_attention_heads,
    q_lora_rank (None: a plain q_proj), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    v_head_dim, attention_bias (on q_a_proj, kv_a_proj_with_mqa and o_proj).
    """

    def __init__(self, config, layer_idx: int, scale: float, interleaved: bool):
        super().__init__()
        c = config
        self.layer_idx, self.scale, self.interleaved = layer_idx, scale, interleaved
        self.num_heads, self.rank = c.num_attention_heads, c.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        )
        q_dim, bias = self.num_heads * (self.nope_dim + self.rope_dim), c.attention_bias
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, q_dim, bias=False)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank)  # transformers keeps the default eps here
            self.q_b_proj = Linear(c.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank)
        self.kv_b_proj = Linear(
            self.rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = Linear(self.num_heads * self.v_dim, c.hidden_size, bias=bias)
        self.fused = False

    def kv_shape(self) -> KVShape:
        # one shared key [latent, rope key] per token whose first kv_lora_rank dims are the value
        return KVShape(1, self.rank + self.rope_dim, value_dim=self.rank)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden). `q_scale` (T,) multiplies the queries (Llama-4 scaling)."""
        T = x.shape[0]
        q, kv = self._query_and_latent(x, cos_sin)
        if q_scale is not None:
            q = q * q_scale[:, None, None].to(q.dtype)
        if batch.attention is not None:  # the paged runner's KV pool
            out = self._attend_paged(q, kv, batch.attention)
            return self.o_proj(out.reshape(T, -1))
        latent, k_rot = kv.split([self.rank, self.rope_dim], dim=-1)
        out = q.new_empty(T, self.num_heads, self.v_dim)
        for chunk in batch.chunks:
            rows = chunk.rows
            out[rows] = self._attend_chunk(
                q[rows], latent[rows], k_rot[rows], batch.positions[rows], chunk
            )
        return self.o_proj(out.reshape(T, -1))

    def _query_and_latent(self, x: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> roped queries (T, H, dn + dr) and kv (T, r + dr): the normed latent
        and the roped shared key, as the cache stores them (one Triton kernel on CUDA)."""
        q, kv_a = self.project(x)
        if fused.mla_rope_norm_serves(kv_a):
            norm = self.kv_a_layernorm
            kv = fused.mla_rope_norm(
                q, kv_a, norm.weight, norm.eps, *cos_sin, self.rank, self.interleaved
            )
            return q, kv
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = kv_a.split([self.rank, self.rope_dim], dim=-1)
        rope = apply_rope_interleaved if self.interleaved else apply_rope
        q_rot, k_rot = rope(q_rot, *cos_sin), rope(k_rot[:, None], *cos_sin)[:, 0]  # k_rot (T, dr)
        kv = torch.cat([self.kv_a_layernorm(latent), k_rot], dim=-1)
        return torch.cat([q_nope, q_rot], dim=-1), kv

    def fuse(self, backend: Backend) -> None:
        """One matmul for both down-projections, where the queries are low-rank (not
        minicpm3-style q_proj) and neither has a bias."""
        if hasattr(self, "q_a_proj") and all(getattr(self, n).bias is None for n in LATENT_DOWN):
            self.latent_down = concat_projection(self, LATENT_DOWN)
            self.fused = True

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> queries (T, H, dn + dr), kv_a (T, r + dr) before RoPE and the norm."""
        if self.fused:  # one GEMM; its outputs' parts are row-strided views of it
            q_a, kv_a = self.latent_down(x).split(
                [self.q_a_proj.out_features, self.kv_a_proj_with_mqa.out_features], dim=-1
            )
            q = self.q_b_proj(self.q_a_layernorm(q_a))
            return q.view(x.shape[0], self.num_heads, -1), kv_a
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, -1), self.kv_a_proj_with_mqa(x)

    def _attend_chunk(self, q, latent, k_rot, q_pos, chunk) -> torch.Tensor:
        """One sequence's m queries (m, H, dn + dr) over its cache -> (m, H, dv)."""
        layer = chunk.cache.layers[self.layer_idx]
        latents, rot_keys, k_pos = layer.update(
            latent[None], k_rot[None], q_pos
        )  # (1, L, r), (1, L, dr)
        mask = visible_mask(q_pos, k_pos)  # (m, L): from the positions the cache returned
        q = q.transpose(0, 1)  # (H, m, dn + dr)
        m = q.shape[1]
        # latent space costs ~m*(2r + dr) per key and head, expanding ~r*(dn + dv) per key
        if m * (2 * self.rank + self.rope_dim) < self.rank * (self.nope_dim + self.v_dim):
            out = self._attend_latent(q, latents, rot_keys, mask)
        else:
            out = self._attend_expanded(q, latents, rot_keys, mask)
        return out.transpose(0, 1)

    def _attend_expanded(self, q, latents, rot_keys, mask) -> torch.Tensor:
        # per-head keys [W_uk c, k_rot] (H, L, dn + dr) and values W_uv c (H, L, dv)
        L = latents.shape[1]
        kv = self.kv_b_proj(latents[0]).view(L, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, values = kv.transpose(0, 1).split([self.nope_dim, self.v_dim], dim=-1)
        keys = torch.cat([k_nope, rot_keys.expand(self.num_heads, L, self.rope_dim)], dim=-1)
        return attend(q, keys, values, mask, self.scale)

    def _attend_latent(self, q, latents, rot_keys, mask) -> torch.Tensor:
        # fold W_uk into the query and W_uv into the output: MQA over keys [c, k_rot], values c
        keys = torch.cat([latents, rot_keys], dim=-1)  # (1, L, r + dr)
        out = attend(self._absorb_query(q), keys, latents, mask, self.scale)  # (H, m, r)
        return self._expand_output(out)

    def _attend_paged(self, q, kv, attention) -> torch.Tensor:
        """(T, H, dn + dr) queries of the packed batch over the pool's latents -> (T, H, dv);
        kv (T, r + dr) is the batch's own [latent, rope key], written to the pool."""
        q_latent = self._absorb_query(q.transpose(0, 1)).transpose(0, 1).contiguous()
        out = attention.latent(q_latent, kv[:, None], self.layer_idx, self.scale)  # (T, H, r)
        return self._expand_output(out.transpose(0, 1)).transpose(0, 1)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as W_uk (H, dn, r) and W_uv (H, dv, r)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        return w.split([self.nope_dim, self.v_dim], dim=1)

    def _absorb_query(self, q) -> torch.Tensor:
        """(H, m, dn + dr) -> (H, m, r + dr): W_uk folded into the no-RoPE part."""
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        return torch.cat([q_nope @ self._absorbed()[0], q_rot], dim=-1)

    def _expand_output(self, out) -> torch.Tensor:
        """(H, m, r) latent-space outputs -> (H, m, dv) through W_uv."""
        return out @ self._absorbed()[1].transpose(1, 2)


class MLABlock(nn.Module):
    """Pre-norm decoder layer: MLA then a feed-forward (dense MLP or MoE), each residual branch
    multiplied by `residual_scale` (MiniCPM3's depth scaling; 1 elsewhere)."""

    def __init__(self, config, attn: MultiHeadLatentAttention, mlp: nn.Module, residual_scale=1.0):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_scale = residual_scale

    def forward(self, x, batch: ForwardBatch, cos_sin, q_scale=None) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), batch, cos_sin, q_scale)
        x, h = self.post_attention_layernorm.add_norm(x, h, self.residual_scale)
        h = self.mlp(h)
        return x + h * self.residual_scale if self.residual_scale != 1.0 else x + h


def llama4_query_scale(positions: torch.Tensor, beta: float, original_max: int) -> torch.Tensor:
    """(T,) query multipliers from absolute positions: attention stays sharp at long range."""
    return 1 + beta * torch.log1p(torch.floor(positions.float() / original_max))


def mla_block(config, layer_idx: int, mlp: nn.Module) -> MLABlock:
    """Layer `layer_idx` of an MLA stack, with the feed-forward `mlp`."""
    scale = mla_scale(config.qk_nope_head_dim + config.qk_rope_head_dim, rope_parameters(config))
    interleaved = bool(config.rope_interleave)
    return MLABlock(config, MultiHeadLatentAttention(config, layer_idx, scale, interleaved), mlp)


class MLADecoder(nn.Module):
    """The DeepSeek-V3-shaped stack mistral4 and glm4_moe_lite share: embeddings, one rotary table
    for the RoPE part, MLA blocks whose feed-forward `feed_forward(config, i)` builds (dense MLP or
    MoE), a final norm. With `llama_4_scaling_beta` in the RoPE parameters (Mistral 4) queries are
    scaled by `llama4_query_scale` of their absolute positions, never the live window."""

    def __init__(self, config, feed_forward):
        super().__init__()
        rope = rope_parameters(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            config.qk_rope_head_dim,
            rope["rope_theta"],
            rope,
            rope_attention_factor(rope, config.max_position_embeddings),
        )
        self.beta = rope.get("llama_4_scaling_beta")
        self.original_max = rope.get("original_max_position_embeddings")
        self.layers = nn.ModuleList(
            mla_block(config, i, feed_forward(config, i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        cos_sin = self.rotary_emb(batch.positions)  # absolute positions, shared by every layer
        q_scale = None
        if self.beta is not None:
            q_scale = llama4_query_scale(batch.positions, self.beta, self.original_max)
        for layer in self.layers:
            x = layer(x, batch, cos_sin, q_scale)
        return final_norm(self.norm, x, batch)


class LatentCausalLM(CausalLM):
    """A family whose every layer is MLA: each caches its latent and RoPE key ("latent" kind)."""

    def cache_specs(self) -> list[CacheSpec]:
        return latent_cache_specs(self.config.num_hidden_layers)

    def checkpoint_name(self, name: str) -> str | Slot:
        """mlx-lm stores `kv_b_proj` split per head: `embed_q` (H, r, dn), the key part
        transposed, and `unembed_out` (H, dv, r), the value part."""
        prefix, _, part = name.rpartition(".self_attn.")
        if part not in ("embed_q.weight", "unembed_out.weight"):
            return name
        c = self.config
        view = (c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        weight = f"{prefix}.self_attn.kv_b_proj.weight"
        if part == "embed_q.weight":
            return Slot(weight, (slice(None), slice(0, c.qk_nope_head_dim)), True, view)
        return Slot(weight, (slice(None), slice(c.qk_nope_head_dim, None)), view=view)

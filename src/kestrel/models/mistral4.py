"""Mistral 4 (transformers' Mistral4ForCausalLM): DeepSeek-V3-shaped decoder.

Multi-head latent attention (models/mla.py) with optional low-rank queries, a low-rank KV latent,
its own value head dim, YaRN RoPE on the rope part (interleaved pairs when `rope_interleave`),
and Llama-4 query scaling `1 + beta * log(1 + floor(pos / original_max_position_embeddings))`.
The first `first_k_dense_replace` layers have a dense MLP; the others a softmax-routed,
group-limited MoE with shared experts (models/moe.py).

RoPE and the query scaling use the batch's absolute positions (each cache's monotonic `offset`
onward), never the live window, so both stay right after a `--max-kv-size` trim.
"""

import torch
from torch import nn

from kestrel.cache import CacheSpec
from kestrel.models.base import CausalLM, Slot, rope_parameters
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, rope_attention_factor
from kestrel.models.mla import (
    MLABlock,
    MultiHeadLatentAttention,
    latent_cache_specs,
    latent_kv_bytes_per_token,
    mla_scale,
)
from kestrel.models.moe import SparseMoE, expert_slot


def feed_forward(config, layer_idx: int) -> nn.Module:
    if layer_idx < (config.first_k_dense_replace or 0):
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    return SparseMoE(
        config.hidden_size,
        config.moe_intermediate_size,
        config.n_routed_experts,
        config.num_experts_per_tok,
        act=config.hidden_act,
        scoring="softmax",
        normalize=bool(config.norm_topk_prob),
        routed_scaling=config.routed_scaling_factor,
        n_group=config.n_group or 1,
        topk_group=config.topk_group or 1,
        shared_intermediate=config.moe_intermediate_size * config.n_shared_experts,
    )


def llama4_query_scale(positions: torch.Tensor, beta: float, original_max: int) -> torch.Tensor:
    """(T,) query multipliers from absolute positions: attention stays sharp at long range."""
    return 1 + beta * torch.log1p(torch.floor(positions.float() / original_max))


class Mistral4Model(nn.Module):
    def __init__(self, config):
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
        scale = mla_scale(config.qk_nope_head_dim + config.qk_rope_head_dim, rope)
        self.layers = nn.ModuleList(
            MLABlock(
                config,
                MultiHeadLatentAttention(
                    config, i, scale, interleaved=bool(config.rope_interleave)
                ),
                feed_forward(config, i),
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        cos_sin = self.rotary_emb(batch.positions)  # shared by every layer
        q_scale = None
        if self.beta is not None:
            q_scale = llama4_query_scale(batch.positions, self.beta, self.original_max)
        for layer in self.layers:
            x = layer(x, batch, cos_sin, q_scale)
        return self.norm(x[batch.logits_rows])


class Mistral4ForCausalLM(CausalLM):
    backbone = Mistral4Model

    def cache_specs(self) -> list[CacheSpec]:
        return latent_cache_specs(self.config.num_hidden_layers)

    def checkpoint_name(self, name: str) -> str | Slot | None:
        # transformers saves stacked experts; older exports keep one tensor per expert
        return expert_slot(name, self.config.moe_intermediate_size) or name

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return latent_kv_bytes_per_token(self.config, dtype)

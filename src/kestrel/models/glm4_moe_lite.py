"""GLM-4.7-Flash style "MoE lite" (transformers' Glm4MoeLiteForCausalLM).

Multi-head latent attention (models/mla.py) with interleaved RoPE pairs (`rope_interleave`);
the cache keeps only each token's normed KV latent and shared RoPE key, so KV memory per token
is `kv_lora_rank + qk_rope_head_dim`. Feed-forward per `mlp_layer_types`: a dense MLP or a
sigmoid-routed MoE with score-correction bias, group-limited top-k, routed scaling and shared
experts (models/moe.py). Checkpoints store one tensor per expert and may carry multi-token
prediction layers past `num_hidden_layers`, which match no parameter and are skipped.
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
    if config.mlp_layer_types[layer_idx] == "dense":
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    return SparseMoE(
        config.hidden_size,
        config.moe_intermediate_size,
        config.n_routed_experts,
        config.num_experts_per_tok,
        act=config.hidden_act,
        scoring="sigmoid",
        normalize=bool(config.norm_topk_prob),
        routed_scaling=config.routed_scaling_factor,
        n_group=config.n_group,
        topk_group=config.topk_group,
        correction_bias=True,
        shared_intermediate=config.moe_intermediate_size * config.n_shared_experts,
    )


class Glm4MoeLiteModel(nn.Module):
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
        cos_sin = self.rotary_emb(batch.positions)  # absolute positions, shared by every layer
        for layer in self.layers:
            x = layer(x, batch, cos_sin)
        return self.norm(x[batch.logits_rows])


class Glm4MoeLiteForCausalLM(CausalLM):
    backbone = Glm4MoeLiteModel

    def cache_specs(self) -> list[CacheSpec]:
        return latent_cache_specs(self.config.num_hidden_layers)

    def checkpoint_name(self, name: str) -> str | Slot | None:
        # multi-token-prediction layers (past num_hidden_layers) match no parameter: skipped
        return expert_slot(name, self.config.moe_intermediate_size) or name

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return latent_kv_bytes_per_token(self.config, dtype)

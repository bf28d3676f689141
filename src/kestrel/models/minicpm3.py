"""MiniCPM3 (transformers' MiniCPM3ForCausalLM): Llama-shaped blocks with multi-head latent
attention (models/layers/mla.py, rotate-half RoPE), LongRoPE-scaled rotary embeddings, embeddings scaled
by `scale_emb`, residual branches scaled by `scale_depth / sqrt(num_hidden_layers)`, and hidden
states divided by `hidden_size / dim_model_base` before the (tied) LM head.

RoPE positions are the batch's absolute positions (the cache's monotonic `offset` onward), so
they keep growing after a `--max-kv-size` trim (docs/architecture.md §1).
"""

import math

import torch
from torch import nn

from kestrel.models.base import rope_parameters
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.mla import (
    LatentCausalLM,
    MLABlock,
    MultiHeadLatentAttention,
    mla_scale,
)
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.rope import LongRotaryEmbedding, RotaryEmbedding, rope_attention_factor


def rotary_embedding(config) -> nn.Module:
    """LongRoPE when the config asks for it, else the plain (or yarn/linear...) table."""
    params = rope_parameters(config)
    dim, theta = config.qk_rope_head_dim, params["rope_theta"]
    factor = rope_attention_factor(params, config.max_position_embeddings)
    if params.get("rope_type") == "longrope":
        return LongRotaryEmbedding(dim, theta, params, factor)
    return RotaryEmbedding(dim, theta, params, factor)


class MiniCPM3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.scale_emb
        self.rotary_emb = rotary_embedding(config)
        scale = mla_scale(
            config.qk_nope_head_dim + config.qk_rope_head_dim, rope_parameters(config)
        )
        residual_scale = config.scale_depth / math.sqrt(config.num_hidden_layers)
        self.layers = nn.ModuleList(
            MLABlock(
                config,
                MultiHeadLatentAttention(config, i, scale, interleaved=False),
                GatedMLP(
                    config.hidden_size,
                    config.intermediate_size,
                    config.hidden_act,
                    bias=config.mlp_bias,
                ),
                residual_scale,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def rope(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.rotary_emb, LongRotaryEmbedding):
            return self.rotary_emb(batch)  # picks short/long factors per chunk
        return self.rotary_emb(batch.positions)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        cos_sin = self.rope(batch)  # absolute positions, shared by every layer
        for layer in self.layers:
            x = layer(x, batch, cos_sin)
        return self.norm(x[batch.logits_rows])


class MiniCPM3ForCausalLM(LatentCausalLM):
    backbone = MiniCPM3Model

    def __init__(self, config):
        super().__init__(config)
        self.logits_scaling = config.hidden_size / config.dim_model_base

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden / self.logits_scaling)

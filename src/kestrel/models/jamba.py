"""AI21 Jamba hybrid decoder (transformers' JambaForCausalLM).

Layer i is attention (GQA, no RoPE) when i % attn_layer_period == attn_layer_offset, else a Mamba
(v1) mixer whose dt, B and C are RMS-normed; its feed-forward is the shared MoE (softmax top-k,
weights not renormalised) when i % expert_layer_period == expert_layer_offset, else a gated MLP.
Mamba layers keep recurrent state, attention layers KV. Checkpoints store one tensor per expert.
"""

import torch
from torch import nn

from kestrel.cache.sequence import CacheSpec
from kestrel.models.base import CausalLM, Slot, head_dim
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.attention import Attention
from kestrel.models.layers.mamba import MambaMixer, conv_weight
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.moe import SparseMoE, expert_slot
from kestrel.models.layers.norm import RMSNorm


def is_attention(c, i: int) -> bool:
    return i % c.attn_layer_period == c.attn_layer_offset


def is_moe(c, i: int) -> bool:
    return c.num_experts > 1 and i % c.expert_layer_period == c.expert_layer_offset


def feed_forward(c, i: int) -> nn.Module:
    if is_moe(c, i):
        return SparseMoE(
            c.hidden_size,
            c.intermediate_size,
            c.num_experts,
            c.num_experts_per_tok,
            act=c.hidden_act,
            scoring="softmax",
            normalize=False,
        )
    return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)


def mamba_mixer(c, i: int) -> MambaMixer:
    return MambaMixer(
        i,
        c.hidden_size,
        c.mamba_expand * c.hidden_size,
        c.mamba_d_state,
        c.mamba_d_conv,
        c.mamba_dt_rank,
        c.hidden_act,
        conv_bias=c.mamba_conv_bias,
        bias=c.mamba_proj_bias,
        norm_eps=c.rms_norm_eps,
    )


def attention(c, i: int) -> Attention:
    return Attention(
        i, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_dim(c), None
    )


class JambaBlock(nn.Module):
    """x + mixer(norm(x)), then x + feed_forward(norm(x)); the mixer is `self_attn` or `mamba`."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.attends = is_attention(config, layer_idx)
        if self.attends:
            self.self_attn = attention(config, layer_idx)
        else:
            self.mamba = mamba_mixer(config, layer_idx)
        self.feed_forward = feed_forward(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, groups) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, batch) if self.attends else self.mamba(h, groups))
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class JambaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(JambaBlock(config, i) for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        groups = batch.state_groups  # shared by every Mamba layer
        for layer in self.layers:
            x = layer(x, batch, groups)
        return self.final_layernorm(x[batch.logits_rows])


class JambaForCausalLM(CausalLM):
    backbone = JambaModel

    def cache_specs(self) -> list[CacheSpec]:
        c = self.config
        return [
            CacheSpec("full") if is_attention(c, i) else CacheSpec("recurrent")
            for i in range(c.num_hidden_layers)
        ]

    def checkpoint_name(self, name: str) -> str | Slot | None:
        # transformers calls the router `router`; the shared MoE calls it `gate`
        name = name.replace(".feed_forward.router.", ".feed_forward.gate.")
        return expert_slot(name, self.config.intermediate_size) or name

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return conv_weight(name, tensor)

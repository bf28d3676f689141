"""Mistral 4 (transformers' Mistral4ForCausalLM): DeepSeek-V3-shaped decoder.

Multi-head latent attention (models/layers/mla.py) with optional low-rank queries, a low-rank KV latent,
its own value head dim, YaRN RoPE on the rope part (interleaved pairs when `rope_interleave`),
and Llama-4 query scaling `1 + beta * log(1 + floor(pos / original_max_position_embeddings))`.
The first `first_k_dense_replace` layers have a dense MLP; the others a softmax-routed,
group-limited MoE with shared experts (models/layers/moe.py).

RoPE and the query scaling use the batch's absolute positions (each cache's monotonic `offset`
onward), never the live window, so both stay right after a `--max-kv-size` trim.
"""

from torch import nn

from kestrel.models.base import Slot
from kestrel.models.layers.mla import LatentCausalLM, MLADecoder
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.moe import SparseMoE, expert_slot


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


class Mistral4Model(MLADecoder):
    def __init__(self, config):
        super().__init__(config, feed_forward)


class Mistral4ForCausalLM(LatentCausalLM):
    backbone = Mistral4Model

    def checkpoint_name(self, name: str) -> str | Slot | None:
        # transformers saves stacked experts; older exports keep one tensor per expert
        return expert_slot(name, self.config.moe_intermediate_size) or super().checkpoint_name(name)

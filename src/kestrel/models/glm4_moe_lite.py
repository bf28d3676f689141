"""GLM-4.7-Flash style "MoE lite" (transformers' Glm4MoeLiteForCausalLM).

Multi-head latent attention (models/layers/mla.py) with interleaved RoPE pairs (`rope_interleave`);
the cache keeps only each token's normed KV latent and shared RoPE key, so KV memory per token
is `kv_lora_rank + qk_rope_head_dim`. Feed-forward per `mlp_layer_types`: a dense MLP or a
sigmoid-routed MoE with score-correction bias, group-limited top-k, routed scaling and shared
experts (models/layers/moe.py). Checkpoints store one tensor per expert and may carry multi-token
prediction layers past `num_hidden_layers`, which match no parameter and are skipped.
"""

from torch import nn

from kestrel.models.base import Slot
from kestrel.models.layers.mla import LatentCausalLM, MLADecoder
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.moe import SparseMoE, expert_slot


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


class Glm4MoeLiteModel(MLADecoder):
    def __init__(self, config):
        super().__init__(config, feed_forward)


class Glm4MoeLiteForCausalLM(LatentCausalLM):
    backbone = Glm4MoeLiteModel

    def checkpoint_name(self, name: str) -> str | Slot | None:
        # multi-token-prediction layers (past num_hidden_layers) match no parameter: skipped
        return expert_slot(name, self.config.moe_intermediate_size) or name

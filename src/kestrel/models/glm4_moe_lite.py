"""GLM-4.7-Flash style "MoE lite" (transformers' Glm4MoeLiteForCausalLM).

Multi-head latent attention (models/layers/mla.py) with interleaved RoPE pairs (`rope_interleave`);
the cache keeps only each token's normed KV latent and shared RoPE key, so KV memory per token
is `kv_lora_rank + qk_rope_head_dim`. Feed-forward per `mlp_layer_types`: a dense MLP or a
sigmoid-routed MoE with score-correction bias, group-limited top-k, routed scaling and shared
experts (models/layers/moe.py). Checkpoints store one tensor per expert and carry a multi-token
prediction layer as layer `num_hidden_layers` (DeepSeek-V3's names: enorm, hnorm, eh_proj,
shared_head), an MoE block that `--speculative mtp` loads (models/layers/mtp.py) and that is
skipped otherwise.
"""

import copy

from torch import nn

from kestrel.models.base import Slot
from kestrel.models.layers.mla import LatentCausalLM, MLADecoder, latent_cache_specs, mla_block
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.moe import SparseMoE, expert_slot
from kestrel.models.layers.mtp import MultiTokenPredictor, predictor_name


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

    def next_token_predictor(self) -> MultiTokenPredictor:
        config = copy.copy(self.config)
        config.mlp_layer_types = ["sparse"]  # DeepSeek's MTP block is an MoE layer
        block = mla_block(config, 0, feed_forward(config, 0))
        spec = latent_cache_specs(1)[0]
        return MultiTokenPredictor(config, block, spec, chain_normed=False, blank_first=True)

    def checkpoint_name(self, name: str) -> str | Slot | None:
        mtp_prefix = f"model.layers.{self.config.num_hidden_layers}."
        if name.startswith(mtp_prefix):  # the MTP layer: loaded with --speculative mtp
            name = hasattr(self, "mtp") and predictor_name(name[len(mtp_prefix) :], MTP_NAMES, "")
            if not name:
                return None
        return expert_slot(name, self.config.moe_intermediate_size) or super().checkpoint_name(name)


# the MTP layer's own tensors; its copies of the embeddings and head are the model's
MTP_NAMES = {
    "enorm": "embed_norm",
    "hnorm": "hidden_norm",
    "eh_proj": "proj",
    "shared_head.norm": "norm",
    "shared_head.head": None,
    "embed_tokens": None,
}

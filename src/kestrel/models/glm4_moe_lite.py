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
from transformers import Glm4MoeLiteConfig

from kestrel.errors import UnsupportedModelError
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


# llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
GATING_SIGMOID = 2


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

    def gguf_names(self, table) -> dict[str, str]:
        names = super().gguf_names(table)
        for i in range(len(self.model.layers)):
            prefix = f"model.layers.{i}"
            # llama.cpp splits kv_b_proj per head as mlx-lm does (embed_q, unembed_out)
            names[f"blk.{i}.attn_k_b.weight"] = f"{prefix}.self_attn.embed_q.weight"
            names[f"blk.{i}.attn_v_b.weight"] = f"{prefix}.self_attn.unembed_out.weight"
            # every expert's projection in one (E, out, in) tensor, as mlx-lm's switch_mlp
            for proj in ("gate", "up", "down"):
                names[f"blk.{i}.ffn_{proj}_exps.weight"] = (
                    f"{prefix}.mlp.switch_mlp.{proj}_proj.weight"
                )
            names[f"blk.{i}.exp_probs_b.bias"] = f"{prefix}.mlp.gate.e_score_correction_bias"
        return names

    @classmethod
    def config_from_gguf(cls, meta) -> Glm4MoeLiteConfig:
        """llama.cpp's "deepseek2" metadata, as its converter writes GLM-4.7-Flash: a layer is
        sparse when it has a router (the leading dense count is not always written); the heads
        share one latent, so head_count_kv is 1 there and the query heads count here."""
        if meta.get("expert_gating_func", GATING_SIGMOID) != GATING_SIGMOID:
            raise UnsupportedModelError(
                "deepseek2 GGUF with softmax expert routing (DeepSeek-V2): not served; "
                "GLM-4.7-Flash-style sigmoid routing is"
            )
        if meta.get("rope.scaling.type", "none") != "none":
            raise UnsupportedModelError("deepseek2 GGUF with RoPE scaling: not served")
        n = meta["block_count"] - meta.get("nextn_predict_layers", 0)
        sparse = [f"blk.{i}.ffn_gate_inp.weight" in meta.shapes for i in range(n)]
        heads, rope_dim = meta["attention.head_count"], meta["rope.dimension_count"]
        return Glm4MoeLiteConfig(
            hidden_size=meta["embedding_length"],
            intermediate_size=meta["feed_forward_length"],
            num_hidden_layers=n,
            mlp_layer_types=["sparse" if s else "dense" for s in sparse],
            num_attention_heads=heads,
            num_key_value_heads=heads,
            q_lora_rank=meta.get("attention.q_lora_rank"),
            kv_lora_rank=meta["attention.kv_lora_rank"],
            qk_rope_head_dim=rope_dim,
            qk_nope_head_dim=meta["attention.key_length_mla"] - rope_dim,
            v_head_dim=meta["attention.value_length_mla"],
            rope_interleave=True,  # llama.cpp's deepseek2 graph rotates adjacent pairs
            rope_parameters={"rope_type": "default", "rope_theta": meta["rope.freq_base"]},
            moe_intermediate_size=meta["expert_feed_forward_length"],
            n_routed_experts=meta["expert_count"],
            num_experts_per_tok=meta["expert_used_count"],
            n_shared_experts=meta.get("expert_shared_count", 1),
            n_group=meta.get("expert_group_count", 1),
            topk_group=meta.get("expert_group_used_count", 1),
            routed_scaling_factor=meta.get("expert_weights_scale", 1.0),
            norm_topk_prob=meta.get("expert_weights_norm", False),
            rms_norm_eps=meta["attention.layer_norm_rms_epsilon"],
            max_position_embeddings=meta.get("context_length", 4096),
            num_nextn_predict_layers=meta.get("nextn_predict_layers", 0),
            **meta.vocabulary_fields(),
        )


# the MTP layer's own tensors; its copies of the embeddings and head are the model's
MTP_NAMES = {
    "enorm": "embed_norm",
    "hnorm": "hidden_norm",
    "eh_proj": "proj",
    "shared_head.norm": "norm",
    "shared_head.head": None,
    "embed_tokens": None,
}

"""EXAONE-MoE decoder (transformers' ExaoneMoeForCausalLM; K-EXAONE).

Sliding/full layers from `layer_types`; in a hybrid model only sliding layers use RoPE (the full
layers are NoPE). Per-head q/k RMSNorm. The feed-forward is a dense gated MLP where
`mlp_layer_types` says "dense", else the shared MoE: sigmoid scores, score-correction bias,
group-limited top-k, renormalised weights times `routed_scaling_factor`, plus shared experts.
Checkpoints store one tensor per expert; `checkpoint_name` maps them into the stacked weights.
GGUF files (llama.cpp's "exaone-moe") store gate and up experts as two stacked tensors; the config
comes from their metadata (`config_from_gguf`), which transformers cannot read.
"""

import copy

import torch
from torch import nn
from transformers import ExaoneMoeConfig

from kestrel.cache.sequence import CacheSpec
from kestrel.models.base import CausalLM, Slot, head_dim, rope_parameters
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.attention import Attention
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.moe import SparseMoE, expert_slot
from kestrel.models.layers.mtp import MultiTokenPredictor, final_norm, predictor_name
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.rope import RotaryEmbedding


def moe_layer(config) -> SparseMoE:
    return SparseMoE(
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts,
        config.num_experts_per_tok,
        act=config.hidden_act,
        scoring="sigmoid",
        normalize=config.norm_topk_prob,
        routed_scaling=config.routed_scaling_factor,
        n_group=config.n_group,
        topk_group=config.topk_group,
        correction_bias=True,
        shared_intermediate=config.moe_intermediate_size * config.num_shared_experts,
    )


class ExaoneMoeBlock(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        uses_rope = config.sliding_window is None or sliding  # hybrid models: full layers are NoPE
        self.self_attn = Attention(
            layer_idx,
            hidden,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim(config),
            rope if uses_rope else None,
            window=config.sliding_window if sliding else None,
            qk_norm_factory=lambda d: RMSNorm(d, eps),
        )
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = moe_layer(config)
        else:
            self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), batch, cos_sin)
        x, h = self.post_attention_layernorm.add_norm(x, h)
        return x + self.mlp(h)


class ExaoneMoeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        rope = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(head_dim(config), rope["rope_theta"], rope)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            ExaoneMoeBlock(config, i, self.rotary_emb) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        cos_sin = self.rotary_emb(batch.positions)  # (T, D) each, shared by the RoPE layers
        for layer in self.layers:
            x = layer(x, batch, cos_sin)
        return final_norm(self.norm, x, batch)


class ExaoneMoeForCausalLM(CausalLM):
    backbone = ExaoneMoeModel

    def cache_specs(self) -> list[CacheSpec]:
        windows = [layer.self_attn.window for layer in self.model.layers]
        return [CacheSpec("sliding", w) if w else CacheSpec("full") for w in windows]

    def next_token_predictor(self) -> MultiTokenPredictor:
        """vLLM's K-EXAONE MTP layer: a dense block whose attention is `mtp_layer_types[0]`."""
        config = copy.copy(self.config)
        kind = (getattr(config, "mtp_layer_types", None) or ["full_attention"])[0]
        config.layer_types, config.mlp_layer_types = [kind], ["dense"]
        block = ExaoneMoeBlock(config, 0, self.model.rotary_emb)
        window = block.self_attn.window
        spec = CacheSpec("sliding", window) if window else CacheSpec("full")
        return MultiTokenPredictor(config, block, spec, chain_normed=True, blank_first=False)

    def checkpoint_name(self, name: str) -> str | Slot | None:
        if name.startswith("mtp."):  # the MTP layer: loaded with --speculative mtp
            if not hasattr(self, "mtp"):
                return None
            return predictor_name(name.removeprefix("mtp."), MTP_NAMES, "layers.0.")
        name = name.replace("mlp.e_score_correction_bias", "mlp.gate.e_score_correction_bias")
        if name.endswith((".experts.gate_proj", ".experts.up_proj")):  # GGUF: (E, I, H) each
            I = self.config.moe_intermediate_size  # noqa: E741
            rows = slice(0, I) if name.endswith("gate_proj") else slice(I, 2 * I)
            return Slot(name.rsplit(".", 1)[0] + ".gate_up_proj", (slice(None), rows))
        return expert_slot(name, self.config.moe_intermediate_size) or name

    def gguf_names(self, table) -> dict[str, str]:
        names = super().gguf_names(table)
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoE):
                prefix = f"model.layers.{i}.mlp"
                for proj in ("gate_proj", "up_proj"):  # stacked separately: ffn_{gate,up}_exps
                    names[table.get_name(f"{prefix}.experts.{proj}") + ".weight"] = (
                        f"{prefix}.experts.{proj}"
                    )
                bias = table.get_name(f"{prefix}.gate.e_score_correction") + ".bias"
                names[bias] = f"{prefix}.gate.e_score_correction_bias"
        return names

    @classmethod
    def config_from_gguf(cls, meta) -> ExaoneMoeConfig:
        """llama.cpp's "exaone-moe" metadata; a layer is sparse when it has a router tensor.
        llama.cpp counts the multi-token-prediction layers in block_count, after the decoder's."""
        n = meta["block_count"] - meta.get("nextn_predict_layers", 0)
        window = meta.get("attention.sliding_window")
        sliding = meta.per_layer("attention.sliding_window_pattern", n, window is not None)
        sparse = [f"blk.{i}.ffn_gate_inp.weight" in meta.shapes for i in range(n)]
        heads = meta["attention.head_count"]
        return ExaoneMoeConfig(
            hidden_size=meta["embedding_length"],
            intermediate_size=meta["feed_forward_length"],
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=meta["attention.head_count_kv"],
            head_dim=meta.get("attention.key_length", meta["embedding_length"] // heads),
            max_position_embeddings=meta.get("context_length", 4096),
            rms_norm_eps=meta["attention.layer_norm_rms_epsilon"],
            rope_parameters={"rope_type": "default", "rope_theta": meta.get("rope.freq_base")},
            sliding_window=window,
            layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
            mlp_layer_types=["sparse" if s else "dense" for s in sparse],
            moe_intermediate_size=meta["expert_feed_forward_length"],
            num_experts=meta["expert_count"],
            num_experts_per_tok=meta["expert_used_count"],
            n_group=meta.get("expert_group_count", 1),
            topk_group=meta.get("expert_group_used_count", 1),
            num_shared_experts=meta.get("expert_shared_count", 0),
            routed_scaling_factor=meta.get("expert_weights_scale", 1.0),
            norm_topk_prob=meta.get("expert_weights_norm", True),
            **meta.vocabulary_fields(),
        )


# the MTP layer's own tensors (checkpoint names under "mtp.")
MTP_NAMES = {
    "fc": "proj",
    "pre_fc_norm_embedding": "embed_norm",
    "pre_fc_norm_hidden": "hidden_norm",
    "norm": "norm",
}

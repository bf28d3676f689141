"""Gemma 3 text decoder (transformers' Gemma3ForCausalLM).

Interleaved sliding/global layers (`layer_types`), a RoPE base per layer type, (1 + w) RMSNorms
around both sublayers, per-head q/k norms, query scale from `query_pre_attn_scalar`, embeddings
scaled by sqrt(hidden), a GELU-tanh gated MLP, tied embeddings, optional final logit soft-capping.
"""

import torch
from torch import nn

from kestrel.cache.sequence import CacheSpec
from kestrel.models.base import CausalLM, rope_parameters
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.attention import Attention
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.rope import RotaryEmbedding


def gemma_norm(dim: int, eps: float) -> RMSNorm:
    return RMSNorm(dim, eps, unit_offset=True)


class Gemma3Block(nn.Module):
    def __init__(self, config, layer_idx: int, window: int | None, rope: RotaryEmbedding):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = Attention(
            layer_idx,
            hidden,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            rope,
            scale=config.query_pre_attn_scalar**-0.5,
            window=window,
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            qk_norm_factory=lambda d: gemma_norm(d, eps),
        )
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = gemma_norm(hidden, eps)
        self.post_attention_layernorm = gemma_norm(hidden, eps)
        self.pre_feedforward_layernorm = gemma_norm(hidden, eps)
        self.post_feedforward_layernorm = gemma_norm(hidden, eps)

    def forward(self, x, batch: ForwardBatch, cos_sin) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), batch, cos_sin)
        x = self.post_attention_layernorm.norm_add(h, x)
        return self.post_feedforward_layernorm.norm_add(
            self.mlp(self.pre_feedforward_layernorm(x)), x
        )


class Gemma3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layer_types = config.layer_types
        self.windows = [
            config.sliding_window if t == "sliding_attention" else None for t in self.layer_types
        ]
        # one rotary table per layer type: sliding layers use the local base, full ones the global
        self.rotary = nn.ModuleDict(
            {t: self._rotary(config, t) for t in sorted(set(self.layer_types))}
        )
        self.layers = nn.ModuleList(
            Gemma3Block(config, i, w, self.rotary[t])
            for i, (w, t) in enumerate(zip(self.windows, self.layer_types, strict=True))
        )
        self.norm = gemma_norm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def _rotary(config, layer_type: str) -> RotaryEmbedding:
        params = rope_parameters(config, layer_type)
        return RotaryEmbedding(config.head_dim, params["rope_theta"], params)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        cos_sin = {t: rope(batch.positions) for t, rope in self.rotary.items()}
        for layer in self.layers:
            x = layer(x, batch, cos_sin[layer.layer_type])
        return self.norm(x[batch.logits_rows])


class Gemma3ForCausalLM(CausalLM):
    backbone = Gemma3Model

    def __init__(self, config):
        super().__init__(config)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def cache_specs(self) -> list[CacheSpec]:
        return [CacheSpec("sliding", w) if w else CacheSpec("full") for w in self.model.windows]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits

    def checkpoint_name(self, name: str) -> str | None:
        # multimodal Gemma 3 checkpoints nest the text model; we serve the text part. The released
        # files (and transformers' saves) use `language_model.model.*`, transformers' modules
        # `model.language_model.*`
        name = name.replace("language_model.model.", "model.", 1)
        name = name.replace("language_model.lm_head.", "lm_head.", 1)
        name = name.replace("model.language_model.", "model.", 1)
        if name.startswith(("vision_tower", "multi_modal_projector")):
            return None
        if name.startswith(("model.vision_tower", "model.multi_modal_projector")):
            return None
        return name

    @classmethod
    def complete_gguf_config(cls, config, meta):
        # llama.cpp's converter writes no query scale: llama.cpp takes 1/sqrt(hidden / heads) for
        # the 62-layer Gemma-3-27B and 1/sqrt(head size) for every other size
        layers, heads = config.num_hidden_layers, config.num_attention_heads
        config.query_pre_attn_scalar = (
            config.hidden_size // heads if layers == 62 else config.head_dim
        )
        config.final_logit_softcapping = meta.get("final_logit_softcapping")
        return config

    def gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # llama.cpp stores Gemma's RMSNorm weights as (1 + w)
        return tensor - 1 if name.endswith("norm.weight") else tensor

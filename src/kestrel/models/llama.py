"""Llama-style decoders: Llama 2/3 (and SmolLM2), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norms).

Follows transformers' LlamaForCausalLM; the flavours differ only in the flags of `FLAVORS`.
"""

import torch
from torch import nn

from kestrel.cache.sequence import CacheSpec
from kestrel.models.base import CausalLM, head_dim, rope_parameters
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.attention import Attention
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.rope import RotaryEmbedding

# model_type -> (bias on q/k/v, per-head q/k RMSNorm, Q/K rows permuted in llama.cpp's files:
# its converter permutes them for llama's interleaved RoPE, not for Qwen's rotate-half NEOX RoPE)
FLAVORS = {
    "llama": dict(qkv_bias=None, qk_norm=False, gguf_permuted=True),
    "mistral": dict(qkv_bias=False, qk_norm=False, gguf_permuted=True),
    "qwen2": dict(qkv_bias=True, qk_norm=False, gguf_permuted=False),
    "qwen3": dict(qkv_bias=None, qk_norm=True, gguf_permuted=False),
}


def layer_windows(config) -> list[int | None]:
    """Sliding window per layer, from `layer_types` when present, else one `sliding_window`."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * config.num_hidden_layers


class LlamaBlock(nn.Module):
    def __init__(self, config, layer_idx: int, window: int | None, rope: RotaryEmbedding):
        super().__init__()
        flavor = FLAVORS[config.model_type]
        bias = getattr(config, "attention_bias", False)
        eps = config.rms_norm_eps
        self.self_attn = Attention(
            layer_idx,
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim(config),
            rope,
            window=window,
            qkv_bias=bias if flavor["qkv_bias"] is None else flavor["qkv_bias"],
            o_bias=bias and config.model_type == "llama",
            qk_norm_factory=(lambda d: RMSNorm(d, eps)) if flavor["qk_norm"] else None,
        )
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=getattr(config, "mlp_bias", False),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x, batch: ForwardBatch, cos_sin) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), batch, cos_sin)
        x, h = self.post_attention_layernorm.add_norm(x, h)
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        rope = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(
            head_dim(config),
            rope["rope_theta"],
            rope,
            freq_factors=getattr(config, "rope_freq_factors", None),
        )
        self.windows = layer_windows(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaBlock(config, i, w, self.rotary_emb) for i, w in enumerate(self.windows)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        cos_sin = self.rotary_emb(batch.positions)  # shared by every layer
        for layer in self.layers:
            x = layer(x, batch, cos_sin)
        return self.norm(x[batch.logits_rows])


class LlamaForCausalLM(CausalLM):
    backbone = LlamaModel

    def cache_specs(self) -> list[CacheSpec]:
        return [CacheSpec("sliding", w) if w else CacheSpec("full") for w in self.model.windows]

    @classmethod
    def complete_gguf_config(cls, config, meta):
        # transformers reads no head size for llama and resets Qwen3's to 128
        config.head_dim = meta.get("attention.key_length", head_dim(config))
        # llama.cpp's converter writes Llama 3's RoPE scaling as per-frequency divisors
        factors = meta.tensor("rope_freqs.weight")
        if factors is not None:
            config.rope_freq_factors = factors.float().tolist()
        return config

    def gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # llama.cpp permutes Q/K rows for its interleaved RoPE; restore HF's rotate-half layout.
        c = self.config
        if not FLAVORS[c.model_type]["gguf_permuted"]:
            return tensor
        if name.endswith("q_proj.weight"):
            return unpermute_rows(tensor, c.num_attention_heads)
        if name.endswith("k_proj.weight"):
            return unpermute_rows(tensor, c.num_key_value_heads)
        return tensor


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: (H*D, in) rows from pair-interleaved to half-split."""
    out_dim = w.shape[0]
    return (
        w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )

"""Nemotron-NAS decoders (model_type "nemotron-nas": DeciLM-style Llama-3.x-Nemotron Nano/Super/Ultra).

A Llama whose blocks were chosen per layer by architecture search (`block_configs`). Each layer's
attention is a GQA block with its own KV-head count (`n_heads_in_group` query heads per KV head),
a single hidden->hidden linear layer (`replace_with_linear`), or nothing (`no_op`, and then no
input norm); each feed-forward is a gated MLP whose width comes from `ffn_mult`, a linear layer,
or nothing. RoPE is Llama's (with llama-3 scaling). transformers has no class for it: the
checkpoint ships remote code, so this module registers a config class for AutoConfig.
"""

from dataclasses import dataclass

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, LlamaConfig

import kestrel.cache.recurrent  # noqa: F401  registers the "none" cache kind
from kestrel.cache.sequence import CacheSpec
from kestrel.errors import UnsupportedModelError
from kestrel.models.base import CausalLM, head_dim, rope_parameters
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.attention import Attention
from kestrel.models.layers.linear import Linear
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.rope import RotaryEmbedding
from kestrel.models.llama import unpermute_rows


@strict
class NemotronNasConfig(LlamaConfig):
    """Llama's config plus `block_configs`; the global KV heads and MLP width are unused."""

    model_type = "nemotron-nas"
    block_configs: list | None = None
    intermediate_size: int | None = None
    # llama.cpp's per-frequency RoPE divisors (a GGUF's rope_freqs tensor, e.g. llama-3 scaling)
    rope_freq_factors: list | None = None


AutoConfig.register("nemotron-nas", NemotronNasConfig, exist_ok=True)


@dataclass(frozen=True)
class Block:
    """One layer's choice: attention "gqa" | "linear" | "none", ffn "mlp" | "linear" | "none"."""

    attention: str
    kv_heads: int
    ffn: str
    intermediate: int


def ffn_width(ffn_mult: float, hidden: int) -> int:
    """DeciLM's `_ffn_mult_to_intermediate_size`: 2/3 * mult * hidden, rounded up to 256."""
    width = int(2 * ffn_mult * hidden / 3)
    return -(-width // 256) * 256


def parse_block(config, raw: dict) -> Block:
    attn, ffn = raw.get("attention", {}), raw.get("ffn", {})
    for key in ("window_length", "num_sink_tokens"):
        if attn.get(key) is not None or attn.get("unshifted_sink"):
            raise UnsupportedModelError(f"nemotron-nas attention with {key} is not supported")
    attention = (
        "none" if attn.get("no_op") else "linear" if attn.get("replace_with_linear") else "gqa"
    )
    feed_forward = (
        "none" if ffn.get("no_op") else "linear" if ffn.get("replace_with_linear") else "mlp"
    )
    kv_heads = config.num_attention_heads // (attn.get("n_heads_in_group") or 1)
    width = ffn_width(ffn["ffn_mult"], config.hidden_size) if feed_forward == "mlp" else 0
    return Block(attention, kv_heads, feed_forward, width)


class LinearAttention(nn.Module):
    """An attention block replaced by one hidden->hidden linear layer (no cache, no positions)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear_attn = Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin) -> torch.Tensor:
        return self.linear_attn(x)


class LinearMLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear_mlp = Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_mlp(x)


class NasBlock(nn.Module):
    """Pre-norm residual block; a no-op sublayer has neither its norm nor its residual add."""

    def __init__(self, config, layer_idx: int, block: Block, rope: RotaryEmbedding):
        super().__init__()
        hidden, eps, bias = config.hidden_size, config.rms_norm_eps, config.attention_bias
        self.block = block
        if block.attention != "none":
            self.input_layernorm = RMSNorm(hidden, eps)
        if block.attention == "gqa":
            self.self_attn = Attention(
                layer_idx,
                hidden,
                config.num_attention_heads,
                block.kv_heads,
                head_dim(config),
                rope,
                qkv_bias=bias,
                o_bias=bias,
            )
        elif block.attention == "linear":
            self.self_attn = LinearAttention(hidden)
        if block.ffn != "none":
            self.post_attention_layernorm = RMSNorm(hidden, eps)
        if block.ffn == "mlp":
            mlp_bias = getattr(config, "mlp_bias", False)
            self.mlp = GatedMLP(hidden, block.intermediate, config.hidden_act, bias=mlp_bias)
        elif block.ffn == "linear":
            self.mlp = LinearMLP(hidden)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin) -> torch.Tensor:
        attention, ffn = self.block.attention != "none", self.block.ffn != "none"
        if attention and ffn:
            h = self.self_attn(self.input_layernorm(x), batch, cos_sin)
            x, h = self.post_attention_layernorm.add_norm(x, h)
            return x + self.mlp(h)
        if attention:
            x = x + self.self_attn(self.input_layernorm(x), batch, cos_sin)
        if ffn:
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class NemotronNasModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        rope = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(
            head_dim(config), rope["rope_theta"], rope, freq_factors=config.rope_freq_factors
        )
        self.blocks = [parse_block(config, raw) for raw in config.block_configs]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            NasBlock(config, i, block, self.rotary_emb) for i, block in enumerate(self.blocks)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        cos_sin = self.rotary_emb(batch.positions)  # (T, D) each, shared by the GQA layers
        for layer in self.layers:
            x = layer(x, batch, cos_sin)
        return self.norm(x[batch.logits_rows])


class NemotronNasForCausalLM(CausalLM):
    def __init__(self, config):
        super().__init__(config)
        if len(config.block_configs or []) != config.num_hidden_layers:
            raise UnsupportedModelError(
                f"nemotron-nas config has {len(config.block_configs or [])} block_configs "
                f"for {config.num_hidden_layers} layers"
            )
        self.model = NemotronNasModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def cache_specs(self) -> list[CacheSpec]:
        # only GQA layers keep keys; linear and no-op attention keep nothing per sequence
        return [CacheSpec("full" if b.attention == "gqa" else "none") for b in self.model.blocks]

    @classmethod
    def config_from_gguf(cls, meta) -> NemotronNasConfig:
        """llama.cpp's "deci" metadata: per-layer head counts and MLP widths say each block's kind
        (KV heads 0 with query heads: linear attention; both 0: none; width 0: no MLP)."""
        n, hidden = meta["block_count"], meta["embedding_length"]
        heads = meta.per_layer("attention.head_count", n)
        kv = meta.per_layer("attention.head_count_kv", n)
        widths = meta.per_layer("feed_forward_length", n)
        freqs = meta.tensor("rope_freqs.weight")
        return NemotronNasConfig(
            hidden_size=hidden,
            num_hidden_layers=n,
            num_attention_heads=max(heads),
            num_key_value_heads=None,
            block_configs=[
                gguf_block(h, k, w, hidden) for h, k, w in zip(heads, kv, widths, strict=True)
            ],
            max_position_embeddings=meta.get("context_length", 4096),
            rms_norm_eps=meta["attention.layer_norm_rms_epsilon"],
            rope_parameters={"rope_type": "default", "rope_theta": meta.get("rope.freq_base", 1e4)},
            rope_freq_factors=None if freqs is None else freqs.tolist(),
            **meta.vocabulary_fields(),
        )

    def gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # llama.cpp permutes Q/K rows for its interleaved RoPE, K with each layer's own KV heads
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            layer = int(name.split(".")[2])
            block = self.model.blocks[layer]
            heads = self.config.num_attention_heads if "q_proj" in name else block.kv_heads
            return unpermute_rows(tensor, heads)
        return tensor


def gguf_block(heads: int, kv_heads: int, width: int, hidden: int) -> dict:
    """One `block_configs` entry from a deci GGUF layer's head counts and MLP width."""
    # the ffn_mult that `ffn_width` turns back into `width` (a multiple of 256, as DeciLM's are)
    mult = (width + 0.5) * 1.5 / hidden if width else None
    return {
        "attention": {
            "n_heads_in_group": heads // kv_heads if kv_heads else None,
            "no_op": heads == 0,
            "replace_with_linear": heads > 0 and kv_heads == 0,
        },
        "ffn": {"ffn_mult": mult, "no_op": width == 0, "replace_with_linear": False},
    }

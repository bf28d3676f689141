"""Qwen3-VL (transformers' Qwen3VLForConditionalGeneration): Qwen2-VL's design (models/qwen2_vl.py)
with a Qwen3 decoder (per-head q/k RMSNorm, no q/k/v bias, explicit head_dim), interleaved
multimodal RoPE (t h w t h w ... frequencies), and DeepStack: features merged from intermediate
ViT blocks are added to the image tokens' hidden states after the first decoder layers. The ViT
adds a learned position table resampled to each image's grid (models/layers/qwen_vision.py).
"""

from torch import nn

from kestrel.models.base import rope_parameters
from kestrel.models.layers.attention import Attention
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.mrope import MRotaryEmbedding
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.qwen_vision import Qwen3VisionModel
from kestrel.models.qwen2_vl import DecoderLayer, Qwen2VLForConditionalGeneration


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    def build_rotary(self, text) -> MRotaryEmbedding:
        rope = rope_parameters(text)
        sections = rope.get("mrope_section", [24, 20, 20])
        # transformers' Qwen3-VL always interleaves, whatever `mrope_interleaved` says
        return MRotaryEmbedding(
            text.head_dim, rope["rope_theta"], sections, interleaved=True, scaling=rope
        )

    def build_layer(self, text, i: int, window: int | None, rotary) -> DecoderLayer:
        eps, bias = text.rms_norm_eps, text.attention_bias
        attn = Attention(
            i,
            text.hidden_size,
            text.num_attention_heads,
            text.num_key_value_heads,
            text.head_dim,
            rotary,
            window=window,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm_factory=lambda d: RMSNorm(d, eps),
        )
        return DecoderLayer(text.hidden_size, eps, attn, self.build_mlp(text, i))

    def build_mlp(self, text, i: int) -> nn.Module:
        return GatedMLP(text.hidden_size, text.intermediate_size, text.hidden_act)

    def build_visual(self, vision_config) -> nn.Module:
        return Qwen3VisionModel(vision_config)

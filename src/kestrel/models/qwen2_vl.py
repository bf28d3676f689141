"""Qwen2-VL (transformers' Qwen2VLForConditionalGeneration): a Qwen2 decoder (q/k/v bias,
optional sliding-window layers) with multimodal RoPE, whose image tokens take the features of a
ViT with patch merging (models/layers/qwen_vision.py).

How images reach the decoder: the engine turns a chat request into a `MultimodalPrompt`
(models/qwen_vl_processor.py), encodes its images once with `encode_images`, and gives each prefill
chunk the M-RoPE ids and image features of its rows (`SeqChunk.rope_positions`, `.images`, from
`MultimodalPrompt.chunk_inputs`); a chunk may end inside an image. Text-only batches take the
plain RoPE path; text rows of a sequence with images (decode) are shifted by its
`cache.rope_delta` (models/layers/mrope.py). Qwen3-VL and Qwen3-VL-MoE subclass this file's model.
"""

import torch
from torch import nn

from kestrel.cache.sequence import CacheSpec
from kestrel.models.base import CausalLM, rope_parameters
from kestrel.models.base import head_dim as base_head_dim
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.attention import Attention
from kestrel.models.layers.linear import Linear
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.mrope import MRotaryEmbedding
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.qwen_vision import Qwen2VisionTransformer, VisionFeatures
from kestrel.models.llama import layer_windows


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP (or MoE), both residual."""

    def __init__(self, hidden: int, eps: float, attn: Attention, mlp: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, batch: ForwardBatch, cos_sin) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), batch, cos_sin)
        x, h = self.post_attention_layernorm.add_norm(x, h)
        return x + self.mlp(h)


class TextModel(nn.Module):
    """The decoder: image features replace the image tokens' embeddings, DeepStack features (if
    any) are added to the same rows after the first layers."""

    def __init__(self, config, layers: list[nn.Module], rotary: MRotaryEmbedding):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)  # (T, hidden)
        images = batch.images
        if images is not None:
            x = x.index_copy(0, images.rows, images.embeds.to(x.dtype))
        cos_sin = self.rotary_emb(batch.rope_positions)  # shared by every layer
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, cos_sin)
            if images is not None and i < len(images.deepstack):
                x = x.index_add(0, images.rows, images.deepstack[i].to(x.dtype))
        return self.norm(x[batch.logits_rows])


class Qwen2VLModel(nn.Module):
    def __init__(self, visual: nn.Module, language_model: TextModel):
        super().__init__()
        self.visual, self.language_model = visual, language_model


class Qwen2VLForConditionalGeneration(CausalLM):
    multimodal = True
    replicated = ("model.visual",)

    def __init__(self, config):
        super().__init__(config)
        text = config.text_config
        self.windows = layer_windows(text)
        rotary = self.build_rotary(text)
        layers = [self.build_layer(text, i, w, rotary) for i, w in enumerate(self.windows)]
        visual = self.build_visual(config.vision_config)
        self.model = Qwen2VLModel(visual, TextModel(text, layers, rotary))
        self.lm_head = Linear(text.hidden_size, text.vocab_size, bias=False)
        self.tie_weights()

    # --- what the Qwen-VL generations change ---------------------------------------------------

    def build_rotary(self, text) -> MRotaryEmbedding:
        head_dim = base_head_dim(text)
        rope = rope_parameters(text)
        sections = rope.get("mrope_section", [16, 24, 24])
        return MRotaryEmbedding(head_dim, rope["rope_theta"], sections, scaling=rope)

    def build_layer(self, text, i: int, window: int | None, rotary) -> DecoderLayer:
        head_dim = base_head_dim(text)
        attn = Attention(
            i,
            text.hidden_size,
            text.num_attention_heads,
            text.num_key_value_heads,
            head_dim,
            rotary,
            window=window,
            qkv_bias=True,
        )
        mlp = GatedMLP(text.hidden_size, text.intermediate_size, text.hidden_act)
        return DecoderLayer(text.hidden_size, text.rms_norm_eps, attn, mlp)

    def build_visual(self, vision_config) -> nn.Module:
        return Qwen2VisionTransformer(vision_config)

    # --- the CausalLM contract -----------------------------------------------------------------

    def cache_specs(self) -> list[CacheSpec]:
        return [CacheSpec("sliding", w) if w else CacheSpec("full") for w in self.windows]

    def decoder_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.language_model(batch)

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionFeatures:
        """A prompt's images (the image processor's pixel_values (P, C*t*p*p) and grid_thw (n, 3))
        -> one feature row per image token, in prompt order."""
        return self.model.visual(pixel_values, grid_thw)

    def checkpoint_name(self, name: str) -> str | None:
        # checkpoints saved before transformers 4.52 keep `visual.*` and the decoder in `model.*`
        if name.startswith("visual."):
            return "model." + name
        if name.startswith("model.") and not name.startswith(("model.visual.", "model.language_")):
            return "model.language_model." + name[len("model.") :]
        return name

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

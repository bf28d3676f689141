"""Gemma 4 text decoder (transformers' Gemma4ForCausalLM, and the text part of Gemma4 checkpoints).

Sliding/full layers from `layer_types`. Full layers have their own head dim and KV heads
(`per_layer_config`, from `global_head_dim`/`num_global_key_value_heads`) and "proportional"
partial RoPE; with `attention_k_eq_v` they have no v_proj: values are the raw k_proj output.
q/k RMSNorms and a scale-free v norm replace the 1/sqrt(d) query scale. The last
`num_kv_shared_layers` layers compute no K/V: they attend over the cache of the last earlier layer
of their type. Per-layer input embeddings (PLE) gate a residual into every layer; the
feed-forward is a dense gated MLP, plus routed experts when `enable_moe_block`; each layer ends
with a learned `layer_scalar`; logits are soft-capped. GGUF files (llama.cpp's "gemma4") keep HF's
norm weights and tensor layouts; their config is rebuilt from the metadata (`config_from_gguf`).
"""

import torch
from torch import nn
from transformers import Gemma4TextConfig

import kestrel.cache.recurrent  # noqa: F401  registers the "none" cache kind
from kestrel.cache.paged import paged_attention
from kestrel.cache.sequence import CacheSpec, KVShape
from kestrel.kernels import fused
from kestrel.kernels.backend import Backend
from kestrel.kernels.fused import ACTIVATIONS, rope_qk, rope_store
from kestrel.models.base import CausalLM, Slot, rope_parameters
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.attention import cached_attention
from kestrel.models.layers.linear import Linear, concat_projection
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.moe import Experts, expert_slot, route_topk
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.rope import RotaryEmbedding, apply_rope


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (Gemma 4's v norm and router norm), in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def layer_dims(config, layer_idx: int) -> tuple[int, int]:
    """(KV heads, head dim) of a layer: full layers override both through `per_layer_config`."""
    layer = config.per_layer_config[layer_idx] if hasattr(config, "per_layer_config") else config
    return layer.num_key_value_heads, layer.head_dim


def kv_sources(config) -> list[int]:
    """For each layer, the layer whose cache it attends over: itself, or for the last
    `num_kv_shared_layers` layers the last earlier non-shared layer of the same type."""
    first_shared = config.num_hidden_layers - (config.num_kv_shared_layers or 0)
    types = config.layer_types
    sources = list(range(first_shared))
    for i in range(first_shared, config.num_hidden_layers):
        sources.append(max(j for j in range(first_shared) if types[j] == types[i]))
    return sources


def rotary(config, layer_type: str, head_dim: int) -> RotaryEmbedding:
    params = rope_parameters(config, layer_type)
    if params.get("rope_type", "default") != "proportional":
        return RotaryEmbedding(head_dim, params["rope_theta"], params)
    # proportional: the first `partial_rotary_factor` of the frequencies rotate, the rest are 0
    # (cos 1, sin 0: unrotated), all over the full head dim
    rope = RotaryEmbedding(head_dim, params["rope_theta"])
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    rope.inv_freq[angles:] = 0.0
    rope.inv_freq /= params.get("factor", 1.0)
    return rope


class Gemma4Attention(nn.Module):
    def __init__(self, config, layer_idx: int, kv_source: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.layer_idx, self.kv_source, self.eps = layer_idx, kv_source, eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads, self.head_dim = layer_dims(config, layer_idx)
        self.window = config.sliding_window if sliding else None
        bias = config.attention_bias
        self.fused = False
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        if kv_source == layer_idx:  # KV-shared layers own no K/V weights
            self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
            self.k_norm = RMSNorm(self.head_dim, eps)
            k_eq_v = config.attention_k_eq_v and not sliding
            self.v_proj = (
                None if k_eq_v else Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
            )

    def kv_shape(self) -> KVShape | None:
        # only layers that own a cache store keys; full layers have their own head dim and heads
        return (
            KVShape(self.num_kv_heads, self.head_dim) if self.kv_source == self.layer_idx else None
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin) -> torch.Tensor:
        if self.fused and batch.attention is not None:
            return self._forward_fused(x, batch.attention, cos_sin)
        T = x.shape[0]
        cos, sin = cos_sin
        q = apply_rope(self.q_norm(self.q_proj(x).view(T, self.num_heads, self.head_dim)), cos, sin)
        if self.kv_source != self.layer_idx:
            out = cached_attention(
                q, None, None, self.layer_idx, batch, 1.0, self.window, self.kv_source
            )
        else:
            raw_k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
            raw_v = (
                raw_k
                if self.v_proj is None
                else self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
            )
            k = apply_rope(self.k_norm(raw_k), cos, sin)
            v = rms_norm(raw_v, self.eps)
            out = cached_attention(q, k, v, self.layer_idx, batch, 1.0, self.window)
        return self.o_proj(out.reshape(T, -1))

    def fuse(self, backend: Backend) -> None:
        """On CUDA over the paged pool: q, k and v from one projection; the heads' norms, RoPE,
        v's norm and the cache write in one kernel. Elsewhere the layer stays as it is."""
        if backend is not Backend.TRITON:
            return
        owns = self.kv_source == self.layer_idx
        names = ["q_proj", "k_proj", "v_proj"][: 1 if not owns else 2 if self.v_proj is None else 3]
        self.qkv = concat_projection(self, names)
        self.fused = True

    def _forward_fused(self, x: torch.Tensor, meta, cos_sin) -> torch.Tensor:
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        (cos, sin), qkv, layer = cos_sin, self.qkv(x), self.kv_source
        store = meta.pool.store(layer)
        if layer != self.layer_idx:  # reads another layer's keys: q alone
            q, _ = rope_qk(qkv, cos, sin, hq, 0, d, (self.q_norm.weight,) * 2 + (self.eps, False))
        else:
            norms = (self.q_norm.weight, self.k_norm.weight, self.eps, False)
            v_col = hq * d if self.v_proj is None else None  # k = v: v from k's raw columns
            slots, first = meta.slot_mapping, meta.calibrate
            q = rope_store(qkv, cos, sin, hq, hkv, d, store, slots, norms, self.eps, v_col, first)
        out = paged_attention(q, store, meta, 1.0, self.window, meta.use_triton)
        return self.o_proj(out.reshape(x.shape[0], -1))


class Gemma4Router(nn.Module):
    """Softmax top-k over experts on the normalised, scaled input; weights times per-expert scales."""

    def __init__(self, config):
        super().__init__()
        hidden, self.eps, self.top_k = config.hidden_size, config.rms_norm_eps, config.top_k_experts
        self.proj = Linear(hidden, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))
        self.fused = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:  # the weightless norm times `scale`: one RMSNorm kernel, `scale` its weight
            return self._route(fused.rms_norm(x, self.scale, self.eps, False) * x.shape[-1] ** -0.5)
        return self._route(rms_norm(x, self.eps) * self.scale * x.shape[-1] ** -0.5)

    def fuse(self, backend: Backend) -> None:
        self.fused = True

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = route_topk(self.proj(x), self.top_k, "softmax", normalize=True)
        return weights * self.per_expert_scale[ids].float(), ids


class Gemma4Block(nn.Module):
    def __init__(self, config, layer_idx: int, kv_source: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = Gemma4Attention(config, layer_idx, kv_source)
        wide = config.use_double_wide_mlp and kv_source != layer_idx
        self.mlp = GatedMLP(
            hidden, config.intermediate_size * (2 if wide else 1), config.hidden_activation
        )
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(self, f"{name}_layernorm", RMSNorm(hidden, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.per_layer = bool(config.hidden_size_per_layer_input)
        if self.per_layer:
            self.act = ACTIVATIONS[config.hidden_activation]
            self.per_layer_input_gate = Linear(
                hidden, config.hidden_size_per_layer_input, bias=False
            )
            self.per_layer_projection = Linear(
                config.hidden_size_per_layer_input, hidden, bias=False
            )
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)
        self.moe = config.enable_moe_block
        if self.moe:
            self.router = Gemma4Router(config)
            self.experts = Experts(
                config.num_experts, hidden, config.moe_intermediate_size, config.hidden_activation
            )
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)

    def forward(self, x, batch: ForwardBatch, cos_sin, per_layer_input) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), batch, cos_sin)
        x = self.post_attention_layernorm.norm_add(h, x)
        x = self.post_feedforward_layernorm.norm_add(self._feed_forward(x), x)
        if self.per_layer:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input  # (T, P)
            x = self.post_per_layer_input_norm.norm_add(self.per_layer_projection(gated), x)
        return x * self.layer_scalar

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = self.mlp(self.pre_feedforward_layernorm(x))
        if not self.moe:
            return dense
        # the experts run beside the dense MLP, on the same residual, each with its own norms
        routed = self.experts(self.pre_feedforward_layernorm_2(x), *self.router(x))
        routed = self.post_feedforward_layernorm_2(routed)
        return self.post_feedforward_layernorm_1.norm_add(dense, routed)


class Gemma4Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, layers = config.hidden_size, config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.embed_scale = hidden**0.5
        self.kv_sources = kv_sources(config)
        self.layers = nn.ModuleList(
            Gemma4Block(config, i, s) for i, s in enumerate(self.kv_sources)
        )
        # one rotary table per layer type: full layers have their own head dim and RoPE
        dims = {config.layer_types[i]: layer_dims(config, i)[1] for i in range(layers)}
        self.rotary = nn.ModuleDict({t: rotary(config, t, d) for t, d in sorted(dims.items())})
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.per_layer_dim = config.hidden_size_per_layer_input
        if self.per_layer_dim:
            self.embed_tokens_per_layer = nn.Embedding(
                config.vocab_size_per_layer_input, layers * self.per_layer_dim
            )
            self.per_layer_model_projection = Linear(
                hidden, layers * self.per_layer_dim, bias=False
            )
            self.per_layer_projection_norm = RMSNorm(self.per_layer_dim, config.rms_norm_eps)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(T, L, P): a per-layer token embedding plus a projection of the scaled input embedding."""
        T, P = x.shape[0], self.per_layer_dim
        tokens = self.embed_tokens_per_layer(input_ids) * torch.tensor(P**0.5, dtype=x.dtype)
        context = self.per_layer_model_projection(x) * x.shape[-1] ** -0.5
        context = self.per_layer_projection_norm(context.view(T, -1, P))
        return (context + tokens.view(T, -1, P)) * 2**-0.5

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)  # a packed embedding has no .weight to ask
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        per_layer = self.per_layer_inputs(batch.input_ids, x) if self.per_layer_dim else None
        cos_sin = {t: rope(batch.positions) for t, rope in self.rotary.items()}
        for i, layer in enumerate(self.layers):
            layer_input = per_layer[:, i] if per_layer is not None else None
            x = layer(x, batch, cos_sin[layer.layer_type], layer_input)
        return self.norm(x[batch.logits_rows])


class Gemma4ForCausalLM(CausalLM):
    backbone = Gemma4Model

    def __init__(self, config):
        super().__init__(config)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def cache_specs(self) -> list[CacheSpec]:
        specs = []
        for i, layer in enumerate(self.model.layers):
            window = layer.self_attn.window
            if self.model.kv_sources[i] != i:
                specs.append(CacheSpec("none"))  # reads its source layer's cache
            else:
                specs.append(CacheSpec("sliding", window) if window else CacheSpec("full"))
        return specs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits

    def checkpoint_name(self, name: str) -> str | Slot:
        # multimodal Gemma 4 checkpoints nest the text model; the other towers match no parameter
        name = name.replace("model.language_model.", "model.", 1)
        if ".experts.switch_glu." in name:  # mlx-lm's expert stacks, (E, rows, ...) a projection
            name = name.replace(".experts.switch_glu.", ".switch_mlp.")
            return expert_slot(name, self.config.moe_intermediate_size) or name
        return name

    def gguf_names(self, table) -> dict[str, str]:
        names = super().gguf_names(table)
        for i, layer in enumerate(self.model.layers):
            if layer.moe:  # llama.cpp files the router's scales under the router and the experts
                names[f"blk.{i}.ffn_gate_inp.scale"] = f"model.layers.{i}.router.scale"
                names[f"blk.{i}.ffn_down_exps.scale"] = f"model.layers.{i}.router.per_expert_scale"
        return names

    @classmethod
    def config_from_gguf(cls, meta) -> Gemma4TextConfig:
        """llama.cpp's "gemma4" metadata. Per-layer lists give the layer types (sliding pattern),
        KV heads and MLP widths (double-wide on KV-shared layers); the full layers' partial RoPE is
        the share of rope_freqs left at 1 (the rest are 1e30: unrotated); K = V when a full layer
        owning its cache has no V tensor."""
        n = meta["block_count"]
        sliding = meta.per_layer("attention.sliding_window_pattern", n, True)
        types = [SLIDING if s else FULL for s in sliding]
        kv = meta.per_layer("attention.head_count_kv", n)
        widths = meta.per_layer("feed_forward_length", n)
        shared = meta.get("attention.shared_kv_layers", 0)
        head_dim, global_head_dim = meta["attention.key_length_swa"], meta["attention.key_length"]
        full_owners = [i for i in range(n - shared) if types[i] == FULL]
        k_eq_v = any(f"blk.{i}.attn_v.weight" not in meta.shapes for i in full_owners)
        freqs = meta.tensor("rope_freqs.weight")
        partial = 1.0 if freqs is None else 2 * int((freqs == 1.0).sum()) / global_head_dim
        per_layer = meta.get("embedding_length_per_layer_input", 0)
        experts = meta.get("expert_count", 0)
        vocab = meta.shapes["token_embd.weight"][0]
        swa_rope = {"rope_type": "default", "rope_theta": meta.get("rope.freq_base_swa", 1e4)}
        rotary_swa = meta.get("rope.dimension_count_swa", head_dim)
        if rotary_swa != head_dim:
            swa_rope["partial_rotary_factor"] = rotary_swa / head_dim
        return Gemma4TextConfig(
            hidden_size=meta["embedding_length"],
            intermediate_size=min(widths),
            use_double_wide_mlp=max(widths) != min(widths),
            num_hidden_layers=n,
            num_attention_heads=meta["attention.head_count"],
            num_key_value_heads=next(
                (k for k, t in zip(kv, types, strict=True) if t == SLIDING), kv[0]
            ),
            head_dim=head_dim,
            global_head_dim=global_head_dim,
            attention_k_eq_v=k_eq_v,
            num_global_key_value_heads=kv[full_owners[0]] if k_eq_v else None,
            num_kv_shared_layers=shared,
            layer_types=types,
            sliding_window=meta.get("attention.sliding_window", 512),
            rms_norm_eps=meta["attention.layer_norm_rms_epsilon"],
            max_position_embeddings=meta.get("context_length", 131072),
            final_logit_softcapping=meta.get("final_logit_softcapping"),
            rope_parameters={
                SLIDING: swa_rope,
                FULL: {
                    "rope_type": "proportional",
                    "partial_rotary_factor": partial,
                    "rope_theta": meta.get("rope.freq_base", 1e6),
                },
            },
            hidden_size_per_layer_input=per_layer,
            vocab_size_per_layer_input=meta.shapes.get("per_layer_token_embd.weight", (vocab,))[0],
            enable_moe_block=experts > 0,
            num_experts=experts or None,
            top_k_experts=meta.get("expert_used_count"),
            moe_intermediate_size=meta.get("expert_feed_forward_length"),
            **meta.vocabulary_fields(),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        )


SLIDING, FULL = "sliding_attention", "full_attention"

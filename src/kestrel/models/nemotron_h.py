"""NVIDIA Nemotron-H hybrid decoder (transformers' NemotronHForCausalLM; Nemotron-H, Nemotron 3).

`layers_block_type` (older configs: the `hybrid_override_pattern` string) chooses each layer's
mixer: Mamba2 with a grouped gated RMSNorm ("linear_attention", M), attention without RoPE
("full_attention", *), a squared-ReLU MLP ("mlp", -) or a MoE ("moe", E: sigmoid routing with
a score-correction bias, ungated experts, an optional latent projection, shared experts). Every
layer is `x + mixer(norm(x))`. Mamba2 layers keep recurrent state, attention layers KV, the rest
nothing. Checkpoints name the model `backbone` and store one tensor per expert.
"""

import torch
from torch import nn
from transformers import NemotronHConfig

from kestrel.cache.sequence import CacheSpec
from kestrel.kernels.fused import ACTIVATIONS
from kestrel.models.base import CausalLM, Slot, head_dim
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.attention import Attention
from kestrel.models.layers.linear import Linear
from kestrel.models.layers.mamba import Mamba2Mixer, conv_weight
from kestrel.models.layers.moe import Experts, SparseMoE, expert_slot
from kestrel.models.layers.norm import RMSNorm

CACHE_SPECS = {"linear_attention": CacheSpec("recurrent"), "full_attention": CacheSpec("full")}

# llama.cpp's tensors (its converter writes both "nemotron_h" and "nemotron_h_moe" files) -> ours
GGUF_NAMES = {
    "token_embd.weight": "model.embeddings.weight",
    "output_norm.weight": "model.norm_f.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {  # under blk.{i}. -> under model.layers.{i}.
    "attn_norm.weight": "norm.weight",
    "ssm_in.weight": "mixer.in_proj.weight",
    "ssm_conv1d.weight": "mixer.conv1d.weight",
    "ssm_conv1d.bias": "mixer.conv1d.bias",
    "ssm_dt.bias": "mixer.dt_bias",
    "ssm_a": "mixer.A_log",
    "ssm_d": "mixer.D",
    "ssm_norm.weight": "mixer.norm.weight",
    "ssm_out.weight": "mixer.out_proj.weight",
    "attn_q.weight": "mixer.q_proj.weight",
    "attn_k.weight": "mixer.k_proj.weight",
    "attn_v.weight": "mixer.v_proj.weight",
    "attn_output.weight": "mixer.o_proj.weight",
    "ffn_up.weight": "mixer.up_proj.weight",
    "ffn_down.weight": "mixer.down_proj.weight",
    "ffn_gate_inp.weight": "mixer.gate.weight",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps.weight": "mixer.experts.up_proj",
    "ffn_down_exps.weight": "mixer.experts.down_proj",
    "ffn_latent_down.weight": "mixer.fc1_latent_proj.weight",
    "ffn_latent_up.weight": "mixer.fc2_latent_proj.weight",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
}
# a layer's kind, by the tensor only that kind has
GGUF_LAYER_KINDS = {
    "ssm_in.weight": "linear_attention",
    "attn_q.weight": "full_attention",
    "ffn_gate_inp.weight": "moe",
    "ffn_up.weight": "mlp",
}


class NemotronHMLP(nn.Module):
    """down(act(up(x))), no gate."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHMoE(SparseMoE):
    """The shared MoE with ungated experts that may run in a smaller latent width
    (fc1_latent_proj in, fc2_latent_proj out), and an ungated shared-experts MLP."""

    def __init__(self, c):
        super().__init__(
            c.hidden_size,
            c.moe_intermediate_size,
            c.n_routed_experts,
            c.num_experts_per_tok,
            act=c.mlp_hidden_act,
            scoring="sigmoid",
            normalize=c.norm_topk_prob,
            routed_scaling=c.routed_scaling_factor,
            n_group=c.n_group,
            topk_group=c.topk_group,
            correction_bias=True,
        )
        latent = c.moe_latent_size or c.hidden_size
        self.experts = Experts(
            c.n_routed_experts, latent, c.moe_intermediate_size, c.mlp_hidden_act, gated=False
        )
        self.shared_experts = NemotronHMLP(
            c.hidden_size, c.moe_shared_expert_intermediate_size, c.mlp_hidden_act, c.mlp_bias
        )
        if c.moe_latent_size is not None:
            self.fc1_latent_proj = Linear(c.hidden_size, latent, bias=c.mlp_bias)
            self.fc2_latent_proj = Linear(latent, c.hidden_size, bias=c.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.experts(self.fc1_latent_proj(x), *self.route(x))
        return self.fc2_latent_proj(routed) + self.shared_experts(x)


def make_mixer(c, layer_idx: int) -> nn.Module:
    kind = c.layers_block_type[layer_idx]
    if kind == "linear_attention":
        return Mamba2Mixer(
            layer_idx,
            c.hidden_size,
            c.mamba_num_heads,
            c.mamba_head_dim,
            c.ssm_state_size,
            c.n_groups,
            c.conv_kernel,
            c.chunk_size,
            c.layer_norm_epsilon,
            c.mamba_hidden_act,
            conv_bias=c.use_conv_bias,
            bias=c.use_bias,
            # transformers' mixer bounds dt below by time_step_min, whatever time_step_limit says
            dt_limit=(c.time_step_min, float("inf")),
        )
    if kind == "full_attention":
        return Attention(
            layer_idx,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            head_dim(c),
            None,
        )
    if kind == "mlp":
        return NemotronHMLP(c.hidden_size, c.intermediate_size, c.mlp_hidden_act, c.mlp_bias)
    if kind == "moe":
        return NemotronHMoE(c)
    raise ValueError(f"unknown Nemotron-H layer type {kind!r}")


class NemotronHBlock(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.block_type = config.layers_block_type[layer_idx]
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = make_mixer(config, layer_idx)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, groups) -> torch.Tensor:
        h = self.norm(x)
        if self.block_type == "linear_attention":
            h = self.mixer(h, groups)
        elif self.block_type == "full_attention":
            h = self.mixer(h, batch)
        else:
            h = self.mixer(h)
        return x + h


class NemotronHModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            NemotronHBlock(config, i) for i in range(len(config.layers_block_type))
        )
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embeddings(batch.input_ids)
        groups = batch.state_groups  # shared by every Mamba2 layer
        for layer in self.layers:
            x = layer(x, batch, groups)
        return self.norm_f(x[batch.logits_rows])


class NemotronHForCausalLM(CausalLM):
    backbone = NemotronHModel

    def cache_specs(self) -> list[CacheSpec]:
        return [CACHE_SPECS.get(t, CacheSpec("none")) for t in self.config.layers_block_type]

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embeddings.weight

    def checkpoint_name(self, name: str) -> str | Slot | None:
        if name.startswith("mtp."):
            return None  # multi-token-prediction heads: speculative decoding, not served
        name = name.replace("backbone.", "model.", 1)
        return expert_slot(name, self.config.moe_intermediate_size, gate=None) or name

    def gguf_names(self, table) -> dict[str, str]:
        names = dict(GGUF_NAMES)
        for i in range(len(self.model.layers)):
            for theirs, ours in GGUF_LAYER_NAMES.items():
                names[f"blk.{i}.{theirs}"] = f"model.layers.{i}.{ours}"
        return names

    def gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # llama.cpp stores A = -exp(A_log) and D as (heads, 1), the conv kernel without its
        # channel axis and the gated norm's weight per group
        if name.endswith("mixer.A_log"):
            return torch.log(-tensor).reshape(-1)
        if name.endswith(("mixer.D", "mixer.norm.weight")):
            return tensor.reshape(-1)
        if name.endswith("mixer.conv1d.weight"):
            return tensor.unsqueeze(1)
        return tensor

    @classmethod
    def config_from_gguf(cls, meta) -> NemotronHConfig:
        """llama.cpp's "nemotron_h" and "nemotron_h_moe" metadata; each layer's kind comes from
        the tensors it has (the converter writes zero sizes for the kinds a file has not)."""
        n = meta["block_count"] - meta.get("nextn_predict_layers", 0)
        kinds = [
            next(k for t, k in GGUF_LAYER_KINDS.items() if f"blk.{i}.{t}" in meta.shapes)
            for i in range(n)
        ]
        mlp = next((i for i, k in enumerate(kinds) if k == "mlp"), None)
        ssm = next((i for i, k in enumerate(kinds) if k == "linear_attention"), None)
        ssm_heads = meta.shapes[f"blk.{ssm}.ssm_a"][0] if ssm is not None else 1
        heads = meta["attention.head_count"]
        return NemotronHConfig(
            hidden_size=meta["embedding_length"],
            layers_block_type=kinds,
            num_attention_heads=heads,
            num_key_value_heads=max(meta.per_layer("attention.head_count_kv", n)) or heads,
            head_dim=meta.get("attention.key_length"),
            max_position_embeddings=meta.get("context_length", 4096),
            intermediate_size=meta.shapes[f"blk.{mlp}.ffn_up.weight"][0] if mlp is not None else 1,
            ssm_state_size=meta.get("ssm.state_size", 128),
            mamba_num_heads=ssm_heads,
            mamba_head_dim=meta.get("ssm.inner_size", 0) // ssm_heads,
            n_groups=meta.get("ssm.group_count", 1),
            conv_kernel=meta.get("ssm.conv_kernel", 4),
            n_routed_experts=meta.get("expert_count", 1),
            num_experts_per_tok=meta.get("expert_used_count", 1),
            moe_intermediate_size=meta.get("expert_feed_forward_length", 1),
            moe_shared_expert_intermediate_size=meta.get("expert_shared_feed_forward_length", 1),
            n_shared_experts=meta.get("expert_shared_count", 1),
            moe_latent_size=meta.get("moe_latent_size"),
            n_group=meta.get("expert_group_count", 1),
            topk_group=meta.get("expert_group_used_count", 1),
            norm_topk_prob=meta.get("expert_weights_norm", True),
            routed_scaling_factor=meta.get("expert_weights_scale", 1.0),
            layer_norm_epsilon=meta["attention.layer_norm_epsilon"],
            **meta.vocabulary_fields(),
        )

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return conv_weight(name, tensor)

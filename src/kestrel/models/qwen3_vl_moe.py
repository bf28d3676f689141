"""Qwen3-VL-MoE (transformers' Qwen3VLMoeForConditionalGeneration): Qwen3-VL (models/qwen3_vl.py)
whose feed-forward is a softmax-routed mixture of experts with renormalised top-k weights
(models/layers/moe.py), except in `mlp_only_layers` and off the `decoder_sparse_step` stride.
"""

import torch
from torch import nn

from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.moe import SparseMoE
from kestrel.models.qwen3_vl import Qwen3VLForConditionalGeneration


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    def build_mlp(self, text, i: int) -> nn.Module:
        sparse = (
            i not in (text.mlp_only_layers or [])
            and text.num_experts > 0
            and (i + 1) % text.decoder_sparse_step == 0
        )
        if not sparse:
            return GatedMLP(text.hidden_size, text.intermediate_size, text.hidden_act)
        return SparseMoE(
            text.hidden_size,
            text.moe_intermediate_size,
            text.num_experts,
            text.num_experts_per_tok,
            act=text.hidden_act,
        )

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # Qwen's released checkpoints store experts as (E, H, 2I) and (E, I, H); transformers
        # transposes any expert tensor whose shape is not the parameter's, and so do we
        if ".mlp.experts." in name and tensor.dim() == 3:
            shape = self.get_parameter(name).shape
            if tensor.shape != shape and tensor.transpose(1, 2).shape == shape:
                return tensor.transpose(1, 2)
        return tensor

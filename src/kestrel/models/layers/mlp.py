"""The gated MLP: down(act(gate(x)) * up(x))."""

import torch
from torch import nn

from kestrel.kernels.backend import Backend
from kestrel.kernels.fused import ACTIVATIONS, act_mul
from kestrel.models.layers.linear import Linear, concat_projection


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)). Fused (the paged runner's path): gate and up are one matmul
    over views of one weight, and act(gate) * up one kernel."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act_name, self.act = act, ACTIVATIONS[act]
        self.fused = False

    def fuse(self, backend: Backend) -> None:
        self.gate_up = concat_projection(self, ["gate_proj", "up_proj"])
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(act_mul(self.gate_up(x), self.act_name))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

"""RMSNorm, the norm every family uses (Gemma's (1 + w) form by a flag)."""

import torch
from torch import nn

from kestrel.kernels.backend import Backend
from kestrel.kernels.fused import add_rms_norm, rms_norm, rms_norm_add


class RMSNorm(nn.Module):
    """RMSNorm; `unit_offset` scales by (1 + w) as Gemma does. Computed in fp32. Once fused (the
    paged runner's path) each method is one kernel of kernels/fused.py, the same arithmetic."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset
        self.fused = False

    def fuse(self, backend: Backend) -> None:
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return rms_norm(x, self.weight, self.eps, self.unit_offset)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def add_norm(self, x: torch.Tensor, branch: torch.Tensor, scale: float = 1.0):
        """(x + branch * scale, this norm of it): the residual stream after a sublayer and the
        next sublayer's input."""
        if self.fused:
            return add_rms_norm(x, branch, self.weight, self.eps, self.unit_offset, scale)
        x = x + branch * scale if scale != 1.0 else x + branch
        return x, self(x)

    def norm_add(self, branch: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x + this norm of a sublayer's output (Gemma's sandwich norms)."""
        if self.fused:
            return rms_norm_add(branch, x, self.weight, self.eps, self.unit_offset)
        return x + self(branch)

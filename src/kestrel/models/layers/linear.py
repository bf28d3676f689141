"""The projections of every family: `Linear`, and `concat_projection`, which joins a module's
neighbouring projections (q/k/v, gate/up, MLA's two down-projections) into one matmul.

`Linear` is an `nn.Linear` whose fused path (the paged runner's: `fuse`) multiplies one row of x
by kernels/gemv.py's GEMV on CUDA, where cuBLAS is slow (split-K plus a reduction on the small
decode projections); every other shape, and the CPU, is `F.linear` as before.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels import gemv
from kestrel.kernels.backend import Backend
from kestrel.models.layers.lora import fused_with_lora
from kestrel.models.layers.quant import QuantLinear


class Linear(nn.Linear):
    """y = x @ W.T + b; one row of x by the Triton GEMV once fused on CUDA."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused = False

    def fuse(self, backend: Backend) -> None:
        """Take the GEMV where it serves x (only Triton has one: elsewhere it is F.linear)."""
        self.fused = backend is Backend.TRITON

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return gemv.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def concat_projection(module: nn.Module, names: list[str]) -> Callable:
    """x -> the Linears `names`' outputs side by side. Each run of neighbours that stack (plain
    Linears, or quantized ones of one kind: `_stackable`) becomes one weight the Linears keep
    views of; where the runs differ (llama.cpp's Q4_K_M keeps v in Q6_K in half the layers,
    q and k in Q4_K) each runs apart and their outputs are concatenated. LoRA adapters on the
    group add to the joined output (one kernel pair: models/layers/lora.py)."""
    linears = [getattr(module, n) for n in names]
    parts = [_stack(run) for run in _runs(linears)]
    if len(parts) == 1:
        return fused_with_lora(linears, parts[0])
    return fused_with_lora(linears, lambda x: torch.cat([part(x) for part in parts], dim=-1))


def _runs(linears: list) -> list[list]:
    """The Linears cut into runs of neighbours that stack."""
    runs = [[linears[0]]]
    for linear in linears[1:]:
        if _stackable([*runs[-1], linear]):
            runs[-1].append(linear)
        else:
            runs.append([linear])
    return runs


def _stack(linears: list) -> Callable:
    """x -> the outputs of a run of Linears that stack, from one weight and bias."""
    if len(linears) == 1:
        linear = linears[0]
        return lambda x: linear(x)  # a function, not the module: no second name in the model
    first = linears[0]
    bias = None if first.bias is None else torch.cat([linear.bias for linear in linears])
    if isinstance(first, nn.Linear):
        weight = _concat_into(linears, "weight")
        return lambda x: gemv.linear(x, weight, bias)
    tensors = {role: _concat_into(linears, role) for role in first.roles}
    qweight = tensors.pop("qweight")
    return QuantLinear(qweight, first.fmt, first.in_features, bias, **tensors).forward


def _stackable(linears: list) -> bool:
    """Whether Linears stack into one weight: plain ones, or quantized ones of one format whose
    tensors stack along the rows (`QuantFormat.stacks_rows`: GGUF blocks of one type, FP8 whose
    tiles never straddle two of them); all with biases or none."""
    first = linears[0]
    if len({linear.bias is None for linear in linears}) > 1:
        return False
    if all(isinstance(linear, nn.Linear) for linear in linears):
        return True
    if not all(isinstance(linear, QuantLinear) for linear in linears):
        return False
    alike = all((q.fmt, q.in_features) == (first.fmt, first.in_features) for q in linears)
    return alike and first.fmt.stacks_rows([q.out_features for q in linears])


def _concat_into(linears: list, name: str) -> torch.Tensor:
    """Concatenate the Linears' tensors `name` along the output axis; they keep views of it."""
    fused = torch.cat([getattr(linear, name) for linear in linears])
    start = 0
    for linear in linears:
        rows = getattr(linear, name).shape[0]
        view = fused[start : start + rows]
        if name == "weight":
            linear.weight = nn.Parameter(view, requires_grad=False)
        else:
            setattr(linear, name, view)  # a buffer: reassigning keeps it registered
        start += rows
    return fused

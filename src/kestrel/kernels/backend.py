"""Which implementation kestrel's kernels take on a device, decided in one place: Triton on
CUDA, the native C++ kernels on the CPU (kernels/cpu_native.py), else PyTorch's own ops (the
reference every other implementation is tested against).

A layer asks once, when it is fused for its device (models/layers/fused.py), and a kernel
function asks for the tensor it is given; either way the answer comes from `backend_for`.
Imports nothing from kestrel outside kestrel.kernels.
"""

import enum

import torch

from kestrel.kernels import cpu_native

try:
    import triton
except ImportError:  # CPU-only installs
    triton = None


class Backend(enum.Enum):
    TRITON = "triton"  # CUDA, with Triton installed
    CPU_NATIVE = "cpu_native"  # the CPU, with the native kernels compiled
    TORCH = "torch"  # PyTorch's ops: any device


def backend_for(device: torch.device | str) -> Backend:
    """The implementation kernels take on `device`."""
    kind = torch.device(device).type
    if kind == "cuda" and triton is not None:
        return Backend.TRITON
    if kind == "cpu" and cpu_native.available():
        return Backend.CPU_NATIVE
    return Backend.TORCH


def on_triton(x: torch.Tensor) -> bool:
    """Whether Triton kernels take the tensor `x`: `backend_for(x.device)` is TRITON (asked per
    call, cheaply)."""
    return x.is_cuda and triton is not None


def on_cpu_native(x: torch.Tensor) -> bool:
    """Whether the native kernels take the tensor `x`: `backend_for(x.device)` is CPU_NATIVE."""
    return x.device.type == "cpu" and cpu_native.available()

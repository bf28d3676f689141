"""`fuse_model`: a loaded model's layers take their fused paths for its device.

Each layer that has one owns it (`fuse`, and a `fused` flag its forward reads): q/k/v and
gate/up as one matmul over views of one weight (models/layers/linear.py), norms with the
residual add, RoPE with the q/k norms and the cache write (kernels/fused.py: Triton on CUDA, the
native kernels on the CPU), one-row GEMVs on CUDA. Names and memory stay the same; the paged
runner calls this once, after loading; the reference runner never does.
"""

from torch import nn

from kestrel.kernels.backend import Backend, backend_for


def fuse_model(model: nn.Module, backend: Backend | None = None) -> None:
    """Every layer of `model` that has a fused path takes it (for `backend`, by default the one
    of the model's device)."""
    backend = backend or backend_for(next(model.parameters()).device)
    for module in model.modules():
        if callable(getattr(module, "fuse", None)):
            module.fuse(backend)

"""Linear and embedding layers over quantized weights kept in memory: GGUF blocks, MLX affine,
FP8 and NVFP4 (each method one class of kernels/formats.py).

`QuantLinear` computes x @ W.T with the kernel its format picks for x (`QuantFormat.linear`:
on CUDA decode Triton GEMVs that read GGUF blocks and FP8 bytes, FP8 tensor-core GEMMs for
larger bfloat16 batches, the native GGUF matmuls on the CPU), and elsewhere by dequantizing W a
few output rows at a time, so the float copy alive at once stays near `CHUNK_BYTES` whatever
the matrix. `QuantEmbedding` dequantizes only the rows it gathers. Both hold the checkpoint's
tensors as buffers by role (`qweight`, the packed values, and the format's scales), and a tied
head shares its embedding's buffers. Loaders build them (weights/loader.py); model code calls
them as the nn.Linear / nn.Embedding they replace.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels.formats import GGUFFormat, QuantFormat

CHUNK_BYTES = 4 << 20  # float32 bytes of W dequantized at once on the CPU
CUDA_CHUNK_BYTES = 256 << 20  # on CUDA fewer, larger matmuls: launches cost more than memory

# Linear layers whose `.weight` model code reads as a tensor (MLA's absorbed attention reads
# kv_b_proj's, Mamba's dt_proj is applied with F.linear): they stay dense
DENSE_LINEARS = frozenset({"kv_b_proj", "dt_proj"})


class Quantized(nn.Module):
    """The buffers of one quantized weight (rows, cols) and its format (a `QuantFormat`, or a
    GGUF type name)."""

    def __init__(self, tensors: dict[str, torch.Tensor], fmt: QuantFormat | str, cols: int):
        super().__init__()
        for role, t in tensors.items():
            self.register_buffer(role, t)
        self.roles = tuple(tensors)
        self.fmt = GGUFFormat(fmt) if isinstance(fmt, str) else fmt
        self.qtype, self.cols = self.fmt.name, cols

    def tensors(self) -> dict[str, torch.Tensor]:
        return {role: getattr(self, role) for role in self.roles}

    def weight_rows(self, rows) -> torch.Tensor:
        """Rows `rows` (a slice or ids) of W, (n, cols) float32."""
        return self.fmt.dequantize_rows(self.tensors(), rows, self.cols)


class QuantLinear(Quantized):
    """y = x @ W.T (+ bias), W (out, in) quantized as `fmt` (a GGUF type name or a format)."""

    def __init__(self, qweight: torch.Tensor, fmt, in_features: int, bias=None, **scales):
        super().__init__({"qweight": qweight, **scales}, fmt, in_features)
        self.in_features, self.out_features = in_features, qweight.shape[0]
        self.bias = bias
        derived = self.fmt.linear_buffers(self.tensors(), in_features, self.out_features)
        for name, t in derived.items():  # what the format's kernels read (FP8 GEMM scales)
            self.register_buffer(name, t, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self.fmt.linear(self, rows)
        if out is None:
            out = self._dequantized_matmul(rows)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        budget = CUDA_CHUNK_BYTES if x.is_cuda else CHUNK_BYTES
        step = max(1, budget // (4 * self.in_features))
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for start in range(0, self.out_features, step):
            w = self.weight_rows(slice(start, start + step)).to(x.dtype)  # (rows, in)
            out[..., start : start + w.shape[0]] = F.linear(x, w)
        return out

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, qtype={self.qtype}"


class QuantEmbedding(Quantized):
    """Token ids -> rows of E (vocab, dim) quantized as `fmt`, as `dtype`."""

    def __init__(self, qweight, fmt, embedding_dim: int, dtype: torch.dtype, **scales):
        super().__init__({"qweight": qweight, **scales}, fmt, embedding_dim)
        self.embedding_dim, self.dtype = embedding_dim, dtype
        self.num_embeddings = qweight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight_rows(ids.reshape(-1))
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"


def quantized(module: nn.Module, qweight: torch.Tensor, fmt, dtype: torch.dtype, **scales):
    """The quantized twin of an nn.Linear or nn.Embedding (its bias kept as it is)."""
    if isinstance(module, nn.Embedding):
        return QuantEmbedding(qweight, fmt, module.embedding_dim, dtype, **scales)
    return QuantLinear(qweight, fmt, module.in_features, module.bias, **scales)

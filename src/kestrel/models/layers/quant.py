"""Linear and embedding layers over GGUF quantized blocks kept in memory (kernels/quant.py).

`QuantLinear` computes x @ W.T by dequantizing W a few output rows at a time, so the float copy
alive at once stays near `CHUNK_BYTES` whatever the matrix; `QuantEmbedding` dequantizes only the
rows it gathers. Both hold the file's bytes as a uint8 buffer `qweight` (rows, bytes per row), and
a tied head shares its embedding's buffer. Loaders build them (weights/loader.py); model code
calls them as the nn.Linear / nn.Embedding they replace.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels.quant import dequantize

CHUNK_BYTES = 4 << 20  # float32 bytes of W dequantized at once

# Linear layers whose `.weight` model code reads as a tensor (MLA's absorbed attention reads
# kv_b_proj's, Mamba's dt_proj is applied with F.linear): they stay dense
DENSE_LINEARS = frozenset({"kv_b_proj", "dt_proj"})


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias), W (out, in) in GGUF blocks of `qtype`."""

    def __init__(self, qweight: torch.Tensor, qtype: str, in_features: int, bias=None):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.qtype, self.in_features, self.out_features = qtype, in_features, qweight.shape[0]
        self.bias = bias
        self.chunk_rows = max(1, CHUNK_BYTES // (4 * in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for start in range(0, self.out_features, self.chunk_rows):
            rows = self.qweight[start : start + self.chunk_rows]
            w = dequantize(rows, self.qtype, self.in_features).to(x.dtype)  # (rows, in)
            out[..., start : start + w.shape[0]] = F.linear(x, w)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, qtype={self.qtype}"


class QuantEmbedding(nn.Module):
    """Token ids -> rows of E (vocab, dim) in GGUF blocks of `qtype`, as `dtype`."""

    def __init__(self, qweight: torch.Tensor, qtype: str, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.qtype, self.embedding_dim, self.dtype = qtype, embedding_dim, dtype
        self.num_embeddings = qweight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize(self.qweight[ids.reshape(-1)], self.qtype, self.embedding_dim)
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"


def quantized(module: nn.Module, qweight: torch.Tensor, qtype: str, dtype: torch.dtype):
    """The quantized twin of an nn.Linear or nn.Embedding (its bias kept as it is)."""
    if isinstance(module, nn.Embedding):
        return QuantEmbedding(qweight, qtype, module.embedding_dim, dtype)
    return QuantLinear(qweight, qtype, module.in_features, module.bias)

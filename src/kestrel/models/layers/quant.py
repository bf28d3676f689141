"""Linear and embedding layers over quantized weights kept in memory: GGUF blocks, MLX affine,
FP8 and NVFP4 (each format's decoding is one function of kernels/quant.py).

`QuantLinear` computes x @ W.T by dequantizing W a few output rows at a time, so the float copy
alive at once stays near `CHUNK_BYTES` whatever the matrix. On CUDA decode (a few rows of x)
reads GGUF blocks and FP8 weights in Triton GEMVs (kernels/gguf_gemv.py, kernels/fp8_gemv.py;
the k-quants on int8-quantized half-precision x in kernels/gguf_dp4a.py),
and larger FP8 batches multiply on the FP8 tensor cores, their activations quantized on the fly:
per row for a weight with one scale per row or per tensor (`torch._scaled_mm`), per 1 x 128
group for 128 x 128 tiles (the block-scaled `scaled_mm`, where the GPU runs it).
`QuantEmbedding` dequantizes only the rows it gathers. Both hold the checkpoint's tensors as
buffers by role (`qweight`, the packed values, and the format's scales), and a tied head shares
its embedding's buffers. Loaders build them (weights/loader.py); model code calls them as the
nn.Linear / nn.Embedding they replace.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels import cpu_native, fp8_gemv, gguf_dp4a, gguf_gemv
from kestrel.kernels.quant import (
    FP8_TILE,
    Format,
    dequantize_rows,
    fp8_block_gemm_works,
    fp8_block_linear,
    fp8_block_scales,
    fp8_linear,
)

CHUNK_BYTES = 4 << 20  # float32 bytes of W dequantized at once on the CPU
CUDA_CHUNK_BYTES = 256 << 20  # on CUDA fewer, larger matmuls: launches cost more than memory

# Linear layers whose `.weight` model code reads as a tensor (MLA's absorbed attention reads
# kv_b_proj's, Mamba's dt_proj is applied with F.linear): they stay dense
DENSE_LINEARS = frozenset({"kv_b_proj", "dt_proj"})


class Quantized(nn.Module):
    """The buffers of one quantized weight (rows, cols) and its `Format`."""

    def __init__(self, tensors: dict[str, torch.Tensor], fmt: Format | str, cols: int):
        super().__init__()
        for role, t in tensors.items():
            self.register_buffer(role, t)
        self.roles = tuple(tensors)
        self.fmt = fmt if isinstance(fmt, Format) else Format("gguf", qtype=fmt)
        self.qtype, self.cols = self.fmt.name, cols

    def tensors(self) -> dict[str, torch.Tensor]:
        return {role: getattr(self, role) for role in self.roles}

    def weight_rows(self, rows) -> torch.Tensor:
        """Rows `rows` (a slice or ids) of W, (n, cols) float32."""
        return dequantize_rows(self.fmt, self.tensors(), rows, self.cols)


class QuantLinear(Quantized):
    """y = x @ W.T (+ bias), W (out, in) quantized as `fmt` (a GGUF type name or a `Format`)."""

    def __init__(self, qweight: torch.Tensor, fmt, in_features: int, bias=None, **scales):
        super().__init__({"qweight": qweight, **scales}, fmt, in_features)
        self.in_features, self.out_features = in_features, qweight.shape[0]
        self.bias = bias
        self.register_buffer("fp8_scale", self._fp8_row_scale(), persistent=False)
        self.register_buffer("fp8_tiles", self._fp8_tile_scales(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8_cores = self.fp8_scale is not None or self.fp8_tiles is not None
        rows = x.reshape(-1, self.in_features)
        if self.fmt.kind == "gguf" and gguf_dp4a.serves(rows, self.qtype):  # half decode on CUDA
            out = gguf_dp4a.gemv(rows, self.qweight, self.qtype, self.in_features)
        elif self.fmt.kind == "gguf" and gguf_gemv.serves(rows, self.qtype):  # decode on CUDA
            out = gguf_gemv.gemv(rows, self.qweight, self.qtype, self.in_features)
        elif self.fmt.kind == "gguf" and not x.is_cuda and cpu_native.serves(self.qtype):
            out = cpu_native.gguf_mm(rows, self.qweight, self.qtype, self.in_features)
        elif self.fmt.kind == "fp8" and fp8_gemv.serves(rows, self.fmt.block):  # decode on CUDA
            out = fp8_gemv.gemv(rows, self.qweight, self.scale, self.fmt.block)
        elif fp8_cores and x.is_cuda and x.dtype == torch.bfloat16:
            out = self._fp8_matmul(rows)
        else:
            out = self._dequantized_matmul(rows)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def _fp8_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """(M, in) bfloat16 -> (M, out) on the FP8 tensor cores."""
        if self.fp8_scale is not None:
            return fp8_linear(x, self.qweight, self.fp8_scale)
        return fp8_block_linear(x, self.qweight, self.fp8_tiles)

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        budget = CUDA_CHUNK_BYTES if x.is_cuda else CHUNK_BYTES
        step = max(1, budget // (4 * self.in_features))
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for start in range(0, self.out_features, step):
            w = self.weight_rows(slice(start, start + step)).to(x.dtype)  # (rows, in)
            out[..., start : start + w.shape[0]] = F.linear(x, w)
        return out

    def _fp8_row_scale(self) -> torch.Tensor | None:
        """(1, out) float32 when W is FP8 with one scale per row or per tensor and the FP8 GEMM
        takes its shape (dims multiples of 16); None otherwise (tiles: `_fp8_tile_scales`)."""
        fmt = self.fmt
        whole_rows = fmt.block[1] >= self.in_features
        if fmt.kind != "fp8" or not whole_rows or (self.in_features | self.out_features) % 16:
            return None
        rows = torch.arange(self.out_features, device=self.scale.device) // fmt.block[0]
        return self.scale.float()[rows, 0].reshape(1, -1).contiguous()

    def _fp8_tile_scales(self) -> torch.Tensor | None:
        """The block-scaled GEMM's scales when W is FP8 in 128 x 128 tiles that cover it whole and
        this GPU runs that GEMM (`fp8_block_gemm_works`); None otherwise (dequantize)."""
        tiled = self.fmt.block == (FP8_TILE, FP8_TILE) if self.fmt.kind == "fp8" else False
        whole = (self.in_features % FP8_TILE, self.out_features % FP8_TILE) == (0, 0)
        if not (tiled and whole and fp8_block_gemm_works(self.qweight.device)):
            return None
        return fp8_block_scales(self.scale)

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

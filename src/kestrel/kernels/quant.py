"""GGUF (llama.cpp) quantized blocks dequantized with PyTorch ops, bit for bit as gguf-py's
`gguf.quants.dequantize`: the same float16 scales, the same products in the same order.

A tensor's blocks are a uint8 tensor (rows, bytes per row) in llama.cpp's block layout; each row
is `cols / block elements` blocks (on CUDA, Q6_K's padded to 224 bytes: `ALIGNED`). Below
them, the FP8 GEMMs on the tensor cores. On the CPU the layers' GGUF rows decode in the native
kernels (kernels/cpu_native.py), which equal these. Each quantization method is one class of
kernels/formats.py, which calls these.
Imports nothing from kestrel outside kestrel.kernels.
"""

import torch
import torch.nn.functional as F

from kestrel.kernels import fp8_activations

QK_K = 256  # elements per k-quant super-block
# type name -> (elements per block, bytes per block), as llama.cpp's ggml-common.h
BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}
# Q6_K's 210-byte blocks lie only 2-byte aligned in a row, so the GEMVs build its words from
# halfwords. On CUDA the loader pads each block with zeros to 224 bytes (14 x 16: every block
# 16-byte aligned), which the GEMVs read as whole int32 words, for 6.7% more bytes.
ALIGNED = {"Q6_K": "Q6_K_224"}  # file type -> its layout on CUDA
# layout name -> (elements per block, bytes per block): the file types and the padded ones
LAYOUTS = {**BLOCKS, "Q6_K_224": (QK_K, 224)}


def row_bytes(qtype: str, cols: int) -> int:
    """Bytes of one row of `cols` elements in layout `qtype`."""
    elements, size = LAYOUTS[qtype]
    return cols // elements * size


def align_blocks(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, str]:
    """(rows, row bytes) blocks of file type `qtype` -> (the blocks in its CUDA layout, the
    layout's name): Q6_K's blocks padded with zeros to 224 bytes, other types as they are."""
    layout = ALIGNED.get(qtype)
    if layout is None:
        return blocks, qtype
    size, padded = BLOCKS[qtype][1], LAYOUTS[layout][1]
    per_block = blocks.reshape(blocks.shape[0], -1, size)
    return F.pad(per_block, (0, padded - size)).reshape(blocks.shape[0], -1), layout


def aligned_bytes(qtype: str, nbytes: int) -> int:
    """The bytes that `nbytes` of a file's `qtype` blocks take in their CUDA layout."""
    size = BLOCKS[qtype][1]
    return nbytes // size * LAYOUTS[ALIGNED.get(qtype, qtype)][1]


def dequantize(blocks: torch.Tensor, qtype: str, cols: int) -> torch.Tensor:
    """(rows, row bytes) uint8 in layout `qtype` -> (rows, cols) float32."""
    per_block = blocks.reshape(-1, LAYOUTS[qtype][1])
    return _DEQUANTIZE[qtype](per_block).reshape(blocks.shape[0], cols)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) little-endian float16 bytes -> (n, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _shifts(step: int, device) -> torch.Tensor:
    # 0, step, ... < 8 made on the device (no host copy, so CUDA graphs can capture it)
    return torch.arange(0, 8, step, dtype=torch.uint8, device=device)


def _split(b: torch.Tensor, *sizes: int) -> list[torch.Tensor]:
    return list(b.split(list(sizes), dim=1))


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """(n, k) bytes -> (n, k / group, 2, group): each group's low nibbles, then its high ones."""
    q = qs.reshape(qs.shape[0], -1, 1, group) >> _shifts(4, device=qs.device).view(1, 1, 2, 1)
    return q & 0x0F


def _bits(qh: torch.Tensor, group: int, width: int) -> torch.Tensor:
    """(n, k) bytes -> (n, k / group, 8 / width, group): `width`-bit fields, lowest bits first."""
    shifts = _shifts(width, device=qh.device).view(1, 1, -1, 1)
    return (qh.reshape(qh.shape[0], -1, 1, group) >> shifts) & ((1 << width) - 1)


def _q4_0(b):
    d, qs = _split(b, 2, 16)
    q = _nibbles(qs, 16).reshape(b.shape[0], -1).to(torch.int8) - 8
    return _f16(d) * q.float()


def _q4_1(b):
    d, m, qs = _split(b, 2, 2, 16)
    q = _nibbles(qs, 16).reshape(b.shape[0], -1).float()
    return _f16(d) * q + _f16(m)


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """(n, 32) 5-bit values: the low nibbles of `qs`, the fifth bit from the 32 bits of `qh`."""
    high = _bits(qh, 4, 1).transpose(-1, -2).reshape(qh.shape[0], 32)  # bit i of the uint32
    return _nibbles(qs, 16).reshape(qs.shape[0], 32) | (high << 4)


def _q5_0(b):
    d, qh, qs = _split(b, 2, 4, 16)
    return _f16(d) * (_q5(qh, qs).to(torch.int8) - 16).float()


def _q5_1(b):
    d, m, qh, qs = _split(b, 2, 2, 4, 16)
    return _f16(d) * _q5(qh, qs).float() + _f16(m)


def _q8_0(b):
    d, x = _split(b, 2, 32)
    return x.contiguous().view(torch.int8).float() * _f16(d)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, each (n, 8)."""
    d, m, md = scales.reshape(-1, 3, 4).unbind(1)
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mins


def _k_affine(d, dmin, scales, q):
    """d * sc * q - dmin * m per 32-element sub-block; q: (n, 8, 32) float32."""
    sc, mins = _k_scales(scales)
    n = q.shape[0]
    scale = (_f16(d) * sc.float()).reshape(n, -1, 1)
    offset = (_f16(dmin) * mins.float()).reshape(n, -1, 1)
    return (scale * q - offset).reshape(n, QK_K)


def _q4_k(b):
    d, dmin, scales, qs = _split(b, 2, 2, 12, 128)
    return _k_affine(d, dmin, scales, _nibbles(qs, 32).reshape(b.shape[0], 8, 32).float())


def _q5_k(b):
    d, dmin, scales, qh, qs = _split(b, 2, 2, 12, 32, 128)
    low = _nibbles(qs, 32).reshape(b.shape[0], 8, 32)
    high = _bits(qh, 32, 1).reshape(b.shape[0], 8, 32)
    return _k_affine(d, dmin, scales, (low | (high << 4)).float())


def _q6_k(b):
    ql, qh, scales, d = _split(b, 128, 64, 16, 2)
    n = b.shape[0]
    low = _nibbles(ql, 64).reshape(n, 8, 32)
    high = _bits(qh, 32, 2).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    scale = (_f16(d) * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    return (scale * q).reshape(n, QK_K)


def _q6_k_224(b):
    return _q6_k(b[:, : BLOCKS["Q6_K"][1]])  # the padding dropped


_DEQUANTIZE = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "Q6_K_224": _q6_k_224,
}


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) bfloat16 @ w.T on the FP8 tensor cores: x quantized per row on the fly, w (N, K)
    float8_e4m3fn with one float32 scale per output row, w_scale (1, N)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    x_scale = amax / torch.finfo(torch.float8_e4m3fn).max  # (M, 1)
    xq = (x.float() / x_scale).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, w.t(), x_scale, w_scale, out_dtype=x.dtype)


FP8_TILE = 128  # the block-scaled FP8 GEMM's tile: activations 1 x 128, weights 128 x 128


def fp8_block_scales(w_scale: torch.Tensor) -> torch.Tensor:
    """(N / 128, K / 128) weight tile scales in the layout the block-scaled GEMM reads: K tiles
    padded to a multiple of 4 (cuBLAS's alignment), float32."""
    return F.pad(w_scale.float(), (0, -w_scale.shape[1] % 4)).contiguous()


def fp8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_activations.quantize in PyTorch (its oracle, and the path without Triton)."""
    m, k = x.shape
    xp = F.pad(x, (0, 0, 0, -m % 4)).float().reshape(-1, k // FP8_TILE, FP8_TILE)
    x_scale = (xp.abs().amax(dim=-1) * (1 / 448)).clamp(min=1e-12)  # 448: e4m3's largest
    xq = (xp / x_scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(-1, k)
    return xq, x_scale.t().contiguous().t()  # (M, K / 128), M-major


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) bfloat16 @ w.T with w (N, K) float8_e4m3fn in 128 x 128 tiles (DeepSeek-V3 /
    Qwen3-FP8 style; `w_scales` from `fp8_block_scales`): x quantized per 1 x 128 group on the
    fly, one block-scaled FP8 GEMM. cuBLAS wants the activation scales token-major with M a
    multiple of 4, so x is zero-padded."""
    m = x.shape[0]
    quantize = fp8_activations.quantize if fp8_activations.serves(x) else fp8_groups
    xq, x_scale = quantize(x)
    out = F.scaled_mm(
        xq,
        w.t(),
        x_scale,
        F.ScalingType.BlockWise1x128,
        w_scales.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )
    return out[:m]


_BLOCK_GEMM: dict[torch.device, bool] = {}


def fp8_block_gemm_works(device: torch.device) -> bool:
    """Whether this device's torch/cuBLAS runs the block-scaled FP8 GEMM (Hopper and later with a
    recent cuBLAS), tried once per device on a small problem checked against its dequantization."""
    if device.type != "cuda":
        return False
    if device not in _BLOCK_GEMM:
        _BLOCK_GEMM[device] = _try_block_gemm(device)
    return _BLOCK_GEMM[device]


def _try_block_gemm(device) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(256, 256, device=device, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2, device=device, generator=g) + 0.5
    x = torch.randn(3, 256, device=device, generator=g, dtype=torch.bfloat16)
    try:
        out = fp8_block_linear(x, w, fp8_block_scales(scale)).float()
    except (RuntimeError, NotImplementedError, AttributeError, ValueError):
        return False
    dense = w.float() * scale.repeat_interleave(FP8_TILE, 0).repeat_interleave(FP8_TILE, 1)
    expected = x.float() @ dense.t()
    return bool(((out - expected).norm() / expected.norm()) < 0.05)

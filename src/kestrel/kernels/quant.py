"""GGUF (llama.cpp) quantized blocks dequantized with PyTorch ops, bit for bit as gguf-py's
`gguf.quants.dequantize`: the same float16 scales, the same products in the same order.

A tensor's blocks are a uint8 tensor (rows, bytes per row) in llama.cpp's block layout; each row
is `cols / block elements` blocks. Imports nothing from kestrel.
"""

import torch

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


def row_bytes(qtype: str, cols: int) -> int:
    """Bytes of one row of `cols` elements."""
    elements, size = BLOCKS[qtype]
    return cols // elements * size


def dequantize(blocks: torch.Tensor, qtype: str, cols: int) -> torch.Tensor:
    """(rows, row bytes) uint8 -> (rows, cols) float32."""
    per_block = blocks.reshape(-1, BLOCKS[qtype][1])
    return _DEQUANTIZE[qtype](per_block).reshape(blocks.shape[0], cols)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) little-endian float16 bytes -> (n, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _shifts(*amounts: int, device) -> torch.Tensor:
    return torch.tensor(amounts, dtype=torch.uint8, device=device)


def _split(b: torch.Tensor, *sizes: int) -> list[torch.Tensor]:
    return list(b.split(list(sizes), dim=1))


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """(n, k) bytes -> (n, k / group, 2, group): each group's low nibbles, then its high ones."""
    q = qs.reshape(qs.shape[0], -1, 1, group) >> _shifts(0, 4, device=qs.device).view(1, 1, 2, 1)
    return q & 0x0F


def _bits(qh: torch.Tensor, group: int, width: int) -> torch.Tensor:
    """(n, k) bytes -> (n, k / group, 8 / width, group): `width`-bit fields, lowest bits first."""
    shifts = _shifts(*range(0, 8, width), device=qh.device).view(1, 1, -1, 1)
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


_DEQUANTIZE = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}

"""Rotary position embeddings: inverse frequencies with llama3/yarn/longrope scaling, the cos/sin
tables and their application (rotate-half and interleaved pairs)."""

import math

import torch
from torch import nn

from kestrel.models.batch import ForwardBatch


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict | None = None, freq_factors: list | None = None
) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) for RoPE, with HF's `rope_type` scalings, or divided by
    llama.cpp's per-frequency `freq_factors` (its `rope_freqs` tensor, which replaces them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq = _yarn_scaling(inv_freq, head_dim, theta, scaling)
    elif rope_type != "default":
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3, yarn"
        )
    return inv_freq.float()


def _llama3_scaling(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths divided by `factor`, short kept, a smooth ramp between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_scaling(inv_freq: torch.Tensor, dim: int, theta: float, s: dict) -> torch.Tensor:
    # YaRN: interpolate (divide by `factor`) the low frequencies, keep the high ones, ramp between
    factor, old_len = s["factor"], s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(
    scaling: dict | None, max_position_embeddings: int | None = None
) -> float:
    """The factor yarn and longrope multiply cos/sin by (1.0 for the other rope types)."""
    s = scaling or {}
    rope_type = s.get("rope_type", "default")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if s.get("attention_factor") is not None:
        return s["attention_factor"]
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position_embeddings / old_len
    if rope_type == "longrope":
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(factor, s["mscale"]) / yarn_mscale(factor, s["mscale_all_dim"])
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (HF layout) at absolute positions; `attention_scaling` scales cos/sin."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict | None = None,
        attention_scaling: float = 1.0,
        freq_factors: list | None = None,
    ):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling, freq_factors)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # (T, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)
        if self.attention_scaling != 1.0:
            return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return emb.cos(), emb.sin()


class LongRotaryEmbedding(nn.Module):
    """LongRoPE (Phi-3, MiniCPM3): per-frequency `short_factor`s, or `long_factor`s for a chunk
    whose last position reaches `original_max_position_embeddings` (transformers decides per
    forward call, i.e. per chunk of one sequence). Positions are absolute, never the live length."""

    def __init__(self, head_dim: int, theta: float, scaling: dict, attention_scaling: float = 1.0):
        super().__init__()
        base = rope_inv_freq(head_dim, theta)
        short = base / torch.tensor(scaling["short_factor"], dtype=torch.float32)
        long = base / torch.tensor(scaling["long_factor"], dtype=torch.float32)
        self.register_buffer("short_inv_freq", short, persistent=False)
        self.register_buffer("long_inv_freq", long, persistent=False)
        self.original_max = scaling["original_max_position_embeddings"]
        self.attention_scaling = attention_scaling

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        ends = batch.chunk_ends  # (T,) last position of each token's chunk
        long = (ends >= self.original_max)[:, None]
        inv_freq = torch.where(long, self.long_inv_freq, self.short_inv_freq)  # (T, D/2)
        freqs = batch.positions[:, None].float() * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D); cos/sin: (T, D). Rotates the first cos.shape[-1] dims (partial rotary)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos[:, None, :].to(x.dtype) + rotated * sin[:, None, :].to(x.dtype)
    return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D) whose RoPE pairs are interleaved, (x0, x1), (x2, x3) ... (DeepSeek's layout).

    Returns the rotated pairs de-interleaved (evens then odds), as transformers does; queries and
    keys get the same layout, so their dot products are those of the interleaved rotation."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half].to(x.dtype), sin[:, None, :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

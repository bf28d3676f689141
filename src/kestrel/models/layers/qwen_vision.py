"""Vision towers of the Qwen-VL families: image patches -> ViT (2-D RoPE, attention within each
frame) -> patch merger (each merge x merge window of patches becomes one token of the decoder's
width).

Follows transformers' Qwen2VisionTransformerPretrainedModel (Qwen2-VL) and Qwen3VLVisionModel
(Qwen3-VL: adds a learned position table resampled to each image's grid, and DeepStack features
merged from intermediate blocks). The image processor emits each merge window's patches next to
each other, so merging is a reshape; patch positions below follow that order.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels.fused import ACTIVATIONS
from kestrel.models.layers.linear import Linear
from kestrel.models.layers.rope import apply_rope

VISION_ACTIVATIONS = {**ACTIVATIONS, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


@dataclass
class VisionFeatures:
    """A prompt's images encoded, one row per image token in prompt order: embeds (N, hidden);
    deepstack: one (N, hidden) tensor per early decoder layer it is added after (Qwen3-VL)."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)


def patch_rows_cols(grid_thw: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every patch (P,), frames of each image in turn, in merge-window order."""
    rows, cols = [], []
    for t, h, w in grid_thw.tolist():
        r = torch.arange(h)[:, None].expand(h, w)
        c = torch.arange(w)[None, :].expand(h, w)
        rows.append(_window_order(r, merge).repeat(t))
        cols.append(_window_order(c, merge).repeat(t))
    return torch.cat(rows), torch.cat(cols)


def _window_order(x: torch.Tensor, merge: int) -> torch.Tensor:
    # (h, w) -> (h*w,): windows in raster order, the merge x merge patches of a window together
    h, w = x.shape
    return x.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()


def frame_lengths(grid_thw: torch.Tensor) -> list[int]:
    """Patches per frame: attention stays within one frame of one image."""
    return [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]


class PatchEmbed(nn.Module):
    """A Conv3d whose stride is its kernel, over flattened (C, t, p, p) patches: one matmul."""

    def __init__(self, channels: int, temporal: int, patch: int, dim: int, bias: bool):
        super().__init__()
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(channels, dim, kernel, stride=kernel, bias=bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight  # (dim, C, t, p, p)
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionRotary(nn.Module):
    """2-D RoPE: the first half of the frequencies turn with the patch row, the rest with the
    column. Returns cos, sin (P, head_dim)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        half = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq
        freqs = torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)  # (P, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    """Bidirectional attention within each frame, fused qkv, RoPE applied in fp32."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = Linear(dim, 3 * dim)
        self.proj = Linear(dim, dim)

    def forward(self, x, cos, sin, lengths: list[int]) -> torch.Tensor:
        P = x.shape[0]
        q, k, v = self.qkv(x).view(P, 3, self.num_heads, self.head_dim).unbind(1)  # (P, H, D)
        q = apply_rope(q.float(), cos, sin).to(v.dtype)
        k = apply_rope(k.float(), cos, sin).to(v.dtype)
        frames = zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
        out = [
            F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in qkv)).transpose(0, 1)
            for qkv in frames
        ]
        return self.proj(torch.cat(out).reshape(P, -1))


class Qwen2VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.fc2 = Linear(dim, hidden), Linear(hidden, dim)
        self.act = VISION_ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Qwen3VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = Linear(dim, hidden), Linear(hidden, dim)
        self.act = VISION_ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x, cos, sin, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class Qwen2PatchMerger(nn.Module):
    """LayerNorm each patch, concatenate a window's merge^2 patches, MLP to the decoder width."""

    def __init__(self, out_dim: int, dim: int, merge: int):
        super().__init__()
        self.hidden = dim * merge**2
        self.ln_q = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(
            Linear(self.hidden, self.hidden), nn.GELU(), Linear(self.hidden, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen3PatchMerger(nn.Module):
    """As Qwen2's, named differently; `postshuffle` norms the concatenated window (DeepStack)."""

    def __init__(self, out_dim: int, dim: int, merge: int, postshuffle: bool = False):
        super().__init__()
        self.hidden, self.postshuffle = dim * merge**2, postshuffle
        self.norm = nn.LayerNorm(self.hidden if postshuffle else dim, eps=1e-6)
        self.linear_fc1 = Linear(self.hidden, self.hidden)
        self.linear_fc2 = Linear(self.hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden)) if self.postshuffle else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.view(-1, self.hidden))))


class VisionTower(nn.Module):
    """The shared trunk: RoPE from patch rows/cols, blocks attending within frames."""

    def _run_blocks(self, x, grid_thw, taps=()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """x (P, dim) through every block; also returns x after each block in `taps` (in order)."""
        rows, cols = patch_rows_cols(grid_thw, self.merge)
        cos, sin = self.rotary_pos_emb(rows.to(x.device), cols.to(x.device))
        lengths, tapped = frame_lengths(grid_thw), []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if i in taps:
                tapped.append(x)
        return x, tapped


class Qwen2VisionTransformer(VisionTower):
    def __init__(self, vc):
        super().__init__()
        self.merge = vc.spatial_merge_size
        dim, heads = vc.embed_dim, vc.num_heads
        self.patch_embed = PatchEmbed(
            vc.in_channels, vc.temporal_patch_size, vc.patch_size, dim, bias=False
        )
        self.rotary_pos_emb = VisionRotary(dim // heads, _vision_theta(vc))
        mlp_dim = int(dim * vc.mlp_ratio)
        self.blocks = nn.ModuleList(
            VisionBlock(dim, heads, Qwen2VisionMLP(dim, mlp_dim, vc.hidden_act))
            for _ in range(vc.depth)
        )
        self.merger = Qwen2PatchMerger(vc.hidden_size, dim, self.merge)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionFeatures:
        """pixel_values (P, C*t*p*p) patches, grid_thw (n, 3) -> features (P / merge^2, hidden)."""
        x, _ = self._run_blocks(self.patch_embed(pixel_values), grid_thw)
        return VisionFeatures(self.merger(x))


class Qwen3VisionModel(VisionTower):
    def __init__(self, vc):
        super().__init__()
        self.merge = vc.spatial_merge_size
        dim, heads = vc.hidden_size, vc.num_heads
        self.patch_embed = PatchEmbed(
            vc.in_channels, vc.temporal_patch_size, vc.patch_size, dim, bias=True
        )
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, dim)
        self.side = int(vc.num_position_embeddings**0.5)
        self.rotary_pos_emb = VisionRotary(dim // heads, _vision_theta(vc))
        self.blocks = nn.ModuleList(
            VisionBlock(dim, heads, Qwen3VisionMLP(dim, vc.intermediate_size, vc.hidden_act))
            for _ in range(vc.depth)
        )
        out = vc.out_hidden_size
        self.merger = Qwen3PatchMerger(out, dim, self.merge)
        self.deepstack_visual_indexes = list(vc.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(out, dim, self.merge, postshuffle=True)
            for _ in self.deepstack_visual_indexes
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionFeatures:
        x = self.patch_embed(pixel_values) + self.resampled_pos_embed(grid_thw)
        taps = sorted(self.deepstack_visual_indexes)
        x, tapped = self._run_blocks(x, grid_thw, taps)
        mergers = [self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)] for i in taps]
        deepstack = [merger(h) for merger, h in zip(mergers, tapped, strict=True)]
        return VisionFeatures(self.merger(x), deepstack)

    def resampled_pos_embed(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """(P, dim): the (side, side) position table resized bilinearly (corners aligned) to each
        image's (h, w) patch grid, in merge-window order, repeated over frames."""
        table = self.pos_embed.weight
        square = table.view(self.side, self.side, -1).permute(2, 0, 1)[None].float()
        out = []
        for t, h, w in grid_thw.tolist():
            grid = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0]
            flat = grid.permute(1, 2, 0)  # (h, w, dim)
            windows = flat.reshape(h // self.merge, self.merge, w // self.merge, self.merge, -1)
            out.append(windows.transpose(1, 2).reshape(h * w, -1).repeat(t, 1))
        return torch.cat(out).to(table.dtype)


def _vision_theta(vc) -> float:
    return (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)

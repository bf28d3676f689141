"""Multimodal RoPE (M-RoPE) of the Qwen-VL families: three position ids per token (temporal,
height, width) instead of one.

Each rotary frequency reads one of the three ids: Qwen2-VL gives contiguous sections of the
frequencies to t, h and w (`mrope_section`), Qwen3-VL interleaves them (t h w t h w ... t t).
A text token has three equal ids, so text is plain RoPE at `position + rope_delta`; an image's
tokens take a grid of ids and move the count on by max(rows, cols), not by their number, which
is the delta the text after it carries (kept per sequence in `SequenceCache.rope_delta`).
Only RoPE reads these ids: caches and masks keep using `positions` (docs/architecture.md §1).
Follows transformers' Qwen2VLModel.get_rope_index and Qwen3VLTextRotaryEmbedding.
"""

import torch
from torch import nn

from kestrel.models.layers.rope import rope_inv_freq


def mrope_axes(half_dim: int, sections: list[int], interleaved: bool) -> torch.Tensor:
    """(half_dim,) long: which id (0 = t, 1 = h, 2 = w) each rotary frequency reads."""
    if interleaved:
        axes = torch.zeros(half_dim, dtype=torch.long)
        for axis in (1, 2):
            axes[axis : sections[axis] * 3 : 3] = axis
        return axes
    if sum(sections) != half_dim:
        raise ValueError(f"mrope_section {sections} does not cover {half_dim} rotary frequencies")
    return torch.tensor([axis for axis, n in enumerate(sections) for _ in range(n)])


class MRotaryEmbedding(nn.Module):
    """Rotate-half RoPE whose frequencies read the t/h/w ids of `mrope_axes`.

    forward takes (T,) positions (text only: plain RoPE) or (3, T) ids; returns cos, sin (T, D).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        sections: list[int],
        interleaved: bool = False,
        scaling: dict | None = None,
    ):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self.register_buffer(
            "axes", mrope_axes(head_dim // 2, sections, interleaved), persistent=False
        )

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if ids.dim() == 1:
            freqs = ids[:, None].float() * self.inv_freq  # (T, D/2)
        else:
            freqs = ids[self.axes].float().t() * self.inv_freq  # (D/2, T) -> (T, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def prompt_rope_ids(
    token_ids: torch.Tensor, image_token_id: int, grid_thw: torch.Tensor, merge: int
) -> torch.Tensor:
    """(3, L) M-RoPE ids of a whole prompt whose images are runs of `image_token_id`.

    Image i (grid_thw[i] = (t, h, w) patches) takes t*h*w/merge^2 tokens; they get the ids
    (start + frame, start + row, start + col) over the merged grid, and the next token starts
    at start + max(rows, cols). Text counts on by one.
    """
    is_image = (token_ids == image_token_id).tolist()
    pieces, cursor, next_id = [], 0, 0
    for t, h, w in grid_thw.tolist():
        start = is_image.index(True, cursor) if True in is_image[cursor:] else None
        rows, cols = h // merge, w // merge
        n = t * rows * cols
        if start is None or start + n > len(is_image) or not all(is_image[start : start + n]):
            raise ValueError(
                f"prompt has fewer image tokens than its images need ({n} for {t, h, w})"
            )
        pieces.append(_text_ids(next_id, start - cursor))
        next_id += start - cursor
        pieces.append(_grid_ids(next_id, t, rows, cols))
        next_id += max(rows, cols)
        cursor = start + n
    if True in is_image[cursor:]:
        raise ValueError("prompt has more image tokens than its images fill")
    pieces.append(_text_ids(next_id, len(is_image) - cursor))
    return torch.cat(pieces, dim=1)


def _text_ids(first: int, n: int) -> torch.Tensor:
    return torch.arange(first, first + n).expand(3, -1)


def _grid_ids(first: int, frames: int, rows: int, cols: int) -> torch.Tensor:
    # (3, frames * rows * cols) in the processor's raster order (frame, row, col)
    t, h, w = torch.meshgrid(
        torch.arange(frames), torch.arange(rows), torch.arange(cols), indexing="ij"
    )
    return torch.stack([t, h, w]).reshape(3, -1) + first

"""Attention visibility computed from positions, never from a tracked length."""

import torch


def visible_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Boolean (m, L) mask: True where query i may attend key j.

    visible(q, k) = pos_k <= pos_q and (window is None or pos_q - pos_k < window).
    Its key axis has exactly as many columns as the keys the cache returned.
    """
    q = query_positions[:, None]
    k = key_positions[None, :]
    visible = k <= q
    if window is not None:
        visible &= (q - k) < window
    return visible

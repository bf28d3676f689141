"""Keys and values of one attention layer of one sequence, each with its absolute position."""

import torch


class LayerKVCache:
    """Live keys/values of one layer, (H, L, D), and their positions, (L,), sorted ascending.

    Storage grows by concatenation, so a stored tensor is never written in place: holding the
    previous tensors is a free snapshot (`checkpoint`/`restore`), which lets the engine undo a
    failed step. With a sliding `window`, keys no query of the incoming chunk can see are evicted
    before it is appended; the mask, not the eviction, enforces the window within a chunk.
    """

    def __init__(self, window: int | None = None):
        self.window = window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[0])

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append (H, m, D) keys/values at `positions` (m,); return all live keys, values, positions."""
        if self.positions is None:
            self.keys, self.values, self.positions = keys, values, positions
        else:
            if self.window is not None:
                # the chunk's first query sees keys with pos > first - window; later queries see less
                self._keep(self.positions > positions[0] - self.window)
            self.keys = torch.cat([self.keys, keys], dim=1)
            self.values = torch.cat([self.values, values], dim=1)
            self.positions = torch.cat([self.positions, positions])
        return self.keys, self.values, self.positions

    def trim(self, live_start: int, keep: int) -> None:
        """Drop keys at positions [keep, live_start): the front trim, sinks [0, keep) stay."""
        if self.positions is not None:
            self._keep((self.positions < keep) | (self.positions >= live_start))

    def _keep(self, selected: torch.Tensor) -> None:
        if not bool(selected.all()):
            self.keys = self.keys[:, selected]
            self.values = self.values[:, selected]
            self.positions = self.positions[selected]

    def checkpoint(self) -> tuple:
        return (self.keys, self.values, self.positions)

    def restore(self, state: tuple) -> None:
        self.keys, self.values, self.positions = state

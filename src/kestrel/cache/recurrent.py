"""Per-sequence recurrent state of state-space (Mamba) layers, held in the sequence's SequenceCache.

Recurrent state has no positions: it summarises every token written so far, so `--max-kv-size`
never trims it (docs/architecture.md §1) and it has no `trim`. The model assigns new tensors on
every update and never writes a stored one in place, so `checkpoint()` is free.
"""

import torch

from kestrel.cache.sequence import CACHE_KINDS


class RecurrentState:
    """One Mamba layer of one sequence: `conv`, the last (K-1, C) inputs of the causal conv, and
    `ssm`, the state-space state ((H, P, N) for Mamba2, (D, N) for Mamba), kept in fp32.

    Both are None until the sequence's first token; a mixer then starts from zeros.
    """

    def __init__(self):
        self.conv: torch.Tensor | None = None
        self.ssm: torch.Tensor | None = None

    def checkpoint(self) -> tuple:
        return (self.conv, self.ssm)

    def restore(self, state: tuple) -> None:
        self.conv, self.ssm = state


class CacheStates:
    """The states of b sequences in their SequenceCaches, as the reference runner holds them (a
    group of `ForwardBatch.state_groups`); a new sequence's state is `zeros()`."""

    def __init__(self, caches: list):
        self.caches = caches

    def in_place(self, layer_idx: int, attr: str) -> None:
        return None  # states are tensors of their own: read, step and write

    def read(self, layer_idx: int, attr: str, zeros) -> torch.Tensor:
        saved = [getattr(cache.layers[layer_idx], attr) for cache in self.caches]
        return torch.stack([zeros() if s is None else s for s in saved])

    def write(self, layer_idx: int, attr: str, new: torch.Tensor) -> None:
        for cache, s in zip(self.caches, new, strict=True):
            # a new tensor, never written in place: checkpoints stay valid
            setattr(cache.layers[layer_idx], attr, s)


class NoState:
    """A layer that keeps nothing per sequence (an MLP or MoE block in a hybrid's layer pattern)."""

    def checkpoint(self) -> tuple:
        return ()

    def restore(self, state: tuple) -> None:
        pass


CACHE_KINDS["recurrent"] = lambda spec: RecurrentState()
CACHE_KINDS["none"] = lambda spec: NoState()

"""Attention metadata: the explicit argument that tells every layer which tokens belong to which
sequence and where each sequence's cache is. Built by the runner, read by the models."""

from dataclasses import dataclass

import torch

from kestrel.cache import SequenceCache


@dataclass
class SeqChunk:
    """Rows [start, start + length) of the packed batch are the next tokens of `cache`."""

    cache: SequenceCache
    start: int
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


@dataclass
class ForwardBatch:
    """Packed tokens of several sequences, each chunk contiguous and in position order.

    input_ids: (T,) token ids; positions: (T,) absolute positions (each sequence's `offset` onward);
    logits_rows: (R,) rows whose logits the model returns (last row of each chunk when sampling).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    chunks: list[SeqChunk]
    logits_rows: torch.Tensor

    @classmethod
    def single(cls, cache: SequenceCache, input_ids: torch.Tensor, all_logits: bool = True):
        """One sequence's next `len(input_ids)` tokens, starting at its `offset`."""
        m = int(input_ids.shape[0])
        positions = torch.arange(cache.offset, cache.offset + m, device=input_ids.device)
        rows = torch.arange(m if all_logits else 1, device=input_ids.device)
        if not all_logits:
            rows += m - 1
        return cls(input_ids, positions, [SeqChunk(cache, 0, m)], rows)

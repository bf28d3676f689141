"""Attention metadata: the explicit argument that tells every layer which tokens belong to which
sequence and where each sequence's cache is. Built by the runner, read by the models.

Every runner's batch has the same per-row fields (RoPE ids, chunk ends, image rows, recurrent-state
groups), so a model reads one batch type: the paged runner packs them itself, and a batch of
`SeqChunk`s over dense caches (the reference runner, tests) derives them from its chunks here."""

from dataclasses import dataclass, field

import torch

from kestrel.cache.paged import PagedAttention
from kestrel.cache.recurrent import CacheStates
from kestrel.cache.sequence import SequenceCache


@dataclass
class ImageRows:
    """Vision features that replace the embeddings of some tokens (image tokens).

    rows: (N,) indices within the chunk (0 is its first token) on `SeqChunk.images`, within the
    packed batch on `ForwardBatch.images`; embeds: (N, hidden) merged vision
    features for those rows; deepstack: per early decoder layer i, (N, hidden) features added to
    those rows after layer i (Qwen3-VL's DeepStack; empty for models without it).
    """

    rows: torch.Tensor
    embeds: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)

    @staticmethod
    def packed(parts: list[tuple[int, "ImageRows"]], device) -> "ImageRows | None":
        """Chunks' image rows, (chunk start, rows within the chunk), as rows of the packed batch;
        None when no chunk has an image token."""
        parts = [(start, im) for start, im in parts if im is not None and im.rows.numel()]
        if not parts:
            return None
        rows = torch.cat([start + im.rows.to(device) for start, im in parts])
        embeds = torch.cat([im.embeds for _, im in parts])
        depth = len(parts[0][1].deepstack)
        deepstack = [torch.cat([im.deepstack[i] for _, im in parts]) for i in range(depth)]
        return ImageRows(rows, embeds, deepstack)


@dataclass
class SeqChunk:
    """Rows [start, start + length) of the packed batch are the next tokens of `cache`.

    Chunks of multimodal prompts (models/qwen_vl_processor.py) add `rope_positions`, (3, length) M-RoPE
    ids (temporal, height, width) of these tokens, and `images`, the vision features of the image
    tokens among them. Without them a chunk is text: its RoPE id is its position plus the
    sequence's `cache.rope_delta`. `positions` (caches, masks) never change meaning.
    """

    cache: SequenceCache
    start: int
    length: int
    rope_positions: torch.Tensor | None = None
    images: ImageRows | None = None

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


@dataclass
class ForwardBatch:
    """Packed tokens of several sequences, each chunk contiguous and in position order.

    input_ids: (T,) token ids; positions: (T,) absolute positions (each sequence's `offset` onward);
    logits_rows: (R,) rows whose logits the model returns (last row of each chunk when sampling).
    Per row, for the whole batch: rope_positions, (T,) or (3, T) RoPE ids (text rows at
    `position + rope_delta`, a multimodal prompt's rows at its M-RoPE ids), images, the image
    rows, chunk_ends, (T,) the last position of each row's chunk (LongRoPE picks factors per
    chunk), and state_groups, the recurrent layers' groups of sequences (layers/mamba.py).
    Runners that pack without SeqChunks (paged attention, CUDA graphs) give them; a batch of
    SeqChunks derives those it is not given.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    chunks: list[SeqChunk]
    logits_rows: torch.Tensor
    rope_positions: torch.Tensor | None = None
    images: ImageRows | None = None
    chunk_ends: torch.Tensor | None = None
    state_groups: list | None = None
    # the paged runner's attention over its pool (cache/paged.py's PagedAttention); None: each
    # chunk's dense cache (layers/attention.py)
    attention: PagedAttention | None = None
    # multi-token prediction (models/layers/mtp.py): every row's final hidden state is kept in
    # `hidden` (keep_hidden); an MTP draft's rows take their hidden state from `prev_hidden`
    keep_hidden: bool = False
    hidden: torch.Tensor | None = None
    prev_hidden: torch.Tensor | None = None

    def __post_init__(self):
        if not self.chunks:  # packed by the runner: every per-row field given
            return
        if self.rope_positions is None:
            self.rope_positions = chunk_rope_ids(self.positions, self.chunks)
        if self.chunk_ends is None:
            self.chunk_ends = torch.zeros_like(self.positions)
            for chunk in self.chunks:
                self.chunk_ends[chunk.rows] = self.positions[chunk.start + chunk.length - 1]
        if self.images is None:
            parts = [(c.start, c.images) for c in self.chunks]
            self.images = ImageRows.packed(parts, self.input_ids.device)
        if self.state_groups is None:
            self.state_groups = chunk_state_groups(self.chunks, self.input_ids.device)

    @classmethod
    def single(
        cls,
        cache: SequenceCache,
        input_ids: torch.Tensor,
        all_logits: bool = True,
        rope_positions: torch.Tensor | None = None,
        images: ImageRows | None = None,
    ):
        """One sequence's next `len(input_ids)` tokens, starting at its `offset`."""
        m = int(input_ids.shape[0])
        positions = torch.arange(cache.offset, cache.offset + m, device=input_ids.device)
        rows = torch.arange(m if all_logits else 1, device=input_ids.device)
        if not all_logits:
            rows += m - 1
        return cls(input_ids, positions, [SeqChunk(cache, 0, m, rope_positions, images)], rows)


def chunk_rope_ids(positions: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
    """RoPE ids of every row: (T,) when all rows are text, else (3, T). Text rows are at
    `position + cache.rope_delta`; chunks of a multimodal prompt bring their own (3, length)."""
    shifted = positions
    if any(chunk.cache.rope_delta for chunk in chunks):
        shifted = positions.clone()
        for chunk in chunks:
            shifted[chunk.rows] += chunk.cache.rope_delta
    explicit = [chunk for chunk in chunks if chunk.rope_positions is not None]
    if not explicit:
        return shifted
    ids = shifted.expand(3, -1).clone()  # (3, T)
    for chunk in explicit:
        ids[:, chunk.rows] = chunk.rope_positions
    return ids


def chunk_state_groups(chunks: list[SeqChunk], device) -> list:
    """The recurrent layers' groups over dense caches: each chunk longer than one token alone
    (b=1), then every single-token chunk together."""
    groups = [
        (torch.arange(c.start, c.start + c.length, device=device)[None], CacheStates([c.cache]))
        for c in chunks
        if c.length > 1
    ]
    singles = [c for c in chunks if c.length == 1]
    if singles:
        rows = torch.tensor([c.start for c in singles], device=device)[:, None]
        groups.append((rows, CacheStates([c.cache for c in singles])))
    return groups

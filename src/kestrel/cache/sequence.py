"""The cache a sequence owns: one entry per layer, plus the monotonic `offset`."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from kestrel.cache.blocks import live_tokens, tokens_to_trim, trimmed_live_start
from kestrel.cache.kv import LayerKVCache


@dataclass(frozen=True)
class CacheSpec:
    """What a layer keeps per sequence: `kind` "full", "sliding" (with `window`), or a kind a
    model family registers in `CACHE_KINDS` (e.g. recurrent state, a latent KV)."""

    kind: str = "full"
    window: int | None = None


class KVShape(NamedTuple):
    """What one layer stores per token: `heads` keys of `dim` each and as many values. With
    `value_dim` set (the MLA latent) the values are the first `value_dim` dims of each key, so only
    keys are stored."""

    heads: int
    dim: int
    value_dim: int | None = None

    @property
    def values(self) -> int:
        """Width of each value: `value_dim`, or `dim` when values are stored apart."""
        return self.value_dim or self.dim

    @property
    def elements(self) -> int:
        """Numbers stored per token."""
        return self.heads * self.dim * (1 if self.value_dim else 2)


class StateShape(NamedTuple):
    """What one recurrent layer keeps per sequence: `conv`, the causal conv's window (K-1, C), in
    the model's dtype, and `ssm`, the state-space state ((H, P, N) for Mamba2, (D, N) for Mamba),
    in float32."""

    conv: tuple[int, ...]
    ssm: tuple[int, ...]


def kv_bytes(layout: list[KVShape | None], itemsize: int) -> int:
    """Bytes one token costs across the layers of a `kv_layout` (None: the layer stores none)."""
    return sum(shape.elements for shape in layout if shape) * itemsize


CACHE_KINDS: dict[str, Callable[[CacheSpec], object]] = {
    "full": lambda spec: LayerKVCache(None),
    "sliding": lambda spec: LayerKVCache(spec.window),
}


class SequenceCache:
    """Per-sequence state across layers.

    `offset` counts every token ever written (RoPE positions use it; it only grows). The live
    window is positions [live_start, offset) plus the sinks [0, min(keep, live_start)).
    `rope_delta`: multimodal RoPE (models/layers/mrope.py) puts text tokens at RoPE id `position +
    rope_delta`: 0 for text-only sequences, set from `MultimodalPrompt.rope_delta` for a prompt
    with images (whose own tokens bring explicit ids).
    """

    def __init__(self, specs: list[CacheSpec]):
        self.specs = specs
        self.layers = [CACHE_KINDS[spec.kind](spec) for spec in specs]
        self.offset = 0
        self.live_start = 0
        self.keep = 0
        self.rope_delta = 0

    @property
    def live_tokens(self) -> int:
        """Tokens the full-attention layers hold (what `--max-kv-size` bounds)."""
        return live_tokens(self.offset, self.live_start, self.keep)

    def trim_front(self, n: int, keep: int = 0) -> None:
        """Drop the `n` oldest tokens after the first `keep` (sinks), in every layer."""
        if n <= 0:
            return
        self.keep = keep
        self.live_start = trimmed_live_start(self.offset, self.live_start, keep, n)
        for layer in self.layers:
            if hasattr(layer, "trim"):
                layer.trim(self.live_start, self.keep)

    def make_room(self, m: int, max_kv_size: int | None, keep: int = 0) -> int:
        """Before appending `m` tokens, trim so that live + m <= max_kv_size; returns tokens trimmed."""
        excess = tokens_to_trim(self.live_tokens, m, max_kv_size, keep)
        self.trim_front(excess, keep)
        return excess

    def advance(self, m: int) -> None:
        self.offset += m

    def checkpoint(self) -> tuple:
        layers = [layer.checkpoint() for layer in self.layers]
        return (self.offset, self.live_start, self.keep, self.rope_delta, layers)

    def restore(self, state: tuple) -> None:
        self.offset, self.live_start, self.keep, self.rope_delta, layers = state
        for layer, saved in zip(self.layers, layers, strict=True):
            layer.restore(saved)

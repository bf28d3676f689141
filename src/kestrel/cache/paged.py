"""Paged KV cache and recurrent state for the paged runner: one preallocated pool of fixed-size
blocks per layer, each sequence's keys placed by its block table (cache/blocks.py, which the
scheduler plans).

Storage follows positions (a sequence's logical block `b` holds positions [b * block_size,
(b + 1) * block_size)), so a key's position is known from where it sits and the mask rule of
docs/architecture.md §1 (window, sinks, live start) is applied to those positions inside the
attention kernel.
"""

import math
import mmap
from dataclasses import dataclass, field

import torch

from kestrel.cache.blocks import BlockTable
from kestrel.cache.mask import visible_mask
from kestrel.cache.sequence import CacheSpec, KVShape, SequenceCache, StateShape, kv_bytes
from kestrel.kernels import cpu_native
from kestrel.kernels import mamba as mamba_kernels
from kestrel.kernels.attention import (
    KVStore,
    attend,
    dequantize,
    paged_attention_triton,
    triton,
    write_kv,
)

# --kv-cache-dtype: "auto" stores the model's dtype
KV_CACHE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for --kv-cache-dtype `name`."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r}; supported: auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


class BlockPool:
    """K and V of every layer that stores them: (num_blocks, block_size, Hkv, D) each, with the
    layer's own `KVShape` (`layout`: the model's `kv_layout()`); None for a layer that stores
    none, and V None for a latent layer (its values are inside its keys). Block 0 is a scratch
    block never handed out (CUDA-graph padding rows write there).

    An FP8 pool also holds a float32 scale per layer and KV head for K and for V, computed from
    the first chunk the pool stores (`calibrated` turns True once the runner has sent one) and
    fixed from then on: every block is read with the scales it was written with."""

    def __init__(self, layout: list[KVShape | None], num_blocks, block_size, dtype, device):
        def zeros(shape: KVShape | None, values: bool):
            if shape is None or (values and shape.value_dim):
                return None
            return _zeros((num_blocks, block_size, shape.heads, shape.dim), dtype, device)

        def scales(shape: KVShape | None, values: bool):
            if dtype != torch.float8_e4m3fn or shape is None or (values and shape.value_dim):
                return None
            return torch.ones(shape.heads, dtype=torch.float32, device=device)

        self.layout, self.dtype = layout, dtype
        self.k = [zeros(shape, False) for shape in layout]
        self.v = [zeros(shape, True) for shape in layout]
        self.k_scale = [scales(shape, False) for shape in layout]
        self.v_scale = [scales(shape, True) for shape in layout]
        self.calibrated = dtype != torch.float8_e4m3fn
        self.num_blocks, self.block_size = num_blocks, block_size

    def store(self, layer: int) -> KVStore:
        """Layer `layer`'s keys, values and (FP8) scales."""
        return KVStore(self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer])

    @staticmethod
    def bytes_per_block(layout: list[KVShape | None], block_size: int, dtype) -> int:
        return kv_bytes(layout, torch.finfo(dtype).bits // 8) * block_size


class StatePool:
    """The recurrent state of every running sequence, one slot each: per recurrent layer `conv`
    (slots, K-1, C) in the model's dtype and `ssm` (slots, ...) in `ssm_dtype` (float32 unless
    asked; the scans compute in float32 either way). `layout`: the model's `state_layout()`, None
    for a layer without state. Slot 0 is scratch (CUDA-graph padding)."""

    def __init__(
        self, layout: list[StateShape | None], slots: int, dtype, device, ssm_dtype=torch.float32
    ):
        def zeros(dims, dtype):
            return None if dims is None else _zeros((slots, *dims), dtype, device)

        self.conv = [zeros(shape and shape.conv, dtype) for shape in layout]
        self.ssm = [zeros(shape and shape.ssm, ssm_dtype) for shape in layout]
        self.slots = slots

    @staticmethod
    def bytes_per_slot(layout: list[StateShape | None], dtype, ssm_dtype=torch.float32) -> int:
        size = lambda dt: torch.finfo(dt).bits // 8  # noqa: E731
        shapes = [shape for shape in layout if shape]
        return sum(
            math.prod(s.conv) * size(dtype) + math.prod(s.ssm) * size(ssm_dtype) for s in shapes
        )

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self.conv + self.ssm if t is not None]

    def start(self, slot: int, snapshot: int = 0) -> None:
        """A sequence starts in `slot`: from a snapshot (a prefix hit), else from zeros."""
        for t in self.tensors():
            if snapshot:
                t[slot].copy_(t[snapshot])
            else:
                t[slot].zero_()

    def copy(self, slot: int, snapshot: int) -> None:
        for t in self.tensors():
            t[snapshot].copy_(t[slot])


class PoolStates:
    """The states of a group of sequences in a `StatePool`, by their slots ((b,) on the device),
    read and written with index ops so that CUDA graphs replay them for any slots."""

    def __init__(self, pool: StatePool, slots: torch.Tensor):
        self.pool, self.slots = pool, slots

    def in_place(self, layer_idx: int, attr: str) -> torch.Tensor | None:
        """The store that kernels/mamba.py updates in place (None: read, step and write)."""
        store = getattr(self.pool, attr)[layer_idx]
        return store if mamba_kernels.available(store) else None

    def read(self, layer_idx: int, attr: str, zeros) -> torch.Tensor:
        store = getattr(self.pool, attr)[layer_idx]
        states = store.index_select(0, self.slots)
        return states.float() if attr == "ssm" else states  # SSM scans run in float32

    def write(self, layer_idx: int, attr: str, new: torch.Tensor) -> None:
        store = getattr(self.pool, attr)[layer_idx]
        store.index_copy_(0, self.slots, new.to(store.dtype))


def _zeros(dims: tuple[int, ...], dtype, device) -> torch.Tensor:
    """A zeroed tensor; on the CPU in anonymous memory, whose pages the OS maps (zeroed) as they
    are first written, so a pool sized for every context costs only what sequences fill."""
    if torch.device(device).type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    itemsize = torch.finfo(dtype).bits // 8
    memory = mmap.mmap(-1, max(1, math.prod(dims) * itemsize))
    return torch.frombuffer(memory, dtype=dtype).view(dims)


class PagedSequenceCache(SequenceCache):
    """A SequenceCache whose keys live in a `BlockPool`, where its `BlockTable` puts them. The
    table is the scheduler's (it trims and reserves before each step); the cache only reads it,
    and holds what the device advanced: `offset` and `rope_delta`."""

    def __init__(self, specs: list[CacheSpec], blocks: BlockTable):
        self.specs, self.blocks = specs, blocks
        self.layers = []  # no per-layer objects: the pool holds every layer
        self.offset = 0
        self.rope_delta = 0

    # the live window and recurrent-state slot are the table's (the scheduler's block manager's)
    live_start = property(lambda self: self.blocks.live_start)
    state_slot = property(lambda self: self.blocks.state_slot)
    keep = property(lambda self: self.blocks.keep)

    def table(self) -> tuple[list[int], int, int]:
        return self.blocks.table()

    def slots(self, start: int, n: int) -> list[int]:
        return self.blocks.slots(start, n)

    def checkpoint(self) -> tuple:
        return (self.offset, self.rope_delta)

    def restore(self, state: tuple) -> None:
        self.offset, self.rope_delta = state


@dataclass(kw_only=True)
class PagedAttention:
    """Attention metadata of one packed batch over a `BlockPool` (the explicit argument that
    `cached_attention` dispatches to). All tensors are on the pool's device.

    slot_mapping: (T,) flat slot (block * block_size + position % block_size) of each new token.
    Per query tile (a run of at most `tile_tokens` tokens of one sequence): tile_seq, tile_start
    (first row in T), tile_len. Per sequence: block_tables (S, W) physical blocks, num_blocks,
    n_sink, main_start, live_start, keep (the mask rule's inputs).
    """

    pool: BlockPool
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    tile_seq: torch.Tensor
    tile_start: torch.Tensor
    tile_len: torch.Tensor
    block_tables: torch.Tensor
    num_blocks: torch.Tensor
    n_sink: torch.Tensor
    main_start: torch.Tensor
    live_start: torch.Tensor
    keep: torch.Tensor
    tile_tokens: int
    use_triton: bool = True
    calibrate: bool = False  # an FP8 pool's first chunk: its writes set the scales first
    _torch_tiles: dict = field(default_factory=dict, repr=False)  # window -> torch_tiles

    def torch_tiles(self, window: int | None) -> list[tuple]:
        """The PyTorch attention's tiles, built once per batch and window (not per layer)."""
        if window not in self._torch_tiles:
            self._torch_tiles[window] = torch_tiles(self, window)
        return self._torch_tiles[window]

    def __call__(self, q, k, v, layer_idx, scale, window=None, cache_layer_idx=None):
        """q: (T, Hq, D), k/v: (T, Hkv, D) -> (T, Hq, D); writes k/v unless reading another layer."""
        store = self.pool.store(layer_idx if cache_layer_idx is None else cache_layer_idx)
        if cache_layer_idx is None:
            write_kv(store, k, v, self.slot_mapping, self.calibrate)
        return paged_attention(q, store, self, scale, window, self.use_triton)

    def latent(self, q, kv, layer_idx, scale):
        """MLA in latent space. q: (T, H, r + dr) absorbed queries, kv: (T, 1, r + dr) each token's
        [latent, rope key] -> (T, H, r): every head attends the shared keys, values the latents."""
        store = self.pool.store(layer_idx)
        write_kv(store, kv, None, self.slot_mapping, self.calibrate)
        rank = self.pool.layout[layer_idx].value_dim
        return paged_attention(q, store, self, scale, None, self.use_triton, rank)


# -- attention over the pool -------------------------------------------------------------------


def paged_attention(q, store: KVStore, meta, scale, window=None, use_triton=True, value_dim=None):
    """q: (T, Hq, D) -> (T, Hq, Dv) attending the pool's keys of each query's sequence; the
    store's `v` None: the values are the keys' first `value_dim` dims. The CPU's native kernel
    reads plain stores; an FP8 store there goes through the PyTorch path."""
    if use_triton and triton is not None and q.is_cuda:
        return paged_attention_triton(q, store, meta, scale, window, value_dim)
    if q.device.type == "cpu" and cpu_native.available() and store.k_scale is None:
        return cpu_native.paged_attention(q, store, meta, scale, window, value_dim)
    return paged_attention_torch(q, store, meta, scale, window, value_dim)


def key_positions(block_size, n_blocks, n_sink, main_start, device) -> torch.Tensor:
    """(n_blocks * block_size,) positions of the slots of a sequence's held blocks."""
    j = torch.arange(n_blocks, device=device)
    logical = torch.where(j < n_sink, j, main_start + j - n_sink)
    return (logical[:, None] * block_size + torch.arange(block_size, device=device)).flatten()


def paged_attention_torch(q, store: KVStore, meta, scale, window=None, value_dim=None):
    """The reference: gather each tile's keys, build the mask from positions, run `attend`."""
    bs, hkv, d = store.k.shape[1:]
    dv = value_dim or store.v.shape[-1]
    out = q.new_zeros(*q.shape[:2], dv)
    for start, n, blocks, mask in meta.torch_tiles(window):
        nb = len(blocks)
        keys = dequantize(store.k[blocks].reshape(nb * bs, hkv, d), store.k_scale, q.dtype)
        keys = keys.transpose(0, 1)  # (Hkv, L, D)
        if store.v is None:
            values = keys[..., :dv]
        else:
            values = store.v[blocks].reshape(nb * bs, hkv, dv)
            values = dequantize(values, store.v_scale, q.dtype).transpose(0, 1)
        rows = q[start : start + n].transpose(0, 1)  # (Hq, n, D)
        out[start : start + n] = attend(rows, keys, values, mask, scale).transpose(0, 1)
    return out


def torch_tiles(meta: "PagedAttention", window: int | None) -> list[tuple]:
    """Per non-empty query tile: (first row, rows, its sequence's blocks, (rows, keys) mask)."""
    host = lambda t: t.tolist()  # noqa: E731
    seqs, starts, lens = host(meta.tile_seq), host(meta.tile_start), host(meta.tile_len)
    tiles = []
    for s, start, n in zip(seqs, starts, lens, strict=True):
        if n == 0:
            continue
        nb = int(meta.num_blocks[s])
        blocks = meta.block_tables[s, :nb].long()
        bs = meta.pool.block_size
        k_pos = key_positions(bs, nb, int(meta.n_sink[s]), int(meta.main_start[s]), blocks.device)
        q_pos = meta.positions[start : start + n]
        live = (k_pos < meta.keep[s]) | (k_pos >= meta.live_start[s])
        tiles.append((start, n, blocks, visible_mask(q_pos, k_pos, window) & live[None, :]))
    return tiles

"""Paged KV cache for the GPU runner: one preallocated pool of fixed-size blocks per layer, and a
block table per sequence.

A sequence's logical block `b` holds positions [b * block_size, (b + 1) * block_size): storage
follows positions, so a key's position is known from where it sits and the mask rule of DESIGN.md
section 1 (window, sinks, live start) is applied to those positions inside the attention kernel.
Trimming (`--max-kv-size`) and sliding-window eviction free every block that holds no live key;
partial blocks stay and the mask hides their dead keys. The held blocks are always the sinks'
blocks [0, n_sink) followed by one contiguous run [main_start, ...).

The pool is written in place, so `checkpoint()` records the table (not the tensors): a restore
drops blocks allocated since and takes back blocks trimmed since. Freed blocks are only reused
after `BlockPool.commit()` (the runner calls it once a step succeeded), so a restore never finds
a trimmed block overwritten.
"""

from dataclasses import dataclass

import torch

from kestrel.cache.mask import visible_mask
from kestrel.cache.sequence import CacheSpec, SequenceCache
from kestrel.kernels.attention import attend, paged_attention_triton, triton, write_kv


class KVPoolExhaustedError(RuntimeError):
    """No free block is left in the KV pool."""


class BlockPool:
    """K and V of every layer: (num_blocks, block_size, Hkv, D) each. Block 0 is a scratch block
    never handed out (CUDA-graph padding rows write there)."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self.pending: set[int] = set()  # freed this step; reusable after commit()

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def allocate(self) -> int:
        if not self.free:
            raise KVPoolExhaustedError(
                f"KV pool exhausted ({self.num_blocks} blocks of {self.block_size} tokens); "
                "lower --max-num-seqs or raise --gpu-memory-utilization"
            )
        return self.free.pop()

    def release(self, blocks, deferred: bool = True) -> None:
        if deferred:
            self.pending.update(blocks)
        else:
            self.free.extend(blocks)

    def commit(self) -> None:
        self.free.extend(self.pending)
        self.pending.clear()

    @property
    def num_free(self) -> int:
        return len(self.free)


class PagedSequenceCache(SequenceCache):
    """SequenceCache whose keys live in a `BlockPool`; `held` maps logical -> physical blocks."""

    def __init__(self, specs: list[CacheSpec], pool: BlockPool):
        super().__init__([])  # no per-layer objects: the pool holds every layer
        self.specs = specs
        self.pool = pool
        # (logical block, physical block), ascending; a tuple, replaced (never changed in place)
        # when blocks come or go, so checkpoints share it and `table` is computed once per tuple
        self.held: tuple[tuple[int, int], ...] = ()
        self._table: tuple[tuple, tuple[list[int], int, int]] | None = None  # (held, its table)
        windows = [s.window if s.kind == "sliding" else None for s in specs]
        # blocks behind the largest window are dead only if every layer slides
        self.evict_window = None if None in windows or not windows else max(windows)

    def trim_front(self, n: int, keep: int = 0) -> None:
        if n <= 0:
            return
        self.keep = keep
        self.live_start = min(max(self.live_start, keep) + n, self.offset)
        self._free_dead(self.offset)

    def reserve(self, m: int) -> None:
        """Make room for positions [offset, offset + m): evict dead blocks, allocate new ones."""
        if self.evict_window is not None:
            self._free_dead(self.offset)
        bs = self.pool.block_size
        have = self.held[-1][0] + 1 if self.held else 0
        new = range(have, (self.offset + m + bs - 1) // bs)
        if new:
            self.held += tuple((logical, self.pool.allocate()) for logical in new)

    def _free_dead(self, next_position: int) -> None:
        bs, sinks = self.pool.block_size, min(self.keep, self.live_start)
        first_live = self.live_start
        if self.evict_window is not None:  # the next query sees keys > next_position - window
            first_live = max(first_live, next_position - self.evict_window + 1)
        alive = lambda b: b * bs < sinks or (b + 1) * bs > first_live  # noqa: E731
        dead = [phys for logical, phys in self.held if not alive(logical)]
        if dead:
            self.held = tuple((lg, ph) for lg, ph in self.held if alive(lg))
            self.pool.release(dead)

    def table(self) -> tuple[list[int], int, int]:
        """(physical blocks in order, n_sink, main_start): entry j holds logical block j for
        j < n_sink, else main_start + j - n_sink."""
        if self._table is None or self._table[0] is not self.held:
            self._table = (self.held, self._make_table())
        return self._table[1]

    def slots(self, start: int, n: int) -> list[int]:
        """The pool slots of positions [start, start + n), which this cache holds (reserved)."""
        bs = self.pool.block_size
        if n == 1 and self.held and self.held[-1][0] == start // bs:  # decode: the newest block
            return [self.held[-1][1] * bs + start % bs]
        block_of = dict(self.held)
        return [block_of[q // bs] * bs + q % bs for q in range(start, start + n)]

    def _make_table(self) -> tuple[list[int], int, int]:
        blocks = [phys for _, phys in self.held]
        n_sink = 0
        while n_sink < len(self.held) and self.held[n_sink][0] == n_sink:
            n_sink += 1
        if n_sink == len(self.held):  # no gap: one contiguous run from block 0
            return blocks, 0, 0
        return blocks, n_sink, self.held[n_sink][0]

    def free(self) -> None:
        self.pool.release([phys for _, phys in self.held], deferred=False)
        self.held = ()

    @property
    def live_tokens(self) -> int:
        return min(self.keep, self.live_start) + self.offset - self.live_start

    def checkpoint(self) -> tuple:
        return (self.offset, self.live_start, self.keep, self.rope_delta, self.held)

    def restore(self, state: tuple) -> None:
        self.offset, self.live_start, self.keep, self.rope_delta, held = state
        before = {phys for _, phys in held}
        now = {phys for _, phys in self.held}
        self.pool.release(now - before, deferred=False)  # allocated since: never visible
        self.pool.pending -= before - now  # trimmed since: take back
        self.held = held


@dataclass
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

    def __call__(self, q, k, v, layer_idx, scale, window=None, cache_layer_idx=None):
        """q: (T, Hq, D), k/v: (T, Hkv, D) -> (T, Hq, D); writes k/v unless reading another layer."""
        layer = layer_idx if cache_layer_idx is None else cache_layer_idx
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        if cache_layer_idx is None:
            write_kv(k_cache, v_cache, k, v, self.slot_mapping)
        return paged_attention(q, k_cache, v_cache, self, scale, window, self.use_triton)


# -- attention over the pool -------------------------------------------------------------------


def paged_attention(q, k_cache, v_cache, meta, scale, window=None, use_triton=True):
    """q: (T, Hq, D) -> (T, Hq, D) attending the pool's keys of each query's sequence."""
    if use_triton and triton is not None and q.is_cuda:
        return paged_attention_triton(q, k_cache, v_cache, meta, scale, window)
    return paged_attention_torch(q, k_cache, v_cache, meta, scale, window)


def key_positions(block_size, n_blocks, n_sink, main_start, device) -> torch.Tensor:
    """(n_blocks * block_size,) positions of the slots of a sequence's held blocks."""
    j = torch.arange(n_blocks, device=device)
    logical = torch.where(j < n_sink, j, main_start + j - n_sink)
    return (logical[:, None] * block_size + torch.arange(block_size, device=device)).flatten()


def paged_attention_torch(q, k_cache, v_cache, meta, scale, window=None) -> torch.Tensor:
    """The reference: gather each tile's keys, build the mask from positions, run `attend`."""
    out = torch.zeros_like(q)
    bs, hkv, d = k_cache.shape[1:]
    host = lambda t: t.tolist()  # noqa: E731
    seqs, starts, lens = host(meta.tile_seq), host(meta.tile_start), host(meta.tile_len)
    for s, start, n in zip(seqs, starts, lens, strict=True):
        if n == 0:
            continue
        nb = int(meta.num_blocks[s])
        blocks = meta.block_tables[s, :nb].long()
        keys = k_cache[blocks].reshape(nb * bs, hkv, d).transpose(0, 1)  # (Hkv, L, D)
        values = v_cache[blocks].reshape(nb * bs, hkv, d).transpose(0, 1)
        k_pos = key_positions(bs, nb, int(meta.n_sink[s]), int(meta.main_start[s]), q.device)
        q_pos = meta.positions[start : start + n]
        live = (k_pos < meta.keep[s]) | (k_pos >= meta.live_start[s])
        mask = visible_mask(q_pos, k_pos, window) & live[None, :]
        rows = q[start : start + n].transpose(0, 1)  # (Hq, n, D)
        out[start : start + n] = attend(rows, keys, values, mask, scale).transpose(0, 1)
    return out

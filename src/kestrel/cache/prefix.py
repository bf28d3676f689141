"""Automatic prefix caching: full KV blocks keyed by a hash chain of their tokens. Plain Python.

Block b's key is hash(key of block b - 1, its tokens, the digests of the images that start in
it), so one key names one prefix at one set of absolute positions, and a hit reuses keys computed
for exactly those tokens there (docs/architecture.md §1). The engine runs
one model, so the model needs no place in the key.

A cached block whose last holder let go stays in the least-recently-used order and is evicted
only when the pool needs a block; the block manager (cache/blocks.py) does the reference counts.
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def block_key(parent: bytes, tokens: Sequence[int], images: bytes = b"") -> bytes:
    """The key of a block holding `tokens` after the prefix whose last key is `parent`."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    digest.update(images)
    return digest.digest()


def chain(tokens: Sequence[int], block_size: int, images=(), first: int = 0, parent=b""):
    """Keys of the full blocks of `tokens` from block `first` (`parent`: the key before it).
    `images`: (first token, digest) of each image, which joins the key of the block it starts
    in (images change keys that their placeholder tokens alone would not)."""
    keys = []
    for b in range(first, len(tokens) // block_size):
        start = b * block_size
        extra = b"".join(d for at, d in images if start <= at < start + block_size)
        parent = block_key(parent, tokens[start : start + block_size], extra)
        keys.append(parent)
    return keys


@dataclass
class Hit:
    """What a lookup found: `tokens` whose keys are cached, the (logical, physical) blocks a
    sequence needs to go on from there, and the key chain of every block before `tokens`."""

    tokens: int = 0
    blocks: tuple[tuple[int, int], ...] = ()
    keys: tuple[bytes, ...] = ()
    state: int = 0  # the snapshot slot of the recurrent state after `tokens` (0: none)
    from_host: tuple[int, ...] = ()  # logical blocks the host tier holds (no device block yet)


class PrefixCache:
    """key <-> physical block, and the cached blocks no sequence holds, oldest first. For models
    with recurrent layers (`snapshot_slots` given) a hit also needs the state after its last
    block: key -> snapshot slot, least recently used first."""

    def __init__(self, snapshot_slots: Sequence[int] = ()):
        self.stateful = bool(snapshot_slots)
        self.free_snapshots = list(snapshot_slots)
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()
        self.block_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # evictable, least recently used first
        self.queried_tokens = self.hit_tokens = self.evictions = 0  # metrics

    def add(self, key: bytes, block: int) -> None:
        """Cache `block` under `key`, unless another block already holds the same keys."""
        if key not in self.block_of and block not in self.key_of:
            self.block_of[key] = block
            self.key_of[block] = key

    def find(self, keys: Sequence[bytes], window_blocks: int | None, elsewhere=()) -> int:
        """How many of the chain's blocks a hit covers: the longest prefix whose blocks are all
        cached, or where every layer slides (`window_blocks`: the blocks the next query may see),
        the longest prefix whose last `window_blocks` are. Keys in `elsewhere` (the host tier)
        count as cached."""
        cached = [key in self.block_of or key in elsewhere for key in keys]
        if self.stateful:  # recurrent state is rebuilt only from a snapshot where the hit ends
            n = cached.index(False) if False in cached else len(cached)
            while n and keys[n - 1] not in self.snapshots:
                n -= 1
            if n:
                self.snapshots.move_to_end(keys[n - 1])
            return n
        if window_blocks is None:
            return cached.index(False) if False in cached else len(cached)
        for n in range(len(cached), 0, -1):
            if all(cached[max(0, n - window_blocks) : n]):
                return n
        return 0

    def add_snapshot(self, key: bytes) -> int | None:
        """A slot for the recurrent state after the block keyed `key`, the least recently used
        one's if none is free; None if that state is kept already."""
        if key in self.snapshots:
            self.snapshots.move_to_end(key)
            return None
        if self.free_snapshots:
            slot = self.free_snapshots.pop()
        else:
            _, slot = self.snapshots.popitem(last=False)
        self.snapshots[key] = slot
        return slot

    def take(self, block: int) -> None:
        """A sequence holds `block` again: it is no longer evictable."""
        self.idle.pop(block, None)

    def park(self, block: int) -> bool:
        """No sequence holds `block`: keep it evictable if it is cached; False if it is not."""
        if block not in self.key_of:
            return False
        self.idle[block] = None
        return True

    def evict(self) -> tuple[int, bytes] | None:
        """The least recently used idle block and the key it was cached under, forgotten; None
        if there is none."""
        if not self.idle:
            return None
        block, _ = self.idle.popitem(last=False)
        key = self.key_of.pop(block)
        del self.block_of[key]
        self.evictions += 1
        return block, key

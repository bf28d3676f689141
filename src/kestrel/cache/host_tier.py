"""The prefix cache's host tier, in plain Python: which cached blocks live in host memory, and the
copies the runner makes between the device pool and the host pool (cache/host_pool.py).

When the pool evicts a cached block for new keys, its contents go to a host slot and its key stays
findable here (`offload`); a later prefix lookup that misses on the device but finds the key here
gets a fresh device block with the contents copied back (`restore`) before the step that reads it.
vLLM's CPU offloading and SGLang's HiCache keep evicted KV the same way.

Every copy, in either direction, joins ONE ordered list that the runner applies in order before
the next forward: a device block evicted and then reused, or a host slot given to one key and
then another, always sees its copies in the order the scheduler decided them. The runner applies
them before the forward that writes the reused blocks.

Recurrent-state snapshots (the hybrids') are not offloaded: a hit on a hybrid still ends at a
snapshot kept on the device (cache/prefix.py).
"""

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCopy:
    """Copy one block: device block `block` -> host slot `slot` (`to_host`), or back."""

    to_host: bool
    block: int
    slot: int


class HostTier:
    """key -> host slot for `num_slots` slots, least recently used first, and the copies due."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()
        self.handed_out = 0  # slots 0 .. handed_out - 1 are taken (a full tier reuses its LRU's)
        self.copies: list[BlockCopy] = []
        self.offloaded = self.restored = self.evictions = 0  # blocks, over its life (metrics)
        self.hit_tokens = 0  # prompt tokens that came back from it (a metric)

    def __contains__(self, key: bytes) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def offload(self, key: bytes, block: int) -> None:
        """The device pool evicts `block`, cached under `key`: keep its contents in a host slot
        (the least recently used one's when none is free). Keys already here only move to the
        end: a key names its contents, so the host copy is still exact."""
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
            return
        slot = self._slot()
        if slot is None:
            return
        self.slot_of[key] = slot
        self.copies.append(BlockCopy(True, block, slot))
        self.offloaded += 1

    def restore(self, keys: Sequence[bytes], allocate: Callable[[], int]) -> list[int]:
        """A prefix hit needs `keys`' contents on the device before its next step: a device
        block from `allocate` for each, the copy back queued. `allocate` may evict cached device
        blocks into this tier; `keys` are held out of its LRU meanwhile, so none of them loses
        its slot. Their host copies stay (the device may evict the blocks again)."""
        slots = [self.slot_of.pop(key) for key in keys]
        blocks = []
        for slot in slots:
            blocks.append(allocate())
            self.copies.append(BlockCopy(False, blocks[-1], slot))
        self.slot_of.update(zip(keys, slots, strict=True))
        self.restored += len(keys)
        return blocks

    def take_copies(self) -> list[BlockCopy]:
        """The copies due, in the order they must run (the runner calls it before a forward)."""
        due, self.copies = self.copies, []
        return due

    def limit(self, num_slots: int) -> None:
        """Use at most `num_slots` slots (before any is taken: ranks agree on the fewest)."""
        assert self.handed_out == 0, "limit a tier before it is used"
        self.num_slots = min(self.num_slots, num_slots)

    def _slot(self) -> int | None:
        if self.handed_out < self.num_slots:
            self.handed_out += 1
            return self.handed_out - 1
        if not self.slot_of:
            return None  # no slot at all (a tier of 0 slots)
        _, slot = self.slot_of.popitem(last=False)
        self.evictions += 1
        return slot

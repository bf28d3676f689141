"""Which data-parallel replica serves a request: the one most likely to hold its prefix's KV.

Each replica keeps its own prefix cache, so a request whose prompt starts like one a replica
served recently reuses that replica's KV instead of recomputing it. The rule (SGLang's
cache-aware router and vLLM's prefix-aware routing, simplified):

- the prompt's first blocks (up to `max_blocks` of `block_size` tokens) are hashed as a chain,
  so the hash of block i stands for the whole prefix up to it;
- a table maps each prefix hash to the replica that last served it; a replica's match is the
  deepest of the prompt's prefixes it served;
- the deepest match wins; equal matches (and prompts no replica has seen) go to the replica with
  the fewest outstanding requests, then the fewest routed so far (so an idle set alternates);
- a match is given up when its replica is `max_imbalance` requests busier than the least busy
  one (a hot prefix must not pin all traffic to one replica).

Plain Python, no torch: tested on its own (tests/test_replica_router.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence


def prefix_hashes(prompt_ids: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
    """The chained hash of each full block among the prompt's first `max_blocks`: entry i
    stands for prompt_ids[: (i + 1) * block_size]."""
    hashes, previous = [], 0
    for start in range(0, min(len(prompt_ids), block_size * max_blocks), block_size):
        block = prompt_ids[start : start + block_size]
        if len(block) < block_size:
            break
        previous = hash((previous, tuple(block)))
        hashes.append(previous)
    return hashes


class PrefixRouter:
    """The routing rule and its table (prefix hash -> replica that last served it)."""

    def __init__(
        self,
        block_size: int = 64,
        max_blocks: int = 32,
        max_imbalance: int = 32,  # SGLang's router's default balance threshold
        max_entries: int = 1 << 16,  # prefix hashes remembered (least recently routed go)
    ):
        if block_size < 1 or max_blocks < 1:
            raise ValueError("block_size and max_blocks must be >= 1")
        self.block_size, self.max_blocks = block_size, max_blocks
        self.max_imbalance, self.max_entries = max_imbalance, max_entries
        self.table: OrderedDict[int, int] = OrderedDict()
        self.routed: dict[int, int] = {}  # replica -> requests routed to it

    def route(self, prompt_ids: Sequence[int] | None, outstanding: Mapping[int, int]) -> int:
        """The replica (a key of `outstanding`: live replica -> its unfinished requests) for a
        prompt (None: no token prefix, e.g. an image prompt: load alone decides); the prompt's
        prefixes are then recorded as that replica's."""
        if not outstanding:
            raise ValueError("no replica to route to")
        hashes = self._hashes(prompt_ids)
        depth = self._match_depths(hashes, outstanding)
        least = min(outstanding.values())

        def rank(replica: int) -> tuple:
            match = depth.get(replica, 0)
            if outstanding[replica] - least > self.max_imbalance:
                match = 0  # too busy: its cache is not worth the wait
            return (-match, outstanding[replica], self.routed.get(replica, 0), replica)

        chosen = min(outstanding, key=rank)
        self._record(hashes, chosen)
        return chosen

    def forget(self, replica: int) -> None:
        """A replica lost its cache (it died or restarted): nothing it served is cached now."""
        for key in [key for key, owner in self.table.items() if owner == replica]:
            del self.table[key]

    def _hashes(self, prompt_ids: Sequence[int] | None) -> list[int]:
        if prompt_ids is None:
            return []
        return prefix_hashes(prompt_ids, self.block_size, self.max_blocks)

    def _match_depths(self, hashes: list[int], replicas: Mapping[int, int]) -> dict[int, int]:
        """replica -> how many of the prompt's first blocks it last served."""
        depth: dict[int, int] = {}
        for blocks, key in enumerate(hashes, start=1):
            owner = self.table.get(key)
            if owner in replicas:
                depth[owner] = blocks
        return depth

    def _record(self, hashes: list[int], replica: int) -> None:
        self.routed[replica] = self.routed.get(replica, 0) + 1
        for key in hashes:
            self.table[key] = replica
            self.table.move_to_end(key)
        while len(self.table) > self.max_entries:
            self.table.popitem(last=False)

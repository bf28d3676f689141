"""KV memory in blocks, in plain Python: the scheduler owns it (no torch here).

A sequence's logical block `b` holds positions [b * block_size, (b + 1) * block_size). Its
`BlockTable` holds the blocks of its live window: the sinks' blocks [0, n_sink) and one contiguous
run after them. Trimming (`--max-kv-size`) and sliding-window eviction give back every block that
holds no live key at once; partial blocks stay and the mask hides their dead keys (DESIGN.md
section 1: the mask comes from positions, not from storage).

The `BlockManager` hands out block ids to tables. The scheduler plans each step's chunks with it
(`blocks_needed`, `grow`), so a step never runs out of blocks in the middle of a forward; the paged
runner's caches read the same tables to place keys in its pool. The reference runner keeps its
keys elsewhere, and the manager then counts its memory with one-token blocks.

Blocks given back during a step are reusable only after `commit()` (the runner calls it once the
step ran), so restoring a failed step never finds a trimmed block overwritten.
"""

from dataclasses import dataclass, field


class KVPoolExhaustedError(RuntimeError):
    """No free block is left (a step was not planned with the manager)."""


def live_tokens(offset: int, live_start: int, keep: int) -> int:
    """Tokens the full-attention layers hold: the sinks [0, min(keep, live_start)) and [live_start,
    offset)."""
    return min(keep, live_start) + offset - live_start


def tokens_to_trim(live: int, m: int, max_kv_size: int | None, keep: int) -> int:
    """Before appending `m` tokens to `live` under a KV bound, how many to trim so that
    live + m <= max_kv_size."""
    if not max_kv_size:
        return 0
    if m > max_kv_size - keep:
        raise ValueError(f"chunk of {m} tokens exceeds max_kv_size {max_kv_size} - keep {keep}")
    return max(0, live + m - max_kv_size)


def trimmed_live_start(offset: int, live_start: int, keep: int, n: int) -> int:
    """Where the live run starts once the `n` oldest tokens after the `keep` sinks are dropped."""
    return min(max(live_start, keep) + n, offset)


def evict_window(specs) -> int | None:
    """The window behind which a sequence's keys are dead in every layer (cache specs: `kind`,
    `window`): only when every layer slides, else None."""
    windows = [s.window if s.kind == "sliding" else None for s in specs]
    return None if None in windows or not windows else max(windows)


@dataclass
class BlockTable:
    """One sequence's blocks. `held`: (logical, physical) pairs, ascending; a tuple, replaced (never
    changed in place) when blocks come or go, so checkpoints share it."""

    manager: "BlockManager"
    live_start: int = 0
    keep: int = 0
    held: tuple[tuple[int, int], ...] = ()
    _table: tuple | None = field(default=None, repr=False)  # (held, its table), cached

    def live_tokens(self, offset: int) -> int:
        return live_tokens(offset, self.live_start, self.keep)

    def make_room(self, offset: int, m: int, max_kv_size: int | None, keep: int) -> int:
        """Trim so that `m` more tokens fit the request's KV bound; tokens trimmed."""
        n = tokens_to_trim(self.live_tokens(offset), m, max_kv_size, keep)
        self.trim_front(offset, n, keep)
        return n

    def trim_front(self, offset: int, n: int, keep: int) -> None:
        """Drop the `n` oldest tokens after the `keep` sinks; blocks left with no live key go."""
        if n <= 0:
            return
        self.keep = keep
        self.live_start = trimmed_live_start(offset, self.live_start, keep, n)
        self._give_back_dead(offset)
        self.manager.tokens_trimmed += n

    def reserve(self, offset: int, m: int) -> None:
        """Hold blocks for positions [offset, offset + m); give back those out of every window."""
        if self.manager.evict_window is not None:
            self._give_back_dead(offset)
        new = self._new_logical(offset, m)
        if new:
            self.held += tuple((logical, self.manager.allocate()) for logical in new)

    def blocks_needed(self, offset: int, m: int, max_kv_size: int | None, keep: int) -> int:
        """New blocks that `make_room` and `reserve` of m tokens would take (nothing changes)."""
        saved = (self.live_start, self.keep, self.held, self.manager.tokens_trimmed)
        pending = set(self.manager.pending)
        try:
            self.make_room(offset, m, max_kv_size, keep)
            if self.manager.evict_window is not None:
                self._give_back_dead(offset)
            return len(self._new_logical(offset, m))
        finally:
            self.live_start, self.keep, self.held, self.manager.tokens_trimmed = saved
            self.manager.pending = pending

    def _new_logical(self, offset: int, m: int) -> range:
        size = self.manager.block_size
        have = self.held[-1][0] + 1 if self.held else 0
        return range(have, (offset + m + size - 1) // size)

    def _give_back_dead(self, next_position: int) -> None:
        size, sinks = self.manager.block_size, min(self.keep, self.live_start)
        first_live = self.live_start
        window = self.manager.evict_window
        if window is not None:  # the next query sees keys > next_position - window
            first_live = max(first_live, next_position - window + 1)
        alive = lambda b: b * size < sinks or (b + 1) * size > first_live  # noqa: E731
        dead = [phys for logical, phys in self.held if not alive(logical)]
        if dead:
            self.held = tuple((lg, ph) for lg, ph in self.held if alive(lg))
            self.manager.pending.update(dead)

    def table(self) -> tuple[list[int], int, int]:
        """(physical blocks in order, n_sink, main_start): entry j holds logical block j for
        j < n_sink, else main_start + j - n_sink."""
        if self._table is None or self._table[0] is not self.held:
            self._table = (self.held, self._make_table())
        return self._table[1]

    def _make_table(self) -> tuple[list[int], int, int]:
        blocks = [phys for _, phys in self.held]
        n_sink = 0
        while n_sink < len(self.held) and self.held[n_sink][0] == n_sink:
            n_sink += 1
        if n_sink == len(self.held):  # no gap: one contiguous run from block 0
            return blocks, 0, 0
        return blocks, n_sink, self.held[n_sink][0]

    def slots(self, start: int, n: int) -> list[int]:
        """The flat slots (block * block_size + position % block_size) of [start, start + n)."""
        size = self.manager.block_size
        if n == 1 and self.held and self.held[-1][0] == start // size:  # decode: the newest block
            return [self.held[-1][1] * size + start % size]
        block_of = dict(self.held)
        return [block_of[q // size] * size + q % size for q in range(start, start + n)]

    def checkpoint(self) -> tuple:
        return (self.live_start, self.keep, self.held)

    def restore(self, state: tuple) -> None:
        self.live_start, self.keep, held = state
        before = {phys for _, phys in held}
        now = {phys for _, phys in self.held}
        self.manager.free.extend(now - before)  # allocated since: never visible
        self.manager.pending -= before - now  # given back since: take back
        self.held = held


class BlockManager:
    """The KV blocks of every sequence: `num_blocks` ids from `first_id` (None: unlimited, only
    counted), `block_size` tokens each. `evict_window`: blocks behind it are dead (only when every
    layer slides; None otherwise)."""

    def __init__(
        self,
        num_blocks: int | None,
        block_size: int = 1,
        evict_window: int | None = None,
        first_id: int = 0,
    ):
        self.num_blocks, self.block_size, self.evict_window = num_blocks, block_size, evict_window
        end = first_id + (num_blocks or 0)
        self.free: list[int] = list(range(end - 1, first_id - 1, -1))  # pop() gives low ids first
        self._next_id = end  # ids past the pool, for an unlimited manager
        self.pending: set[int] = set()  # given back this step; reusable after commit()
        self.tables: dict[str, BlockTable] = {}
        self.tokens_trimmed = 0  # over the manager's life (a metric)

    @property
    def limited(self) -> bool:
        return self.num_blocks is not None

    @property
    def token_capacity(self) -> int | None:
        return None if self.num_blocks is None else self.num_blocks * self.block_size

    @property
    def num_free(self) -> int | None:
        return len(self.free) if self.limited else None

    @property
    def num_used(self) -> int:
        return sum(len(t.held) for t in self.tables.values())

    def table(self, request_id: str) -> BlockTable:
        if request_id not in self.tables:
            self.tables[request_id] = BlockTable(self)
        return self.tables[request_id]

    def fits(self, blocks: int) -> bool:
        """Whether `blocks` more are free now."""
        return not self.limited or blocks <= len(self.free)

    def fits_alone(self, blocks: int) -> bool:
        """Whether one sequence may ever hold `blocks` (the whole pool free)."""
        return not self.limited or blocks <= self.num_blocks

    def allocate(self) -> int:
        if self.free:
            return self.free.pop()
        if not self.limited:
            self._next_id += 1
            return self._next_id - 1
        raise KVPoolExhaustedError(
            f"KV pool exhausted ({self.num_blocks} blocks of {self.block_size} tokens)"
        )

    def release(self, request_id: str) -> None:
        """Give back a sequence's blocks now (it finished, failed or was preempted)."""
        table = self.tables.pop(request_id, None)
        if table is not None:
            self._give_back(phys for _, phys in table.held)

    def commit(self) -> None:
        """The step ran: blocks given back during it may be handed out again."""
        self._give_back(self.pending)
        self.pending = set()

    def _give_back(self, blocks) -> None:
        if self.limited:
            self.free.extend(blocks)

    def peak_blocks(self, total_tokens: int, max_kv_size: int | None, keep: int) -> int:
        """The most blocks a sequence of `total_tokens` may need at once (under its KV bound: the
        sinks' blocks, the live run's, a partial block at its end and the next step's new block,
        as the blocks a step trims are reused only after it)."""
        size = self.block_size
        whole = -(-total_tokens // size)
        if not max_kv_size or max_kv_size >= total_tokens:
            return whole
        return min(whole, -(-keep // size) + -(-(max_kv_size - keep) // size) + 2)

"""KV memory in blocks, in plain Python: the scheduler owns it (no torch here).

A sequence's logical block `b` holds positions [b * block_size, (b + 1) * block_size). Its
`BlockTable` holds the blocks of its live window: the sinks' blocks [0, n_sink) and one contiguous
run after them. Trimming (`--max-kv-size`) and sliding-window eviction give back every block that
holds no live key at once; partial blocks stay and the mask hides their dead keys
(docs/architecture.md §1: the mask comes from positions, not from storage).

The `BlockManager` hands out block ids to tables. A runner says what its memory is (`KVMemory`);
the scheduler builds the manager from that and alone writes to it: it plans each step's chunks
(`blocks_needed`, `make_room`, `reserve`), so a step never runs out of blocks in the middle of a
forward, and hands each chunk's table to the runner, whose paged caches only read it to place keys
in the pool. The reference runner keeps its keys elsewhere, and its memory is counted in one-token
blocks.

Blocks given back while a step is planned are reusable only after `commit()` (the scheduler calls
it when it plans the next step, once this one ran), so no chunk of a step writes keys into a block
that another chunk of the same step still reads.

With prefix caching (cache/prefix.py) a full block may be held by several tables: each block
counts its holders, is written only by the sequence that allocated it (a hit covers whole blocks,
and every sequence writes only positions after its hit), and when its last holder lets go stays
cached, evictable, until the pool needs it. Keys computed after a sequence's first trim saw fewer
keys than a full prompt would, so only the blocks before its first trim are cached. A finished
sequence's blocks become evictable last block first, so a conversation's head stays longest (a
hit needs every block before its end).

With a host tier (`host`, cache/host_tier.py; the paged runner's memory has `host_slots` for
--kv-offloading-size) an evicted block's contents go to host memory and its key stays findable
there; a hit on it takes a device block and the contents come back before the next step (the
copies go to the runner in the step's plan).
"""

from dataclasses import asdict, dataclass, field

from kestrel.cache.host_tier import HostTier
from kestrel.cache.prefix import Hit, PrefixCache, chain


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


@dataclass(frozen=True)
class KVMemory:
    """A runner's KV memory, which the scheduler builds its `BlockManager` from (the manager's
    arguments: see there): `num_blocks` of `block_size` tokens (None: unlimited, only counted)."""

    num_blocks: int | None
    block_size: int = 1
    evict_window: int | None = None
    first_id: int = 0
    prefix_caching: bool = False
    prefix_tokens: int | None = None
    state_slots: int = 0
    host_slots: int = 0

    @property
    def token_capacity(self) -> int | None:
        return None if self.num_blocks is None else self.num_blocks * self.block_size


@dataclass
class BlockTable:
    """One sequence's blocks. `held`: (logical, physical) pairs, ascending; a tuple, replaced (never
    changed in place) when blocks come or go, so `table()` knows when to build its list again."""

    manager: "BlockManager"
    live_start: int = 0
    keep: int = 0
    held: tuple[tuple[int, int], ...] = ()
    keys: tuple[bytes, ...] = ()  # prefix-cache keys of its logical blocks 0, 1, ... so far
    full_view_until: int | None = None  # tokens computed before its first trim (None: none yet)
    state_slot: int = 0  # its recurrent-state slot (0: none given)
    state_from: int = 0  # the snapshot slot its state starts from (a prefix hit; 0: zeros)
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
        if self.full_view_until is None:
            self.full_view_until = offset
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

    def truncate(self, end: int) -> None:
        """Speculative decoding's rollback: positions from `end` on were never written (their
        tokens were rejected); blocks that hold only such positions go back now (the step ran)."""
        size = self.manager.block_size
        kept = tuple((lg, ph) for lg, ph in self.held if lg * size < end)
        for _, phys in self.held[len(kept) :]:
            self.manager.drop(phys)
        self.held = kept

    def blocks_needed(self, offset: int, m: int, max_kv_size: int | None, keep: int) -> int:
        """New blocks that `make_room` and `reserve` of m tokens would take (nothing changes)."""
        saved = (self.live_start, self.keep, self.held)
        try:
            n = tokens_to_trim(self.live_tokens(offset), m, max_kv_size, keep)
            if n > 0:
                self.keep = keep
                self.live_start = trimmed_live_start(offset, self.live_start, keep, n)
            if n > 0 or self.manager.evict_window is not None:
                self.held = self._alive(offset)
            return len(self._new_logical(offset, m))
        finally:
            self.live_start, self.keep, self.held = saved

    def _new_logical(self, offset: int, m: int) -> range:
        size = self.manager.block_size
        have = self.held[-1][0] + 1 if self.held else 0
        return range(have, (offset + m + size - 1) // size)

    def _alive(self, next_position: int) -> tuple[tuple[int, int], ...]:
        """The held blocks that still hold a key the query at `next_position` may see."""
        size, sinks = self.manager.block_size, min(self.keep, self.live_start)
        first_live = self.live_start
        window = self.manager.evict_window
        if window is not None:  # the next query sees keys > next_position - window
            first_live = max(first_live, next_position - window + 1)
        return tuple(
            (lg, ph) for lg, ph in self.held if lg * size < sinks or (lg + 1) * size > first_live
        )

    def _give_back_dead(self, next_position: int) -> None:
        alive = self._alive(next_position)
        if len(alive) < len(self.held):
            for _, phys in set(self.held) - set(alive):
                self.manager.drop(phys, at_commit=True)
            self.held = alive

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


class BlockManager:
    """The KV blocks of every sequence: `num_blocks` ids from `first_id` (None: unlimited, only
    counted), `block_size` tokens each. `evict_window`: blocks behind it are dead (only when every
    layer slides; None otherwise). `prefix_caching`: full blocks are kept and shared by key, for
    sequences of at most `prefix_tokens` (None: any; the model's `chunk_invariant_tokens`).
    `state_slots`: recurrent-state slots, ids from 1, one per running sequence (0: no recurrent
    layers); with prefix caching as many snapshot slots after them hold the state at the end of
    cached prompts' last full blocks."""

    def __init__(
        self,
        num_blocks: int | None,
        block_size: int = 1,
        evict_window: int | None = None,
        first_id: int = 0,
        prefix_caching: bool = False,
        prefix_tokens: int | None = None,
        state_slots: int = 0,
        host_slots: int = 0,
    ):
        self.num_blocks, self.block_size, self.evict_window = num_blocks, block_size, evict_window
        end = first_id + (num_blocks or 0)
        self.free: list[int] = list(range(end - 1, first_id - 1, -1))  # pop() gives low ids first
        self._next_id = end  # ids past the pool, for an unlimited manager
        self.refs: dict[int, int] = {}  # block -> tables holding it (held blocks only)
        self.pending: set[int] = set()  # let go of this step; reusable after commit()
        snapshot_slots = range(2 * state_slots, state_slots, -1)
        self.prefix = PrefixCache(snapshot_slots) if prefix_caching else None
        self.snapshots_due: list[tuple[int, int]] = []  # (state slot, snapshot slot) to copy
        self.prefix_tokens = prefix_tokens
        self.tables: dict[str, BlockTable] = {}
        self.tokens_trimmed = 0  # over the manager's life (a metric)
        self.free_states = list(range(state_slots, 0, -1))
        self.state_slots = state_slots
        # the prefix cache's host tier (None: none)
        self.host = HostTier(host_slots) if host_slots and self.prefix is not None else None

    @classmethod
    def of(cls, memory: KVMemory) -> "BlockManager":
        return cls(**asdict(memory))

    @property
    def limited(self) -> bool:
        return self.num_blocks is not None

    @property
    def token_capacity(self) -> int | None:
        return None if self.num_blocks is None else self.num_blocks * self.block_size

    @property
    def num_free(self) -> int | None:
        """Blocks a sequence may take now: free ones and cached ones no sequence holds."""
        if not self.limited:
            return None
        return len(self.free) + (len(self.prefix.idle) if self.prefix is not None else 0)

    @property
    def num_used(self) -> int:
        return len(self.refs)

    def table(self, request_id: str) -> BlockTable:
        if request_id not in self.tables:
            self.tables[request_id] = BlockTable(self)
        return self.tables[request_id]

    def state_slot(self, request_id: str) -> int:
        """The sequence's recurrent-state slot, given at its first step (at most one per running
        sequence, and the scheduler runs at most as many as there are slots)."""
        table = self.table(request_id)
        if not table.state_slot:
            table.state_slot = self.free_states.pop()
        return table.state_slot

    @property
    def max_sequences(self) -> int | None:
        """How many sequences may run at once: one per recurrent-state slot (None: no bound)."""
        return self.state_slots or None

    @property
    def snapshots(self) -> bool:
        """Whether prefix hits need a snapshot of recurrent state where they end."""
        return self.prefix is not None and self.prefix.stateful

    def take_copies(self) -> list:
        """The host tier's block copies due before the next step, in order (none without one)."""
        return self.host.take_copies() if self.host is not None else []

    def take_snapshots(self) -> list[tuple[int, int]]:
        """The (state slot, snapshot slot) copies due before the next step (the scheduler hands
        them to the runner in its plan)."""
        due, self.snapshots_due = self.snapshots_due, []
        return due

    def fits(self, blocks: int) -> bool:
        """Whether `blocks` more are free now."""
        return not self.limited or blocks <= self.num_free

    def fits_alone(self, blocks: int) -> bool:
        """Whether one sequence may ever hold `blocks` (the whole pool free)."""
        return not self.limited or blocks <= self.num_blocks

    def allocate(self) -> int:
        """A block for new keys: a free one, else the least recently used cached one."""
        block = self.free.pop() if self.free else None
        if block is None and self.prefix is not None:
            block = self._evict()
        if block is None and not self.limited:
            self._next_id += 1
            block = self._next_id - 1
        if block is None:
            raise KVPoolExhaustedError(
                f"KV pool exhausted ({self.num_blocks} blocks of {self.block_size} tokens)"
            )
        self.refs[block] = 1
        return block

    def _evict(self) -> int | None:
        """The least recently used cached block, its contents offloaded to the host tier."""
        evicted = self.prefix.evict()
        if evicted is None:
            return None
        block, key = evicted
        if self.host is not None:
            self.host.offload(key, block)
        return block

    def take(self, block: int) -> None:
        """One more table holds `block` (a prefix hit)."""
        if block not in self.refs:
            self.pending.discard(block)
            if self.prefix is not None:
                self.prefix.take(block)
        self.refs[block] = self.refs.get(block, 0) + 1

    def drop(self, block: int, at_commit: bool = False) -> None:
        """One table fewer holds `block`; with the last, it goes back (after the step if
        `at_commit`)."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            del self.refs[block]
            if at_commit:
                self.pending.add(block)
            else:
                self._give_back([block])

    def release(self, request_id: str) -> None:
        """Give back a sequence's blocks now (it finished, failed or was preempted)."""
        table = self.tables.pop(request_id, None)
        if table is not None and table.state_slot:
            self.free_states.append(table.state_slot)
        if table is not None:  # last block first: the least recently used, evicted first
            for _, phys in reversed(table.held):
                self.drop(phys)

    def commit(self) -> None:
        """The step ran: blocks given back during it may be handed out again."""
        self._give_back(self.pending)
        self.pending = set()

    def _give_back(self, blocks) -> None:
        for block in blocks:
            if block in self.refs or (self.prefix is not None and self.prefix.park(block)):
                continue  # held again, or cached until evicted
            if self.limited:
                self.free.append(block)

    # -- prefix caching ---------------------------------------------------------------------

    def lookup(self, tokens: list[int], limit: int, images=(), root: bytes = b"") -> Hit:
        """The cached prefix of `tokens[:limit]` (nothing changes; see `attach`). `images`:
        (first token, digest) of each image in them; `root`: the key the chain starts from (a
        LoRA adapter's: keys computed under one adapter never match another's)."""
        if self.prefix is None or (self.prefix_tokens and len(tokens) > self.prefix_tokens):
            return Hit()
        size = self.block_size
        keys = chain(tokens[: limit - limit % size], size, images, parent=root)
        window = None if self.evict_window is None else -(-(self.evict_window - 1) // size)
        hit = self._hit(keys, window, self.host if self.host is not None else ())
        if hit.from_host and len(hit.from_host) > self._free_beside(hit):
            hit = self._hit(keys, window, ())  # no room to bring them back: the device's alone
        return hit

    def _hit(self, keys: list[bytes], window: int | None, elsewhere) -> Hit:
        """The hit on `keys` over the device's cached blocks and the keys in `elsewhere`."""
        n = self.prefix.find(keys, window, elsewhere)
        first = 0 if window is None else max(0, n - window)
        on_device = [b for b in range(first, n) if keys[b] in self.prefix.block_of]
        blocks = tuple((b, self.prefix.block_of[keys[b]]) for b in on_device)
        from_host = tuple(sorted(set(range(first, n)) - set(on_device)))
        state = self.prefix.snapshots[keys[n - 1]] if n and self.snapshots else 0
        return Hit(n * self.block_size, blocks, tuple(keys[:n]), state, from_host)

    def _free_beside(self, hit: Hit) -> int:
        """Blocks left to allocate once `hit`'s device blocks are held (idle ones stop being
        evictable)."""
        if not self.limited:
            return len(hit.from_host)
        idle = sum(1 for _, block in hit.blocks if block in self.prefix.idle)
        return self.num_free - idle

    def attach(self, table: BlockTable, hit: Hit) -> None:
        """An empty table starts from a hit: it holds the hit's blocks, and a device block for
        each one the host tier holds, its contents copied back before the next step."""
        for _, block in hit.blocks:
            self.take(block)
        keys = [hit.keys[b] for b in hit.from_host]
        restored = self.host.restore(keys, self.allocate) if keys else []
        for key, block in zip(keys, restored, strict=True):
            self.prefix.add(key, block)
        table.held = tuple(sorted(hit.blocks + tuple(zip(hit.from_host, restored, strict=True))))
        table.keys, table.state_from = hit.keys, hit.state

    def publish(
        self,
        table: BlockTable,
        computed: int,
        prompt,
        output,
        images=(),
        snapshot=False,
        root: bytes = b"",
    ) -> None:
        """After a step ran: cache the table's blocks that its `computed` tokens (of `prompt` +
        `output`, joined only when a block filled) filled, up to its first trim (`images` as in
        `lookup`); with `snapshot`, and the recurrent state after them too."""
        if self.prefix is None or (self.prefix_tokens and computed > self.prefix_tokens):
            return  # keys computed past `prefix_tokens` depend on the chunks: never shared
        until = computed if table.full_view_until is None else min(computed, table.full_view_until)
        first, size = len(table.keys), self.block_size
        if until // size <= first:
            return
        parent = table.keys[-1] if table.keys else root
        tokens = (prompt + output)[: until - until % size]
        keys = chain(tokens, size, images, first, parent)
        block_of = dict(table.held)
        for logical, key in enumerate(keys, first):
            if logical in block_of:
                self.prefix.add(key, block_of[logical])
        table.keys += tuple(keys)
        if snapshot:
            self._snapshot(table, computed)

    def _snapshot(self, table: BlockTable, computed: int) -> None:
        """Keep the recurrent state after `computed` tokens, a cached block's end, for hits there
        (copied by the runner before the state moves on)."""
        n = computed // self.block_size
        if not self.snapshots or computed % self.block_size or not 0 < n <= len(table.keys):
            return
        slot = self.prefix.add_snapshot(table.keys[n - 1])
        if slot:
            self.snapshots_due.append((table.state_slot, slot))

    def peak_blocks(self, total_tokens: int, max_kv_size: int | None, keep: int) -> int:
        """The most blocks a sequence of `total_tokens` may need at once (under its KV bound: the
        sinks' blocks, the live run's, a partial block at its end and the next step's new block,
        as the blocks a step trims are reused only after it)."""
        size = self.block_size
        whole = -(-total_tokens // size)
        if not max_kv_size or max_kv_size >= total_tokens:
            return whole
        return min(whole, -(-keep // size) + -(-(max_kv_size - keep) // size) + 2)

"""The block manager the scheduler owns (cache/blocks.py): plain Python, no torch."""

import subprocess
import sys

import pytest

from kestrel.cache.blocks import BlockManager, KVPoolExhaustedError


def test_blocks_and_scheduler_import_no_torch():
    code = (
        "import sys, kestrel.cache.blocks, kestrel.engine.scheduler; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_table_holds_the_blocks_of_its_positions_and_gives_them_back():
    blocks = BlockManager(8, block_size=4, first_id=1)
    table = blocks.table("a")
    assert table.blocks_needed(0, 10, None, 0) == 3 and blocks.num_free == 8  # nothing taken
    table.reserve(0, 10)
    assert [lg for lg, _ in table.held] == [0, 1, 2] and blocks.num_free == 5
    assert table.slots(8, 2) == [table.held[2][1] * 4, table.held[2][1] * 4 + 1]
    table.reserve(10, 2)  # still within block 2
    assert blocks.num_free == 5
    blocks.release("a")
    assert blocks.num_free == 8 and not blocks.tables


def test_a_trim_gives_back_dead_blocks_after_the_step_and_keeps_the_sinks():
    blocks = BlockManager(8, block_size=4)
    table = blocks.table("a")
    table.reserve(0, 16)
    blocks.commit()
    trimmed = table.make_room(16, 4, max_kv_size=10, keep=2)  # 16 + 4 - 10 = 10 go
    assert trimmed == 10 and table.live_start == 12 and table.keep == 2
    assert [lg for lg, _ in table.held] == [0, 3]  # the sinks' block and the live one
    assert len(blocks.pending) == 2 and blocks.num_free == 4  # reused only after the step
    assert table.table()[1:] == (1, 3)  # n_sink, main_start
    blocks.commit()
    assert blocks.num_free == 6 and blocks.tokens_trimmed == 10


def test_blocks_behind_a_window_go_when_every_layer_slides():
    blocks = BlockManager(8, block_size=4, evict_window=5)
    table = blocks.table("a")
    table.reserve(0, 12)
    table.reserve(12, 1)  # the query at 12 sees keys > 7: blocks 0 and 1 are dead
    assert [lg for lg, _ in table.held] == [2, 3]


def test_an_empty_pool_raises_and_an_unlimited_one_never_does():
    blocks = BlockManager(2, block_size=4)
    with pytest.raises(KVPoolExhaustedError):
        blocks.table("a").reserve(0, 9)
    unlimited = BlockManager(None)
    unlimited.table("a").reserve(0, 10_000)
    assert unlimited.fits(10**9) and unlimited.num_used == 10_000


@pytest.mark.parametrize("total,bound,expected", [(40, None, 10), (40, 16, 1 + 4 + 2), (10, 16, 3)])
def test_peak_blocks_bound_what_one_sequence_can_hold(total, bound, expected):
    assert BlockManager(100, block_size=4).peak_blocks(total, bound, keep=2) == expected


# -- prefix caching ------------------------------------------------------------------------------


def cached_manager(num_blocks=8, evict_window=None) -> BlockManager:
    return BlockManager(num_blocks, 4, evict_window, prefix_caching=True)


def run_prompt(blocks: BlockManager, request_id: str, tokens: list[int]) -> None:
    """A sequence that computed `tokens` (after its hit, if any) and published its full blocks."""
    table = blocks.table(request_id)
    hit = blocks.lookup(tokens, len(tokens) - 1)
    if not table.held and hit.tokens:
        blocks.attach(table, hit)
    start = hit.tokens
    table.reserve(start, len(tokens) - start)
    blocks.publish(table, len(tokens), tokens, [])
    blocks.commit()


def test_a_finished_sequence_leaves_its_full_blocks_for_the_same_prefix():
    blocks = cached_manager()
    run_prompt(blocks, "a", list(range(10)))  # blocks 0, 1 full; 2 partial
    first = dict(blocks.table("a").held)
    blocks.release("a")
    assert blocks.num_free == 8 and len(blocks.prefix.block_of) == 2  # cached, yet free
    hit = blocks.lookup(list(range(9)) + [77, 78], 10)
    assert hit.tokens == 8 and dict(hit.blocks) == {0: first[0], 1: first[1]}
    assert blocks.lookup([5] + list(range(1, 12)), 11).tokens == 0  # another first block: a miss
    assert blocks.lookup(list(range(9)), 8).tokens == 8  # may cover at most `limit`
    assert blocks.lookup(list(range(9)), 7).tokens == 4


def test_shared_blocks_are_held_until_their_last_holder_lets_go():
    blocks = cached_manager()
    run_prompt(blocks, "a", list(range(9)))
    run_prompt(blocks, "b", list(range(8)) + [50, 51, 52])
    a, b = dict(blocks.table("a").held), dict(blocks.table("b").held)
    assert a[0] == b[0] and a[1] == b[1] and a[2] != b[2]
    assert blocks.num_used == 4  # two shared, one each
    blocks.release("a")
    assert blocks.num_used == 3 and blocks.refs[b[0]] == 1
    blocks.release("b")
    assert blocks.num_used == 0 and blocks.num_free == 8


def test_the_pool_evicts_the_least_recently_used_cached_block_only_when_it_must():
    blocks = cached_manager(num_blocks=6)
    for name, first in (("a", 0), ("b", 100)):  # two cached blocks each, and a partial one
        run_prompt(blocks, name, list(range(first, first + 9)))
        blocks.release(name)
    assert len(blocks.prefix.block_of) == 4 and blocks.num_free == 6
    table = blocks.table("c")
    # two free blocks, then the least recently used cached one: a's, its last block first
    table.reserve(0, 12)
    assert blocks.prefix.evictions == 1
    assert blocks.lookup(list(range(9)), 8).tokens == 4
    assert blocks.lookup(list(range(100, 109)), 8).tokens == 8
    table.reserve(12, 12)
    assert blocks.prefix.evictions == 4 and not blocks.prefix.block_of
    with pytest.raises(KVPoolExhaustedError):  # held blocks are never evicted
        table.reserve(24, 1)


def test_a_trimmed_sequence_caches_only_the_blocks_before_its_first_trim():
    blocks = cached_manager(num_blocks=16)
    table = blocks.table("a")
    tokens = list(range(24))
    table.reserve(0, 8)
    blocks.publish(table, 8, tokens, [])
    table.make_room(8, 8, max_kv_size=12, keep=0)  # 8 + 8 > 12: the first trim
    table.reserve(8, 8)
    blocks.publish(table, 16, tokens, [])
    assert len(blocks.prefix.block_of) == 2 and table.full_view_until == 8
    assert blocks.lookup(tokens, 23).tokens == 8


def test_where_every_layer_slides_a_hit_needs_only_the_blocks_in_the_window():
    blocks = cached_manager(num_blocks=16, evict_window=5)
    tokens = list(range(20))
    table = blocks.table("a")
    for start in range(0, 16, 4):  # chunk by chunk: the window drops the oldest blocks
        table.reserve(start, 4)
        blocks.publish(table, start + 4, tokens, [])
        blocks.commit()
    blocks.release("a")
    blocks.prefix.evict(), blocks.prefix.evict()  # the two least recently used: blocks 0 and 1
    hit = blocks.lookup(tokens, 17)
    assert hit.tokens == 16 and [lg for lg, _ in hit.blocks] == [3]  # sees keys > 11 only
    assert len(hit.keys) == 4  # the chain goes on from all four


# -- recurrent state (hybrid models): a hit also needs a snapshot where it ends -----------------


def stateful_manager(slots=2) -> BlockManager:
    return BlockManager(16, 4, prefix_caching=True, state_slots=slots)


def test_a_hybrid_hit_ends_where_a_recurrent_state_snapshot_was_kept():
    blocks = stateful_manager()
    tokens = list(range(13))
    table = blocks.table("a")
    slot = blocks.state_slot("a")
    table.reserve(0, 8)
    blocks.publish(table, 8, tokens, [], snapshot=True)  # the state after 8 tokens is kept
    table.reserve(8, 5)
    blocks.publish(table, 13, tokens, [])  # block 2 cached, but no state after it
    (due,) = blocks.take_snapshots()
    assert due[0] == slot and due[1] > 2  # from its running slot into a snapshot slot
    assert not blocks.take_snapshots()
    hit = blocks.lookup(tokens, 12)
    assert hit.tokens == 8 and hit.state == due[1]  # 12 blocks' keys cached, the state at 8
    blocks.release("a")
    assert sorted(blocks.free_states) == [1, 2]  # its running slot came back
    assert blocks.lookup([9] + tokens[1:], 12).tokens == 0  # other tokens: no snapshot


def test_state_snapshots_are_evicted_least_recently_used():
    blocks = stateful_manager(slots=1)  # one running slot, one snapshot slot
    for name, first in (("a", 0), ("b", 100)):
        tokens = list(range(first, first + 9))
        table = blocks.table(name)
        blocks.state_slot(name)
        table.reserve(0, 9)
        blocks.publish(table, 8, tokens, [], snapshot=True)
        blocks.release(name)
    assert len(blocks.take_snapshots()) == 2  # b's snapshot took a's slot
    assert blocks.lookup(list(range(9)), 8).tokens == 0
    assert blocks.lookup(list(range(100, 109)), 8).tokens == 8

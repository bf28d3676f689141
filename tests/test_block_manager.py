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


def test_restore_takes_back_what_a_failed_step_did():
    blocks = BlockManager(8, block_size=4)
    table = blocks.table("a")
    table.reserve(0, 10)
    blocks.commit()
    saved, free = table.checkpoint(), blocks.num_free
    table.make_room(10, 4, max_kv_size=8, keep=1)
    table.reserve(10, 4)
    table.restore(saved)
    assert blocks.num_free == free and not blocks.pending
    assert [lg for lg, _ in table.held] == [0, 1, 2]


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

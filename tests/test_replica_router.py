"""The data-parallel routing rule alone (kestrel.engine.router): prefix affinity, load as the
tie-break, the imbalance guard, and forgetting a replica's cache."""

import pytest

from kestrel.engine.router import PrefixRouter, prefix_hashes


def prompt(prefix: int, length: int, tail: int = 0) -> list[int]:
    """`length` tokens that start like every prompt of the same `prefix`; `tail` changes the
    last token only."""
    return [prefix * 1000 + i for i in range(length - 1)] + [tail]


def test_prefix_hashes_cover_only_full_blocks_up_to_the_limit():
    assert len(prefix_hashes(list(range(9)), block_size=4, max_blocks=8)) == 2
    assert len(prefix_hashes(list(range(100)), block_size=4, max_blocks=3)) == 3
    assert prefix_hashes(list(range(3)), block_size=4, max_blocks=8) == []


def test_prefix_hashes_chain_so_equal_blocks_after_different_ones_differ():
    a = prefix_hashes([1, 2, 9, 9], block_size=2, max_blocks=2)
    b = prefix_hashes([3, 4, 9, 9], block_size=2, max_blocks=2)
    assert a[1] != b[1]
    assert prefix_hashes([1, 2, 9, 9, 5], 2, 2) == a


def test_prompts_sharing_a_prefix_go_to_the_replica_that_served_it():
    router = PrefixRouter(block_size=4)
    first = router.route(prompt(1, 20, tail=1), {0: 0, 1: 0})
    # the other replica is idler now, yet the shared prefix wins
    loads = {first: 3, 1 - first: 0}
    assert router.route(prompt(1, 20, tail=2), loads) == first


def test_new_prefixes_go_to_the_least_loaded_replica():
    router = PrefixRouter(block_size=4)
    assert router.route(prompt(1, 20), {0: 5, 1: 2, 2: 7}) == 1


def test_an_idle_set_alternates_between_replicas():
    router = PrefixRouter(block_size=4)
    chosen = [router.route(prompt(p, 20), {0: 0, 1: 0}) for p in range(4)]
    assert chosen == [0, 1, 0, 1]


def test_short_prompts_and_image_prompts_route_by_load():
    router = PrefixRouter(block_size=4)
    router.route([1, 2, 3], {0: 0, 1: 0})  # shorter than a block: nothing recorded
    assert router.table == {}
    assert router.route(None, {0: 4, 1: 1}) == 1


def test_the_deepest_match_wins():
    router = PrefixRouter(block_size=4)
    router.route(prompt(1, 8), {0: 0})  # replica 0 served the first two blocks
    router.route(prompt(1, 16), {1: 0})  # replica 1 the first four
    assert router.route(prompt(1, 16, tail=7), {0: 0, 1: 2}) == 1


def test_a_replica_too_busy_loses_its_match():
    router = PrefixRouter(block_size=4, max_imbalance=3)
    router.route(prompt(1, 20), {0: 0})
    assert router.route(prompt(1, 20, tail=1), {0: 3, 1: 0}) == 0  # at the bound: still 0
    assert router.route(prompt(1, 20, tail=2), {0: 4, 1: 0}) == 1


def test_a_dead_replica_is_never_chosen_and_its_cache_is_forgotten():
    router = PrefixRouter(block_size=4)
    router.route(prompt(1, 20), {0: 0})
    assert router.route(prompt(1, 20, tail=1), {1: 5}) == 1  # 0 is not among the live
    router.forget(1)
    router.forget(0)
    assert router.table == {}


def test_the_table_is_bounded_least_recent_first():
    router = PrefixRouter(block_size=4, max_blocks=1, max_entries=2)
    for p in range(3):
        router.route(prompt(p, 4), {0: 0})
    assert len(router.table) == 2
    assert prefix_hashes(prompt(0, 4), 4, 1)[0] not in router.table


def test_routing_needs_a_replica():
    with pytest.raises(ValueError, match="no replica"):
        PrefixRouter().route([1, 2], {})

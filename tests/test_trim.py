"""`--max-kv-size` trims (docs/architecture.md §1) in the cache: sinks and offset kept, masks
sized from the keys the cache returned, sliding eviction, checkpoint/restore. Every family checks
its outputs under trims against a dense reference in tests/family_suite.py (tests/vl_suite.py)."""

import pytest
import torch

from kestrel.cache.kv import LayerKVCache
from kestrel.cache.mask import visible_mask
from kestrel.cache.sequence import SequenceCache


def test_chunk_larger_than_bound_is_refused():
    cache = SequenceCache([])
    with pytest.raises(ValueError, match="exceeds max_kv_size"):
        cache.make_room(10, max_kv_size=12, keep=4)


def test_trim_front_keeps_sinks_and_offset():
    cache = SequenceCache([])
    layer = LayerKVCache()
    cache.layers.append(layer)
    k = torch.randn(2, 10, 4)
    layer.update(k, k, torch.arange(10))
    cache.advance(10)
    cache.trim_front(3, keep=2)
    assert cache.offset == 10 and cache.live_tokens == 7
    assert layer.positions.tolist() == [0, 1, 5, 6, 7, 8, 9]
    keys, _, positions = layer.update(k[:, :2], k[:, :2], torch.tensor([10, 11]))
    mask = visible_mask(torch.tensor([10, 11]), positions)
    assert mask.shape == (2, keys.shape[1]) == (2, 9)


def test_sliding_cache_keeps_keys_the_chunk_still_needs():
    layer = LayerKVCache(window=4)
    k = torch.randn(1, 10, 2)
    layer.update(k, k, torch.arange(10))
    # the next chunk starts at 10: it sees keys at positions > 10 - 4
    _, _, positions = layer.update(k[:, :3], k[:, :3], torch.tensor([10, 11, 12]))
    assert positions.tolist() == [7, 8, 9, 10, 11, 12]


def test_checkpoint_restore_undoes_a_step():
    cache = SequenceCache([])
    layer = LayerKVCache()
    cache.layers.append(layer)
    k = torch.randn(1, 5, 2)
    layer.update(k, k, torch.arange(5))
    cache.advance(5)
    saved = cache.checkpoint()
    cache.make_room(3, max_kv_size=6, keep=1)
    layer.update(k[:, :3], k[:, :3], torch.tensor([5, 6, 7]))
    cache.advance(3)
    cache.restore(saved)
    assert cache.offset == 5 and layer.positions.tolist() == [0, 1, 2, 3, 4]

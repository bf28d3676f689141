"""`--max-kv-size` trims (DESIGN.md section 1): masks sized from the keys the cache returned, and
outputs equal to a dense reference that applies the visibility rule, for every chunk size."""

import pytest
import torch
from tests.reference import (
    assert_close,
    assert_masks_match_keys,
    chunked_logits,
    load_kestrel,
    masked_reference_logits,
    save_tiny,
    trimmed_visibility,
)
from tests.test_models_dense import COMMON, FAMILIES, PROMPT

from kestrel.cache import LayerKVCache, SequenceCache, visible_mask

MAX_KV = 12


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    config_cls, model_cls, extra = FAMILIES[request.param]
    folder = save_tiny(
        model_cls, config_cls(**COMMON, **extra), tmp_path_factory.mktemp(request.param)
    )
    return request.param, folder, model_cls, load_kestrel(folder)


def reference_masks(family: str, chunk: int, keep: int):
    n = len(PROMPT)
    full = trimmed_visibility(n, chunk, MAX_KV, keep)
    if family != "gemma3":
        return full
    window = FAMILIES["gemma3"][2]["sliding_window"]
    return {
        "full_attention": full,
        "sliding_attention": trimmed_visibility(n, chunk, MAX_KV, keep, window),
    }


@pytest.mark.parametrize("keep", [0, 4])
@pytest.mark.parametrize("chunk", [1, 3, 5, 8])
def test_trimmed_prefill_matches_dense_reference(tiny, chunk, keep):
    family, folder, model_cls, model = tiny
    with assert_masks_match_keys() as seen:
        actual = chunked_logits(model, PROMPT, chunk, max_kv_size=MAX_KV, keep=keep)
    assert seen and max(cols for _, cols in seen) <= MAX_KV
    expected = masked_reference_logits(
        folder, model_cls, PROMPT, reference_masks(family, chunk, keep)
    )
    assert_close(actual, expected)


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


def test_trimming_changes_the_output(tiny):
    # guards the reference: were masks ignored, the trimmed and untrimmed logits would agree
    family, folder, model_cls, model = tiny
    trimmed = chunked_logits(model, PROMPT, 4, max_kv_size=MAX_KV, keep=4)
    assert not torch.allclose(trimmed[-1], chunked_logits(model, PROMPT, 4)[-1], atol=1e-3)

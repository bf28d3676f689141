"""The checks every text family passes against its oracle (transformers' model on the same tiny
checkpoint). A family's test file builds a `Tiny` in a module fixture named `tiny` (from a
`Family` spec), defines `kv_chunk = kv_chunks([...])` for the `--max-kv-size` cases, and imports
the tests it runs (and `one_thread`, to run its module on one thread); family-specific checks
stay in its own file."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tests.reference import (
    assert_close,
    assert_masks_match_keys,
    chunked_logits,
    decode_logits,
    load_kestrel,
    masked_reference_logits,
    packed_logits,
    reference_logits,
    save_tiny,
    trimmed_visibility,
)

from kestrel.cache import SequenceCache
from kestrel.models.batch import ForwardBatch

MAX_KV = 12  # --max-kv-size of the dense-reference checks: well under the 30-token prompts
# every (chunk, keep) allowed: chunks are at most max_kv_size - keep
EVERY_KV_CHUNK = [(c, k) for k in (0, 2) for c in range(1, MAX_KV - k + 1)]


@dataclass
class Family:
    """What the shared checks need to know about one family (one variant of it)."""

    model_cls: type | None  # transformers' class: the oracle
    config: object  # its tiny config
    prompt: list[int]
    tweak: Callable | None = None  # tweak(model) before saving: randomize constant inits
    kestrel_class: str | None = None  # kestrel's class name, checked on the full forward
    decode_prefill: int = 9  # tokens prefilled before decoding one at a time
    batched: tuple[slice, ...] = (slice(0, 23), slice(3, 14), slice(7, 30))
    batched_vs_transformers: bool = False  # batched vs transformers (else vs kestrel alone)
    windows: dict | None = None  # layer type -> window (None: full); None: one mask for all
    unmasked: tuple[str, ...] = ()  # layer types that take no mask (recurrent layers)
    kv_tokens: int | None = None  # prompt tokens prefilled under --max-kv-size (None: all)
    attend_layers: int | None = None  # layers calling `attend` per chunk, when counted exactly
    trim_matters: bool = False  # also check the trimmed logits differ from the untrimmed ones
    restore_after: int = 10  # tokens prefilled before the step that restore undoes

    @property
    def kv_prompt(self) -> list[int]:
        return self.prompt[: self.kv_tokens]


@dataclass
class Tiny:
    """A saved tiny checkpoint, kestrel's model on it and the oracle's logits of the prompt."""

    family: Family
    folder: Path
    model: object
    expected: torch.Tensor  # the oracle's logits of family.prompt

    def reference(self, ids: list[int], masks=None) -> torch.Tensor:
        """The oracle's (len(ids), V) logits, with custom dense `masks` when given."""
        if masks is None:
            return reference_logits(self.folder, self.family.model_cls, ids)
        return masked_reference_logits(self.folder, self.family.model_cls, ids, masks)


def build_tiny(family: Family, folder: Path) -> Tiny:
    save_tiny(family.model_cls, family.config, folder, tweak=family.tweak)
    model = load_kestrel(folder)
    return Tiny(family, folder, model, reference_logits(folder, family.model_cls, family.prompt))


def prefilled(model, ids: list[int]) -> SequenceCache:
    """A fresh cache after one forward of `ids` (advanced past them)."""
    cache = SequenceCache(model.cache_specs())
    with torch.no_grad():
        model(ForwardBatch.single(cache, torch.tensor(ids)))
    cache.advance(len(ids))
    return cache


def kv_chunks(cases: list[tuple[int, int]]):
    """The fixture `kv_chunk` over a family's (chunk, keep) cases under --max-kv-size."""

    @pytest.fixture(name="kv_chunk", params=cases, ids=lambda c: f"{c[0]}-{c[1]}")
    def kv_chunk(request):
        return request.param

    return kv_chunk


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny tensors: one thread avoids OpenMP overhead that dominates on a loaded 2-core machine
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --- one sequence: full, chunked and decoded ------------------------------------------------------


def test_full_prompt_forward_matches_transformers(tiny):
    prompt = tiny.family.prompt
    if tiny.family.kestrel_class is not None:
        assert type(tiny.model).__name__ == tiny.family.kestrel_class
    assert_close(chunked_logits(tiny.model, prompt, len(prompt)), tiny.expected)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_prefill_matches_transformers(tiny, chunk):
    assert_close(chunked_logits(tiny.model, tiny.family.prompt, chunk), tiny.expected)


def test_prefill_then_decode_matches_transformers(tiny):
    prefill = tiny.family.decode_prefill
    assert_close(decode_logits(tiny.model, tiny.family.prompt, prefill=prefill), tiny.expected)


# --- several sequences in one batch ---------------------------------------------------------------


def test_batched_sequences_match_each_run_alone(tiny):
    # different lengths, prefill and decode chunks of several sequences packed in one batch
    family, model = tiny.family, tiny.model
    seqs = [family.prompt[s] for s in family.batched]
    outs = packed_logits(model, seqs, chunks=[4, 1, 7], prefill=[5, 3, 2])
    for seq, out in zip(seqs, outs, strict=True):
        if family.batched_vs_transformers:
            assert_close(out, tiny.reference(seq))
        else:
            assert_close(out, chunked_logits(model, seq, len(seq)))


def test_four_sequences_decode_batched_equal_each_alone(tiny):
    prompt, model = tiny.family.prompt, tiny.model
    seqs = [prompt[:9], prompt[3:20], prompt[5:17], prompt[:30]]
    prefill = [4, 12, 7, 20]
    batched = packed_logits(model, seqs, chunks=[1] * 4, prefill=prefill)
    for seq, p, out in zip(seqs, prefill, batched, strict=True):
        assert_close(out, decode_logits(model, seq, p))
        assert_close(out, tiny.reference(seq))


def test_prefilling_and_decoding_sequences_share_a_batch(tiny):
    prompt, model = tiny.family.prompt, tiny.model
    seqs = [prompt[:6], prompt[2:25], prompt[4:15], prompt[:30]]
    batched = packed_logits(model, seqs, chunks=[1, 3, 5, 7])
    for seq, out in zip(seqs, batched, strict=True):
        assert_close(out, chunked_logits(model, seq, len(seq)))


# --- --max-kv-size: the dense reference of DESIGN.md section 1 ------------------------------------


def dense_masks(family: Family, n: int, chunk: int, keep: int):
    """The masks the oracle runs with under MAX_KV: one (n, n) bool, or one per layer type."""
    if family.windows is None:
        return trimmed_visibility(n, chunk, MAX_KV, keep)
    masks = {t: trimmed_visibility(n, chunk, MAX_KV, keep, w) for t, w in family.windows.items()}
    return masks | {t: None for t in family.unmasked}


def test_max_kv_size_chunks_match_dense_reference(tiny, kv_chunk):
    """No shape error, every mask as wide as the keys returned, logits equal the oracle's under
    the dense visibility rule."""
    (chunk, keep), family = kv_chunk, tiny.family
    ids = family.kv_prompt
    with assert_masks_match_keys() as seen:
        actual = chunked_logits(tiny.model, ids, chunk, max_kv_size=MAX_KV, keep=keep)
    if family.attend_layers is None:
        assert seen and max(keys for _, keys in seen) <= MAX_KV
    else:  # every counted layer, every chunk
        assert len(seen) == family.attend_layers * -(-len(ids) // chunk)
    assert_close(actual, tiny.reference(ids, dense_masks(family, len(ids), chunk, keep)))
    if family.trim_matters:
        assert not torch.allclose(actual, tiny.expected, atol=1e-3)  # the trim changed attention


def assert_trim_keeps_true_positions(tiny) -> None:
    """Chunks of 3 under --max-kv-size 8: the live window holds 8 tokens while positions reach 21,
    so anything taken from the live length instead of the position would differ from the oracle,
    which runs at true positions."""
    ids, max_kv = tiny.family.kv_prompt, 8
    expected = tiny.reference(ids, trimmed_visibility(len(ids), 3, max_kv))
    actual = chunked_logits(tiny.model, ids, 3, max_kv_size=max_kv)
    assert_close(actual, expected)
    untrimmed = tiny.reference(ids)
    assert not torch.allclose(actual[max_kv:], untrimmed[max_kv:], atol=1e-3)  # trims took effect


def test_trim_leaves_recurrent_state_untouched(tiny):
    model = tiny.model
    cache = prefilled(model, tiny.family.prompt[:20])
    states = [layer.checkpoint() for layer in cache.layers]
    assert cache.make_room(5, max_kv_size=12, keep=2) > 0
    for spec, layer, before in zip(model.cache_specs(), cache.layers, states, strict=True):
        if spec.kind == "full":
            assert len(layer) == 12 - 5
        if spec.kind == "recurrent":
            assert all(a is b for a, b in zip(layer.checkpoint(), before, strict=True))


# --- the engine's undo of a failed step -----------------------------------------------------------


def test_restore_undoes_a_step(tiny):
    model, prompt, n = tiny.model, tiny.family.prompt, tiny.family.restore_after
    cache = prefilled(model, prompt[:n])
    with torch.no_grad():
        saved = cache.checkpoint()
        first = model(ForwardBatch.single(cache, torch.tensor(prompt[n : n + 3])))
        cache.restore(saved)
        again = model(ForwardBatch.single(cache, torch.tensor(prompt[n : n + 3])))
    torch.testing.assert_close(again, first, rtol=0, atol=0)

"""The checks every text family passes against its oracle (transformers' model on the same tiny
checkpoint). A family's test file (tests/test_models_<family>.py) declares the registry keys it
covers (`COVERS`), builds a `Tiny` in a module fixture named `tiny` (from a `Family` spec),
defines `kv_chunk = kv_chunks([...])` for the `--max-kv-size` cases, and imports every test of
`CHECKS` (and `one_thread`, to run its module on one thread) except those it lists in
`OPT_OUTS`, a {test name: why it does not apply} dict; tests/test_model_suites.py holds every
family file to that. Family-specific checks stay in its own file."""

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tests.reference import (
    assert_close,
    assert_differ,
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

from kestrel.cache.sequence import SequenceCache
from kestrel.config import CacheConfig
from kestrel.engine.paged_runner import PagedRunner, pool_serves
from kestrel.engine.request import Request
from kestrel.models.batch import ForwardBatch
from kestrel.models.registry import model_class
from kestrel.sampling import SamplingParams

MAX_KV = 12  # --max-kv-size of the dense-reference checks: well under the 30-token prompts
# every (chunk, keep) allowed: chunks are at most max_kv_size - keep
EVERY_KV_CHUNK = [(c, k) for k in (0, 2) for c in range(1, MAX_KV - k + 1)]


@dataclass
class Family:
    """What the shared checks need to know about one family (one variant of it)."""

    model_cls: type | None  # transformers' class: the oracle
    config: object  # its tiny config (a transformers config, or a config.json dict)
    prompt: list[int]
    tweak: Callable | None = None  # tweak(model) before saving: randomize constant inits
    kestrel_class: str | None = None  # kestrel's class name, checked on the full forward
    decode_prefill: int = 9  # tokens prefilled before decoding one at a time
    batched: tuple[slice, ...] = (slice(0, 23), slice(3, 14), slice(7, 30))
    batched_vs_transformers: bool = False  # batched vs transformers (else vs kestrel alone)
    windows: dict | None = None  # layer type -> window (None: full); None: one mask for all
    window: int | None = None  # with one mask for all (`windows` None): every layer's window
    unmasked: tuple[str, ...] = ()  # layer types that take no mask (recurrent layers)
    kv_tokens: int | None = None  # prompt tokens prefilled under --max-kv-size (None: all)
    attend_layers: int | None = None  # layers calling `attend` per chunk, when counted exactly
    restore_after: int = 10  # tokens prefilled before the step that fails and is restored

    @property
    def kv_prompt(self) -> list[int]:
        return self.prompt[: self.kv_tokens]

    @property
    def model_type(self) -> str:
        config = self.config
        return config["model_type"] if isinstance(config, dict) else config.model_type

    @property
    def sliding_windows(self) -> set[int]:
        """The sliding windows of the family's layers (empty: every layer attends to all)."""
        windows = (self.windows or {}).values() if self.window is None else [self.window]
        return {w for w in windows if w is not None}


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


def dense_masks(family: Family, visibility: Callable[[int | None], torch.Tensor]):
    """The masks the oracle runs with: `visibility(window)`, an (n, n) bool, for every layer type
    (one mask when the family has one), None for the layer types that take no mask."""
    if family.windows is None:
        return visibility(family.window)
    masks = {t: visibility(w) for t, w in family.windows.items()}
    return masks | {t: None for t in family.unmasked}


def hides_keys(masks, untrimmed) -> bool:
    """Whether `masks` hide from some layer a key that `untrimmed` (the same structure) shows."""
    if not isinstance(masks, dict):
        return not torch.equal(masks, untrimmed)
    return any(m is not None and not torch.equal(m, untrimmed[t]) for t, m in masks.items())


# --- the checkpoint -------------------------------------------------------------------------------


def test_serves_the_checkpoint_by_its_model_type(tiny, request):
    model_type = tiny.family.model_type
    assert model_type in request.module.COVERS  # the module declares what it covers
    assert isinstance(tiny.model, model_class(model_type))


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


def test_sliding_window_chunks_match_transformers(tiny):
    """A prompt longer than the window, prefilled in chunks smaller than, as long as and longer
    than the window, gives the oracle's logits (docs/architecture.md §1: keys stay until no query
    of the chunk can see them, the mask enforces the window); and the window changes the logits."""
    family, model = tiny.family, tiny.model
    windows, n = family.sliding_windows, len(family.prompt)
    assert windows, "no sliding window in the family's layers: list in OPT_OUTS"
    assert windows <= {spec.window for spec in model.cache_specs()}  # kestrel slides them
    window = min(windows)
    assert n > 2 * window + 1
    for chunk in (window - 1, window, window + 1, 2 * window + 1):
        assert_close(chunked_logits(model, family.prompt, chunk), tiny.expected)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert_differ(
        tiny.expected, tiny.reference(family.prompt, dense_masks(family, lambda w: causal))
    )


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


# --- --max-kv-size: the dense reference of docs/architecture.md §1 ----------------------------


def test_max_kv_size_chunks_match_dense_reference(tiny, kv_chunk):
    """No shape error, every mask as wide as the keys returned, logits equal the oracle's under
    the dense visibility rule, and differ from the untrimmed ones where the trim hides keys."""
    (chunk, keep), family = kv_chunk, tiny.family
    ids = family.kv_prompt
    n = len(ids)
    with assert_masks_match_keys() as seen:
        actual = chunked_logits(tiny.model, ids, chunk, max_kv_size=MAX_KV, keep=keep)
    if family.attend_layers is None:
        assert seen and max(keys for _, keys in seen) <= MAX_KV
    else:  # every counted layer, every chunk
        assert len(seen) == family.attend_layers * -(-n // chunk)
    masks = dense_masks(family, lambda window: trimmed_visibility(n, chunk, MAX_KV, keep, window))
    assert_close(actual, tiny.reference(ids, masks))
    untrimmed = dense_masks(family, lambda window: trimmed_visibility(n, n, None, 0, window))
    if hides_keys(masks, untrimmed):  # not when every layer's window is inside the bound
        assert_differ(actual, tiny.expected[:n])


def assert_trim_keeps_true_positions(tiny) -> None:
    """Chunks of 3 under --max-kv-size 8: the live window holds 8 tokens while positions reach 21,
    so anything taken from the live length instead of the position would differ from the oracle,
    which runs at true positions."""
    ids, max_kv = tiny.family.kv_prompt, 8
    expected = tiny.reference(ids, trimmed_visibility(len(ids), 3, max_kv))
    actual = chunked_logits(tiny.model, ids, 3, max_kv_size=max_kv)
    assert_close(actual, expected)
    assert_differ(actual[max_kv:], tiny.reference(ids)[max_kv:])  # the trims took effect


def test_trim_leaves_recurrent_state_untouched(tiny):
    model = tiny.model
    specs = model.cache_specs()
    assert any(spec.kind == "recurrent" for spec in specs), "no recurrent layer: list in OPT_OUTS"
    cache = prefilled(model, tiny.family.prompt[:20])
    states = [layer.checkpoint() for layer in cache.layers]
    assert cache.make_room(5, max_kv_size=12, keep=2) > 0
    for spec, layer, before in zip(specs, cache.layers, states, strict=True):
        if spec.kind == "full":
            assert len(layer) == 12 - 5
        if spec.kind == "recurrent":
            assert all(a is b for a, b in zip(layer.checkpoint(), before, strict=True))


# --- the engine's undo of a failed step -----------------------------------------------------------


class StepFailed(Exception):
    """Raised inside a forward, after every layer wrote to the cache."""


@contextmanager
def failing_head(model):
    """Within the block, the model's forward raises StepFailed at its head (`lm_head`)."""

    def fail(module, args):
        raise StepFailed

    handle = model.lm_head.register_forward_pre_hook(fail)
    try:
        yield
    finally:
        handle.remove()


def test_restore_after_a_failed_step(tiny):
    """A step that fails after every layer wrote its keys and state, undone by `restore` as the
    runner does: the retried step equals the same step on a cache that never failed (exactly),
    and without the restore the failed step's leftovers change it."""
    model, prompt, n = tiny.model, tiny.family.prompt, tiny.family.restore_after
    step = torch.tensor(prompt[n : n + 3])

    def retried(restore: bool) -> torch.Tensor:
        cache = prefilled(model, prompt[:n])
        saved = cache.checkpoint()
        with failing_head(model), pytest.raises(StepFailed):
            model(ForwardBatch.single(cache, step))
        if restore:
            cache.restore(saved)
        return model(ForwardBatch.single(cache, step))

    with torch.no_grad():
        clean = model(ForwardBatch.single(prefilled(model, prompt[:n]), step))
        restored, unrestored = retried(True), retried(False)
    torch.testing.assert_close(restored, clean, rtol=0, atol=0)
    assert_close(clean, tiny.expected[n : n + 3])
    assert_differ(unrestored, clean)


# --- automatic prefix caching (the paged runner on the CPU) ---------------------------------------


def served(model, requests, prefix_caching: bool, device="cpu", block_size=4) -> list[tuple]:
    """Serve `requests` one after another through the scheduler and the paged runner (on CUDA
    with its graphs), as a server would; each one's (output ids, first-step log-probs, cached
    tokens)."""
    from tests.test_paged_cache import run_to_end, scheduler_for

    cache = CacheConfig(block_size=block_size, num_blocks=64, prefix_caching=prefix_caching)
    graphs = device == "cuda"
    runner = PagedRunner(model, torch.device(device), 4, 12, 256, cache, cuda_graphs=graphs)
    scheduler = scheduler_for(runner, max_num_seqs=4, prefill_chunk_size=8)
    first_logprobs = {}
    for request in requests:  # the scheduler (its blocks, their cache) serves them all
        run_to_end(runner, [request], first_logprobs, scheduler)
    return [(r.output_ids, first_logprobs[r.request_id], r.num_cached_tokens) for r in requests]


def greedy(i: int, prompt, max_kv_size: int | None = None, keep: int = 0) -> Request:
    """Request `i`: 4 greedy tokens of `prompt` (ids, or a MultimodalPrompt) with log-probs."""
    params = SamplingParams(temperature=0, logprobs=5)
    images = None if isinstance(prompt, list) else prompt
    ids = prompt if images is None else prompt.token_ids
    image_keys = () if images is None else images.image_keys()
    return Request(f"r{i}", list(ids), params, 4, max_kv_size, keep, images, image_keys)


def assert_same_answers(warm: list[tuple], cold: list[tuple]) -> None:
    """Cache hits (`warm`) answered as the cold server did: tokens, and first-step log-probs
    within 1e-5 (fp32)."""
    for (tokens, logprobs, _), (cold_tokens, cold_logprobs, cached) in zip(warm, cold, strict=True):
        assert cached == 0 and tokens == cold_tokens
        assert logprobs.keys() == cold_logprobs.keys()
        for token, logprob in cold_logprobs.items():
            assert abs(logprobs[token] - logprob) < 1e-5, (token, logprobs[token], logprob)


def test_a_prefix_hit_gives_the_tokens_of_a_cold_prompt(tiny):
    """A prompt served after others left blocks of its prefix cached gives the greedy tokens and
    first-step log-probs it gives on a cold server: after a sequence trimmed past its first 16
    tokens (only the blocks before its first trim are cached), then after an untrimmed one (for
    hybrids: from the snapshot of its recurrent state at the end of its last full block)."""
    model, prompt = tiny.model, tiny.family.prompt
    if not pool_serves(model):
        pytest.fail("the paged pool does not hold this family's caches: list in OPT_OUTS")
    other = [(t * 7 + 3) % 50 for t in range(6)]
    prompts = [prompt, prompt[:28] + other]
    trimmed = greedy(0, prompt[:20] + other, max_kv_size=16, keep=2)  # 26 > 16: trimmed at 16
    warm = served(model, [trimmed] + [greedy(i, p) for i, p in enumerate(prompts, 1)], True)
    cold = served(model, [greedy(i, p) for i, p in enumerate(prompts, 1)], False)
    # LongRoPE's keys depend on the chunks past its original context: no hit for longer prompts
    limit = model.chunk_invariant_tokens() or len(prompts[1])
    # recurrent state is kept only at a prompt's last full block, which a prompt trimmed before
    # its end does not reach: a hybrid's first hit is at the 28 tokens the second prompt ended with
    after_trim = 0 if any(model.state_layout()) else 16
    assert [cached for *_, cached in warm] == [0, after_trim, 28 if len(prompts[1]) <= limit else 0]
    assert_same_answers(warm[1:], cold)


# --- an FP8 KV cache (--kv-cache-dtype fp8) ---------------------------------------------------

# the most a top-5 log-prob may move with keys and values stored in e4m3 (per-head scales from
# the first chunk) against the model's dtype, on the tiny random checkpoints: 0.33 seen on
# gemma4's on the CPU and 0.43 on CUDA (q/k-normed scores at scale 1, the sharpest softmax),
# 0.002-0.16 on the others
FP8_LOGPROB_BOUND = 0.5


def steps_served(model, prompt, kv_cache_dtype: str, device="cpu", steps=8) -> list[tuple]:
    """(token, top-5 log-probs) of each of `steps` greedy steps after `prompt`, prefilled in
    chunks of 8 through the scheduler and the paged runner with a pool of `kv_cache_dtype`."""
    from kestrel.config import SchedulerConfig
    from kestrel.engine.runner import run_step
    from kestrel.engine.scheduler import Scheduler

    block_size = 16 if device == "cuda" else 4  # the Triton kernel's smallest block
    cache = CacheConfig(block_size=block_size, num_blocks=64, kv_cache_dtype=kv_cache_dtype)
    graphs = device == "cuda"
    runner = PagedRunner(model, torch.device(device), 4, 12, 256, cache, cuda_graphs=graphs)
    config = SchedulerConfig(max_num_seqs=4, prefill_chunk_size=8)
    scheduler = Scheduler(config, runner.kv_memory(None))
    request = Request("r", list(prompt), SamplingParams(temperature=0, logprobs=5), steps)
    scheduler.add(request)
    answers = []
    while scheduler.has_work():
        for result in run_step(scheduler, runner):
            assert result.error is None, result.error
            if result.token is not None:
                answers.append((result.token, result.logprobs))
                request.output_ids.append(result.token)
                if len(request.output_ids) >= steps:
                    request.finish("length")
        for done in scheduler.remove_finished():
            runner.release(done.request_id)
    return answers


def fp8_logprob_gap(exact: list[tuple], fp8: list[tuple], bound: float) -> float:
    """The largest top-5 log-prob difference over the steps both runs share, asserting that the
    greedy tokens agree up to a step where the model-dtype run's top two lie within 2 x `bound`
    (a margin FP8 may flip; the runs part there)."""
    gap = 0.0
    for (token, logprobs), (fp8_token, fp8_logprobs) in zip(exact, fp8, strict=True):
        shared = logprobs.keys() & fp8_logprobs.keys()
        gap = max([gap, *(abs(logprobs[t] - fp8_logprobs[t]) for t in shared)])
        if token != fp8_token:
            top, second = sorted(logprobs.values(), reverse=True)[:2]
            assert top - second < 2 * bound, (token, fp8_token, top - second)
            break
    return gap


def test_fp8_kv_cache_stays_near_the_model_dtype_cache(tiny):
    """With --kv-cache-dtype fp8 the paged runner gives the greedy tokens of a model-dtype pool
    (while its margins allow) and top-5 log-probs within FP8_LOGPROB_BOUND of them."""
    model, prompt = tiny.model, tiny.family.prompt
    if not pool_serves(model):
        pytest.fail("the paged pool does not hold this family's caches: list in OPT_OUTS")
    exact = steps_served(model, prompt, "auto")
    fp8 = steps_served(model, prompt, "fp8")
    assert fp8_logprob_gap(exact, fp8, FP8_LOGPROB_BOUND) < FP8_LOGPROB_BOUND


# every shared check; tests/test_model_suites.py holds each family file to running them all
CHECKS = (
    test_serves_the_checkpoint_by_its_model_type,
    test_full_prompt_forward_matches_transformers,
    test_chunked_prefill_matches_transformers,
    test_prefill_then_decode_matches_transformers,
    test_sliding_window_chunks_match_transformers,
    test_batched_sequences_match_each_run_alone,
    test_four_sequences_decode_batched_equal_each_alone,
    test_prefilling_and_decoding_sequences_share_a_batch,
    test_max_kv_size_chunks_match_dense_reference,
    test_trim_leaves_recurrent_state_untouched,
    test_restore_after_a_failed_step,
    test_a_prefix_hit_gives_the_tokens_of_a_cold_prompt,
    test_fp8_kv_cache_stays_near_the_model_dtype_cache,
)

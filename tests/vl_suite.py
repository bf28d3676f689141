"""The checks every vision-language family passes against transformers. A family's test file
declares the registry keys it covers (`COVERS`), builds a `Tiny` in a module fixture named `tiny`
and imports every test of `CHECKS` (and `one_thread`, to run its module on one thread) except those
it lists in `OPT_OUTS`, a {test name: why it does not apply} dict; tests/test_model_suites.py holds
every family file to that."""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tests.family_suite import StepFailed, failing_head, one_thread  # noqa: F401  (re-exported)
from tests.reference import (
    assert_close,
    assert_differ,
    assert_masks_match_keys,
    chunked_logits,
    decode_logits,
    load_kestrel,
    trimmed_visibility,
)
from tests.vl_reference import (
    chunk_boundaries_inside_images,
    hf_inputs,
    hf_logits,
    hf_masked_logits,
    image_prompt,
    kestrel_image_logits,
    save_tiny_vl,
    tiny_tokenizer,
)

from kestrel import cli
from kestrel.cache.sequence import SequenceCache
from kestrel.models.batch import ForwardBatch, ImageRows, SeqChunk
from kestrel.models.qwen_vl_processor import MultimodalPrompt
from kestrel.models.registry import model_class
from kestrel.sampling import SamplingParams

PATCH, MERGE = 4, 2
TEXT = "hello there, a text-only prompt of some length!"
CONTINUATION = " ok, go"


@dataclass
class Tiny:
    """A saved tiny checkpoint, kestrel's model and transformers' on it, and the test prompts."""

    folder: Path
    model: object
    hf: object
    image_token_id: int
    windows: dict  # layer type -> sliding window (None: full attention)
    text_ids: list[int]
    prompt: MultimodalPrompt
    continuation: list[int]
    text_ref: torch.Tensor  # transformers' logits of text_ids
    image_ref: torch.Tensor  # ... of the image prompt followed by the continuation


def build_tiny(model_cls, config, folder: Path) -> Tiny:
    tokenizer = tiny_tokenizer()
    save_tiny_vl(model_cls, config, folder, tokenizer, PATCH, MERGE)
    hf = model_cls.from_pretrained(folder, torch_dtype=torch.float32).eval()
    text_ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    continuation = tokenizer(CONTINUATION, add_special_tokens=False)["input_ids"]
    prompt = image_prompt(folder, PATCH, MERGE)
    text = config.text_config
    windows = {"full_attention": None}
    if "sliding_attention" in (getattr(text, "layer_types", None) or []):
        windows["sliding_attention"] = text.sliding_window
    return Tiny(
        folder,
        load_kestrel(folder),
        hf,
        config.image_token_id,
        windows,
        text_ids,
        prompt,
        continuation,
        hf_logits(hf, input_ids=torch.tensor([text_ids])),
        hf_logits(hf, **hf_inputs(prompt, config.image_token_id, continuation)),
    )


def test_loads_by_model_type(tiny, request):
    model_type = tiny.hf.config.model_type
    assert model_type in request.module.COVERS  # the module declares what it covers
    assert isinstance(tiny.model, model_class(model_type))
    assert len(tiny.model.cache_specs()) == tiny.hf.config.text_config.num_hidden_layers


def test_cli_arch_and_inspect_describe_the_family(tiny, capsys):
    model_type = tiny.hf.config.model_type
    assert cli.main(["arch"]) == 0
    assert model_type in capsys.readouterr().out.split()
    assert cli.main(["inspect", "-m", str(tiny.folder)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == model_type
    assert info["parameters"] == sum(p.numel() for p in tiny.model.parameters())
    assert len(info["layers"]) == tiny.hf.config.text_config.num_hidden_layers


# --- text-only prompts: the plain RoPE path -------------------------------------------------------


def test_text_full_forward_matches_transformers(tiny):
    assert_close(chunked_logits(tiny.model, tiny.text_ids, len(tiny.text_ids)), tiny.text_ref)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_text_chunked_prefill_matches_transformers(tiny, chunk):
    assert_close(chunked_logits(tiny.model, tiny.text_ids, chunk), tiny.text_ref)


def test_text_prefill_then_decode_matches_transformers(tiny):
    assert_close(decode_logits(tiny.model, tiny.text_ids, prefill=9), tiny.text_ref)


# --- prompts with images --------------------------------------------------------------------------


def test_image_prompt_full_forward_matches_transformers(tiny):
    n = len(tiny.prompt.token_ids)
    assert_close(kestrel_image_logits(tiny.model, tiny.prompt, n), tiny.image_ref[:n])


@pytest.mark.parametrize("chunk", [1, 5, 7])
def test_image_chunks_split_inside_images_match_transformers(tiny, chunk):
    assert chunk_boundaries_inside_images(tiny.prompt, chunk) > 0
    n = len(tiny.prompt.token_ids)
    assert_close(kestrel_image_logits(tiny.model, tiny.prompt, chunk), tiny.image_ref[:n])


@pytest.mark.parametrize("chunk", [5, 64])
def test_decode_after_image_prompt_matches_transformers(tiny, chunk):
    assert tiny.prompt.rope_delta != 0  # the images shift the text after them
    logits = kestrel_image_logits(tiny.model, tiny.prompt, chunk, tiny.continuation)
    assert_close(logits, tiny.image_ref)


def test_sliding_window_image_chunks_match_transformers(tiny):
    """The image prompt, longer than the window, prefilled in chunks shorter than, as long as and
    longer than the window (boundaries inside the images) gives transformers' logits; and the
    window changes them."""
    windows = {w for w in tiny.windows.values() if w is not None}
    assert windows, "no sliding window in the family's layers: list in OPT_OUTS"
    window, n = min(windows), len(tiny.prompt.token_ids)
    assert n > 2 * window + 1
    for chunk in (window - 1, window, window + 1, 2 * window + 1):
        assert_close(kestrel_image_logits(tiny.model, tiny.prompt, chunk), tiny.image_ref[:n])
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    inputs = hf_inputs(tiny.prompt, tiny.image_token_id)
    unwindowed = hf_masked_logits(tiny.hf, inputs, dict.fromkeys(tiny.windows, causal))
    assert_differ(tiny.image_ref[:n], unwindowed)


@pytest.mark.parametrize("chunk,keep", [(1, 0), (5, 2), (14, 2)])
def test_max_kv_size_image_prefill_matches_dense_reference(tiny, chunk, keep):
    """Under --max-kv-size 16 (prompt of ~50 tokens): no shape error, every mask as wide as the
    keys returned, logits equal transformers' under the dense visibility rule
    of docs/architecture.md §1."""
    n, max_kv = len(tiny.prompt.token_ids), 16
    masks = {t: trimmed_visibility(n, chunk, max_kv, keep, w) for t, w in tiny.windows.items()}
    inputs = hf_inputs(tiny.prompt, tiny.image_token_id)
    expected = hf_masked_logits(tiny.hf, inputs, masks)
    assert_differ(expected, tiny.image_ref[:n])  # the trim matters
    with assert_masks_match_keys() as seen:
        logits = kestrel_image_logits(tiny.model, tiny.prompt, chunk, max_kv_size=max_kv, keep=keep)
    assert seen and max(keys for _, keys in seen) <= max_kv
    assert_close(logits, expected)


def test_restore_after_a_failed_image_step(tiny):
    """A step over image tokens that fails after every layer wrote its keys, undone by `restore`
    as the runner does: the retried step equals the same step on a cache that never failed
    (exactly), and without the restore the failed step's leftovers change it."""
    model, prompt = tiny.model, tiny.prompt
    features = model.encode_images(prompt.pixel_values, prompt.image_grid_thw)
    start = prompt.image_spans[0][0] + 2  # the failed step starts inside the first image

    def chunk(cache: SequenceCache, first: int, m: int) -> ForwardBatch:
        rope, images = prompt.chunk_inputs(features, first, m)
        ids = torch.tensor(prompt.token_ids[first : first + m])
        return ForwardBatch.single(cache, ids, True, rope, images)

    def prefilled() -> SequenceCache:
        cache = SequenceCache(model.cache_specs())
        cache.rope_delta = prompt.rope_delta
        model(chunk(cache, 0, start))
        cache.advance(start)
        return cache

    def retried(restore: bool) -> torch.Tensor:
        cache = prefilled()
        saved = cache.checkpoint()
        with failing_head(model), pytest.raises(StepFailed):
            model(chunk(cache, start, 6))
        if restore:
            cache.restore(saved)
        return model(chunk(cache, start, 6))

    with torch.no_grad():
        clean = model(chunk(prefilled(), start, 6))
        restored, unrestored = retried(True), retried(False)
    torch.testing.assert_close(restored, clean, rtol=0, atol=0)
    assert_close(clean, tiny.image_ref[start : start + 6])
    assert_differ(unrestored, clean)


@pytest.mark.parametrize("inputs_on", ["chunks", "batch"])
def test_image_and_text_sequences_batched_match_alone(tiny, inputs_on):
    """One batch holds an image prompt's chunk and another sequence's text tokens (prefill, then
    decode): each sequence's logits equal its own run, whether the multimodal inputs ride on the
    SeqChunks or on the ForwardBatch (as runners that pack without chunks give them)."""
    prompt, chunk = tiny.prompt, 6
    features = tiny.model.encode_images(prompt.pixel_values, prompt.image_grid_thw)
    image_seq = prompt.token_ids + tiny.continuation
    caches = [SequenceCache(tiny.model.cache_specs()) for _ in range(2)]
    caches[0].rope_delta = prompt.rope_delta
    seqs, done, outs = [image_seq, tiny.text_ids], [0, 0], [[], []]
    with torch.no_grad():
        while done[0] < len(seqs[0]) or done[1] < len(seqs[1]):
            sizes = [_next_size(prompt, done[0], chunk), 1 if done[1] else 9]
            batch = _pack(prompt, features, seqs, done, sizes, caches)
            logits = tiny.model(_on_batch(batch) if inputs_on == "batch" else batch)
            for c in batch.chunks:
                seq = caches.index(c.cache)
                outs[seq].append(logits[c.rows])
                c.cache.advance(c.length)
                done[seq] += c.length
    assert_close(torch.cat(outs[0]), tiny.image_ref)
    assert_close(torch.cat(outs[1]), tiny.text_ref)


@pytest.mark.parametrize("max_kv_size", [None, 40])
def test_paged_runner_matches_the_reference_with_images(tiny, max_kv_size):
    """The paged runner (here on the CPU, with its PyTorch attention) packs image prompts' M-RoPE
    ids and image rows for the whole batch: two image prompts and a text one, in chunks that cut
    the images, under a KV bound or not, give the reference runner's logits at every step."""
    from tests.test_paged_cache import chunked_schedule, run_both

    prompt = tiny.prompt
    seqs = [prompt.token_ids, tiny.text_ids, prompt.token_ids]
    assert chunk_boundaries_inside_images(prompt, 7)
    schedule = chunked_schedule([len(s) for s in seqs], chunk=7, decode=4)
    paged = run_both(tiny.model, seqs, schedule, max_kv_size, 2, images=[prompt, None, prompt])
    assert len(paged.image_features) == 2  # each image prompt's features, encoded once


def test_a_prefix_hit_needs_the_same_images(tiny):
    """The same image prompt served twice hits all of its full blocks but the last token's; the
    same text with another image hits only the blocks before that image starts; both answer as
    a cold server does."""
    from dataclasses import replace

    from tests.family_suite import assert_same_answers, greedy, served

    prompt = tiny.prompt
    other = replace(prompt, pixel_values=prompt.pixel_values.flip(0))  # another first image
    warm = served(tiny.model, [greedy(0, prompt), greedy(1, prompt), greedy(2, other)], True)
    cold = served(tiny.model, [greedy(1, prompt), greedy(2, other)], False)
    n, first_image = len(prompt.token_ids), prompt.image_spans[0][0]
    assert [cached for *_, cached in warm] == [0, (n - 1) // 4 * 4, first_image // 4 * 4]
    assert_same_answers(warm[1:], cold)


def test_images_of_one_step_are_encoded_in_one_vision_forward(tiny):
    """Two requests' images prefilled in the same step go through the vision tower together,
    once, and each request gets the rows (and deepstack rows) it gets encoded alone."""
    from dataclasses import replace

    from kestrel.engine.reference_runner import ModelRunner
    from kestrel.engine.request import Request
    from kestrel.engine.scheduler import ScheduledChunk

    prompts = [tiny.prompt, replace(tiny.prompt, pixel_values=tiny.prompt.pixel_values.flip(0))]
    requests = [
        Request(f"v{i}", p.token_ids, SamplingParams(temperature=0), 4, multimodal=p)
        for i, p in enumerate(prompts)
    ]
    runner, calls = ModelRunner(tiny.model, torch.device("cpu")), []
    encode = tiny.model.encode_images
    tiny.model.encode_images = lambda *args: calls.append(1) or encode(*args)
    try:
        runner._encode_images([ScheduledChunk(r, 5) for r in requests])
    finally:
        del tiny.model.encode_images  # the class's method again
    assert len(calls) == 1
    for request, prompt in zip(requests, prompts, strict=True):
        alone = encode(prompt.pixel_values, prompt.image_grid_thw)
        batched = runner.image_features[request.request_id]
        torch.testing.assert_close(batched.embeds, alone.embeds, rtol=1e-5, atol=1e-5)
        assert len(batched.deepstack) == len(alone.deepstack)
        for got, want in zip(batched.deepstack, alone.deepstack, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# every shared check; tests/test_model_suites.py holds each family file to running them all
CHECKS = (
    test_loads_by_model_type,
    test_cli_arch_and_inspect_describe_the_family,
    test_text_full_forward_matches_transformers,
    test_text_chunked_prefill_matches_transformers,
    test_text_prefill_then_decode_matches_transformers,
    test_image_prompt_full_forward_matches_transformers,
    test_image_chunks_split_inside_images_match_transformers,
    test_decode_after_image_prompt_matches_transformers,
    test_sliding_window_image_chunks_match_transformers,
    test_max_kv_size_image_prefill_matches_dense_reference,
    test_restore_after_a_failed_image_step,
    test_image_and_text_sequences_batched_match_alone,
    test_paged_runner_matches_the_reference_with_images,
    test_a_prefix_hit_needs_the_same_images,
    test_images_of_one_step_are_encoded_in_one_vision_forward,
)


def _next_size(prompt: MultimodalPrompt, done: int, chunk: int) -> int:
    # prefill in chunks up to the end of the prompt, then decode one token at a time
    return min(chunk, len(prompt.token_ids) - done) if done < len(prompt.token_ids) else 1


def _pack(prompt, features, seqs, done, sizes, caches) -> ForwardBatch:
    ids, positions, chunks, row = [], [], [], 0
    for seq in (1, 0):  # the text sequence first, so the image rows are offset in the batch
        m = min(sizes[seq], len(seqs[seq]) - done[seq])
        if m <= 0:
            continue
        rope = images = None
        if seq == 0 and done[0] < len(prompt.token_ids):
            rope, images = prompt.chunk_inputs(features, done[0], m)
        ids += seqs[seq][done[seq] : done[seq] + m]
        positions.append(torch.arange(m) + caches[seq].offset)
        chunks.append(SeqChunk(caches[seq], row, m, rope, images))
        row += m
    return ForwardBatch(torch.tensor(ids), torch.cat(positions), chunks, torch.arange(row))


def _on_batch(batch: ForwardBatch) -> ForwardBatch:
    """The same batch with its multimodal inputs moved from the chunks to the batch: (3, T) RoPE
    ids of every row (text rows at position + rope_delta) and image rows of the packed batch."""
    rope = batch.positions.expand(3, -1).clone()
    chunks, images = [], None
    for c in batch.chunks:
        rope[:, c.rows] += c.cache.rope_delta
        if c.rope_positions is not None:
            rope[:, c.rows] = c.rope_positions
        if c.images is not None:
            rows = c.start + c.images.rows
            images = ImageRows(rows, c.images.embeds, c.images.deepstack)
        chunks.append(SeqChunk(c.cache, c.start, c.length))
    return ForwardBatch(batch.input_ids, batch.positions, chunks, batch.logits_rows, rope, images)

"""The embedded real checkpoints (docs/architecture.md §8) against transformers on the same GGUF
file."""

import functools

import pytest
import torch
from tests.family_suite import fp8_logprob_gap

from kestrel import LLM, SamplingParams
from kestrel.cache.sequence import SequenceCache
from kestrel.engine import engine
from kestrel.engine.paged_runner import PagedRunner
from kestrel.engine.reference_runner import ModelRunner
from kestrel.models.batch import ForwardBatch
from kestrel.weights.loader import resolve

pytestmark = pytest.mark.slow
GREEDY = dict(temperature=0, ignore_eos=True)


def transformers_model(alias: str):
    from transformers import AutoModelForCausalLM

    path = resolve(alias).path
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def oracle():
    """alias -> transformers' model of the embedded file, loaded once for this module (gemma3's
    GGUF takes transformers 30 s to load, SmolLM2's 12)."""
    load = functools.cache(transformers_model)
    yield load
    load.cache_clear()


def transformers_greedy(model, ids: list[int], steps: int) -> list[int]:
    """Greedy continuation by full forwards: the oracle for kestrel's cached decode."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-steps:]


@pytest.fixture(scope="module")
def smollm2():
    return LLM("smollm2", progress=False)


@pytest.fixture(scope="module")
def gemma3():
    return LLM("gemma3-270m", progress=False)


def test_smollm2_answers_capital_of_france(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=32)).pop().outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("prompt", ["The three primary colors are", "def fibonacci(n):"])
def test_smollm2_greedy_tokens_match_transformers(smollm2, oracle, prompt):
    ids = smollm2.tokenizer(prompt)["input_ids"]
    ours = smollm2.generate(ids, SamplingParams(max_tokens=32, **GREEDY))[0].outputs[0].token_ids
    assert ours == transformers_greedy(oracle("smollm2"), ids, 32)


def test_gemma3_continues_roman_empire_like_transformers(gemma3, oracle):
    ids = gemma3.tokenizer("The history of the Roman Empire")["input_ids"]
    out = gemma3.generate(ids, SamplingParams(max_tokens=16, **GREEDY))[0].outputs[0]
    assert out.text.startswith(" is a fascinating one. It was a time of great expansion and change")
    assert out.token_ids == transformers_greedy(oracle("gemma3-270m"), ids, 16)


def test_gemma3_long_prompt_chunked_prefill_matches_transformers(gemma3, oracle):
    text = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(90))
    ids = gemma3.tokenizer(text)["input_ids"]
    assert len(ids) > 512  # longer than the 512-token sliding window
    with torch.no_grad():
        expected = oracle("gemma3-270m")(torch.tensor([ids])).logits[0, -1]
    for chunk in (128, 512):
        cache = SequenceCache(gemma3.model.cache_specs())
        with torch.no_grad():
            for start in range(0, len(ids), chunk):
                piece = torch.tensor(ids[start : start + chunk])
                logits = gemma3.model(ForwardBatch.single(cache, piece, all_logits=False))
                cache.advance(len(piece))
        torch.testing.assert_close(logits[-1], expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
def test_gguf_tokenizer_reads_back_from_the_cache_as_converted(alias, tmp_path, monkeypatch):
    """The GGUF vocabulary is converted once and cached: the cached tokenizer must encode as the
    fresh conversion does, with the BOS the file asks for. (transformers 5.17 broke both for
    gemma3: no BOS fresh, character pieces cached; hence the floor in pyproject.toml.)"""
    from kestrel.weights import gguf as gguf_weights
    from kestrel.weights.loader import load_tokenizer

    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path))
    source = resolve(alias)
    fresh, cached = load_tokenizer(source), load_tokenizer(source)
    assert any(tmp_path.rglob("tokenizer_config.json"))  # the second one was the cached copy
    text = "The history of the Roman Empire, in 3 parts: émigrés & naïve café-goers."
    ids = fresh(text)["input_ids"]
    assert cached(text)["input_ids"] == ids
    metadata = gguf_weights.GGUFMetadata(gguf_weights.open_gguf(source.path))
    if metadata.get("tokenizer.ggml.add_bos_token"):
        assert ids[0] == metadata["tokenizer.ggml.bos_token_id"]
    assert fresh.decode(ids, skip_special_tokens=True) == text


def greedy(model, ids: list[int], steps: int) -> list[int]:
    """kestrel's cached greedy decode on one sequence, straight on the model."""
    cache = SequenceCache(model.cache_specs())
    out, piece = [], torch.tensor(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(ForwardBatch.single(cache, piece, all_logits=False))
            cache.advance(len(piece))
            out.append(int(logits[-1].argmax()))
            piece = torch.tensor(out[-1:])
    return out


@pytest.mark.parametrize(
    "alias, prompt",
    [
        ("smollm2", "The three primary colors are"),
        ("gemma3-270m", "The history of the Roman Empire"),
    ],
)
def test_packed_weights_decode_as_dequantized_at_load(alias, prompt):
    from kestrel.models.layers.quant import QuantLinear
    from kestrel.weights.loader import load_model, load_tokenizer

    source = resolve(alias)
    ids = load_tokenizer(source)(prompt)["input_ids"]
    cpu = torch.device("cpu")
    packed = load_model(source, torch.float32, cpu, progress=False, packed=True)
    assert any(isinstance(m, QuantLinear) for m in packed.modules())
    expected = greedy(load_model(source, torch.float32, cpu, progress=False, packed=False), ids, 32)
    assert greedy(packed, ids, 32) == expected


# the fast CPU runner (paged pool, native kernels, fused projections) against the reference
# runner (caches that grow per sequence, PyTorch attention): chunked prefill, a --max-kv-size
# trim with sinks during decode, and (gemma3) sliding windows of 512 across chunks of 128
RUNNER_CASES = [
    ("smollm2", 150, dict(prefill_chunk_size=32, max_kv_size=96, keep=4)),
    ("gemma3-270m", 150, dict(prefill_chunk_size=32, max_kv_size=96, keep=4)),
    ("gemma3-270m", 700, dict(prefill_chunk_size=128)),
]


@pytest.mark.parametrize("alias, prompt_tokens, settings", RUNNER_CASES)
def test_fast_cpu_runner_decodes_as_the_reference_runner(
    alias, prompt_tokens, settings, monkeypatch
):
    fast = LLM(alias, progress=False, device="cpu", **settings)
    assert isinstance(fast.engine.runner, PagedRunner)
    text = "Rome was founded, the story goes, by twins raised by a wolf. " * 80
    ids = fast.tokenizer(text)["input_ids"][:prompt_tokens]
    params = SamplingParams(max_tokens=64, **GREEDY)
    fast_tokens = fast.generate(ids, params)[0].outputs[0].token_ids
    monkeypatch.setattr(engine, "make_runner", lambda model, device, *_: ModelRunner(model, device))
    reference = LLM(alias, progress=False, device="cpu", **settings)
    assert type(reference.engine.runner) is ModelRunner
    assert reference.generate(ids, params)[0].outputs[0].token_ids == fast_tokens


# the most a top-5 log-prob moved over 64 steps: 0.46-0.52 on SmolLM2-135M (the CPU's kernels and
# the libraries' versions move it), 0.40 on gemma3-270m (small models, whose keys e4m3's 3
# mantissa bits round by up to 1/16)
REAL_FP8_BOUND = 0.6
FP8_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a screw press. Within fifty years"
)


@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
def test_fp8_kv_cache_follows_the_model_dtype_cache_on_real_models(alias, request):
    """--kv-cache-dtype fp8 on the embedded files: 32 greedy steps give the tokens of the
    model-dtype pool while its margins allow, with top-5 log-probs within REAL_FP8_BOUND."""
    exact_llm = request.getfixturevalue("smollm2" if alias == "smollm2" else "gemma3")
    fp8_llm = LLM(alias, progress=False, kv_cache_dtype="fp8")
    params = SamplingParams(max_tokens=32, logprobs=5, **GREEDY)
    runs = [llm.generate(FP8_PROMPT, params)[0].outputs[0] for llm in (exact_llm, fp8_llm)]
    exact, fp8 = ([*zip(out.token_ids, out.logprobs, strict=True)] for out in runs)
    assert fp8_logprob_gap(exact, fp8, REAL_FP8_BOUND) < REAL_FP8_BOUND

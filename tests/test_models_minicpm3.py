"""minicpm3 equals transformers' MiniCPM3ForCausalLM on a tiny random checkpoint.

Exercises MLA with low-rank queries and attention biases, LongRoPE (short factors and attention
factor; long factors past `original_max_position_embeddings`), the embedding scale, depth-scaled
residuals and the logit scaling; under `--max-kv-size`, RoPE must keep the monotonic position.
"""

import pytest
import torch
import transformers
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
from kestrel.models.mla import LatentKVCache

MODEL = transformers.MiniCPM3ForCausalLM
ORIGINAL_MAX = 32
CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=12,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    attention_bias=True,
    max_position_embeddings=128,
    initializer_range=0.1,
    scale_emb=3.0,
    scale_depth=1.4,
    dim_model_base=16,
    rope_parameters=dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0, 1.5],
        long_factor=[2.0, 4.0],
        original_max_position_embeddings=ORIGINAL_MAX,
    ),
)
PROMPT = [(i * 37 + 11) % 128 for i in range(30)]  # within the short-factor range
MAX_KV, PROMPT_TRIM = 12, PROMPT[:22]



@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny tensors: one thread avoids OpenMP overhead that dominates on a loaded 2-core machine
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(
        MODEL, transformers.MiniCPM3Config(**CONFIG), tmp_path_factory.mktemp("minicpm3")
    )


@pytest.fixture(scope="module")
def tiny(folder):
    return load_kestrel(folder), reference_logits(folder, MODEL, PROMPT)


def test_full_prompt_forward_matches_transformers(tiny):
    model, expected = tiny
    assert_close(chunked_logits(model, PROMPT, len(PROMPT)), expected)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_prefill_matches_transformers(tiny, chunk):
    model, expected = tiny
    assert_close(chunked_logits(model, PROMPT, chunk), expected)


def test_prefill_then_decode_matches_transformers(tiny):
    model, expected = tiny
    assert_close(decode_logits(model, PROMPT, prefill=9), expected)


def test_long_prompt_uses_long_factors_like_transformers(folder, tiny):
    # one forward reaching past original_max: transformers switches every position to long factors
    ids = PROMPT + PROMPT[:10]
    assert len(ids) > ORIGINAL_MAX
    assert_close(chunked_logits(tiny[0], ids, len(ids)), reference_logits(folder, MODEL, ids))


def test_batched_sequences_match_each_alone(folder, tiny):
    seqs = [PROMPT[:17], PROMPT[3:12], PROMPT[:25]]
    outs = packed_logits(tiny[0], seqs, chunks=[4, 1, 7], prefill=[5, 3, 2])
    for ids, out in zip(seqs, outs, strict=True):
        assert_close(out, reference_logits(folder, MODEL, ids))


def test_cache_holds_latent_and_rope_key(tiny):
    model = tiny[0]
    cache = SequenceCache(model.cache_specs())
    with torch.no_grad():
        model(ForwardBatch.single(cache, torch.tensor(PROMPT[:7])))
    for layer in cache.layers:
        assert isinstance(layer, LatentKVCache)
        assert layer.keys.shape == (1, 7, 8) and layer.values.shape == (1, 7, 4)
    assert model.kv_bytes_per_token(torch.float32) == (8 + 4) * 3 * 4


@pytest.mark.parametrize(
    "chunk,keep", [(c, k) for k in (0, 2) for c in range(1, MAX_KV - k + 1)]
)  # every chunk size allowed: chunks are at most max_kv_size - keep
def test_max_kv_size_chunks_match_dense_reference(folder, tiny, chunk, keep):
    visible = trimmed_visibility(len(PROMPT_TRIM), chunk, MAX_KV, keep)
    expected = masked_reference_logits(folder, MODEL, PROMPT_TRIM, visible)
    with assert_masks_match_keys() as seen:
        actual = chunked_logits(tiny[0], PROMPT_TRIM, chunk, max_kv_size=MAX_KV, keep=keep)
    assert seen and max(keys for _, keys in seen) <= MAX_KV
    assert_close(actual, expected)


def test_rope_uses_monotonic_offset_after_trim(folder, tiny):
    # After the front trim the live window holds 8 tokens while positions reach 21; RoPE at the
    # live length would rotate every later token wrongly. The reference runs at true positions.
    ids, max_kv = PROMPT_TRIM, 8
    expected = masked_reference_logits(folder, MODEL, ids, trimmed_visibility(len(ids), 3, max_kv))
    actual = chunked_logits(tiny[0], ids, 3, max_kv_size=max_kv)
    assert_close(actual, expected)
    untrimmed = reference_logits(folder, MODEL, ids)
    assert not torch.allclose(actual[max_kv:], untrimmed[max_kv:], atol=1e-3)  # trims took effect

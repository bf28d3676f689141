"""mistral4 equals transformers' Mistral4ForCausalLM on tiny random checkpoints.

Two variants cover MLA with low-rank queries and interleaved RoPE pairs, and with a plain q_proj
and rotate-half RoPE; both have YaRN (attention factor and mscale), Llama-4 query scaling that
changes every 8 positions, a dense first layer, then softmax-routed group-limited MoE layers
with shared experts. Under `--max-kv-size` the query scaling and RoPE keep absolute positions.
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

MODEL = transformers.Mistral4ForCausalLM
COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=1.5,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    max_position_embeddings=32,
    initializer_range=0.1,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=8,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=0.7,
        llama_4_scaling_beta=0.3,
    ),
)
VARIANTS = {
    "q_lora_interleaved": dict(q_lora_rank=12, rope_interleave=True),
    "q_proj_rotate_half": dict(q_lora_rank=None, rope_interleave=False),
}
PROMPT = [(i * 37 + 11) % 128 for i in range(30)]
MAX_KV, PROMPT_TRIM = 12, PROMPT[:22]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny tensors: one thread avoids OpenMP overhead that dominates on a loaded 2-core machine
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def folder(request, tmp_path_factory):
    config = transformers.Mistral4Config(**COMMON, **VARIANTS[request.param])
    return save_tiny(MODEL, config, tmp_path_factory.mktemp(request.param))


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
    assert model.kv_bytes_per_token(torch.bfloat16) == (8 + 4) * 3 * 2


@pytest.mark.parametrize(
    "chunk,keep", [(c, k) for k in (0, 2) for c in range(1, MAX_KV - k + 1)]
)  # every chunk size allowed: chunks are at most max_kv_size - keep
def test_max_kv_size_chunks_match_dense_reference(folder, tiny, chunk, keep):
    # the reference runs at true positions, so RoPE or the Llama-4 query scaling taken from the
    # live length after a trim would differ
    visible = trimmed_visibility(len(PROMPT_TRIM), chunk, MAX_KV, keep)
    expected = masked_reference_logits(folder, MODEL, PROMPT_TRIM, visible)
    with assert_masks_match_keys() as seen:
        actual = chunked_logits(tiny[0], PROMPT_TRIM, chunk, max_kv_size=MAX_KV, keep=keep)
    assert seen and max(keys for _, keys in seen) <= MAX_KV
    assert_close(actual, expected)


def test_query_scaling_uses_monotonic_offset_after_trim(folder, tiny):
    # Llama-4 scaling steps every 8 positions; after trimming to 8 live tokens the live length
    # stays below 8 while positions reach 21, so a live-length scale would stay at 1.
    ids, max_kv = PROMPT_TRIM, 8
    expected = masked_reference_logits(folder, MODEL, ids, trimmed_visibility(len(ids), 3, max_kv))
    actual = chunked_logits(tiny[0], ids, 3, max_kv_size=max_kv)
    assert_close(actual, expected)
    untrimmed = reference_logits(folder, MODEL, ids)
    assert not torch.allclose(actual[max_kv:], untrimmed[max_kv:], atol=1e-3)  # trims took effect

"""mistral4 equals transformers' Mistral4ForCausalLM on tiny random checkpoints.

Two variants cover MLA with low-rank queries and interleaved RoPE pairs, and with a plain q_proj
and rotate-half RoPE; both have YaRN (attention factor and mscale), Llama-4 query scaling that
changes every 8 positions, a dense first layer, then softmax-routed group-limited MoE layers
with shared experts. Under `--max-kv-size` the query scaling and RoPE keep absolute positions.
"""

import pytest
import torch
import transformers
from tests.family_suite import (  # noqa: F401  (the shared tests run here)
    EVERY_KV_CHUNK,
    Family,
    assert_trim_keeps_true_positions,
    build_tiny,
    kv_chunks,
    one_thread,
    prefilled,
    test_a_prefix_hit_gives_the_tokens_of_a_cold_prompt,
    test_batched_sequences_match_each_run_alone,
    test_chunked_prefill_matches_transformers,
    test_four_sequences_decode_batched_equal_each_alone,
    test_fp8_kv_cache_stays_near_the_model_dtype_cache,
    test_full_prompt_forward_matches_transformers,
    test_max_kv_size_chunks_match_dense_reference,
    test_prefill_then_decode_matches_transformers,
    test_prefilling_and_decoding_sequences_share_a_batch,
    test_restore_after_a_failed_step,
    test_serves_the_checkpoint_by_its_model_type,
)

from kestrel.models.layers.mla import LatentKVCache

COVERS = ("mistral4",)
# shared checks that do not apply here, and why
OPT_OUTS = {
    "test_sliding_window_chunks_match_transformers": "Mistral 4's MLA layers attend to every key",
    "test_trim_leaves_recurrent_state_untouched": "no recurrent layers: every layer is attention",
}

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


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    family = Family(
        MODEL,
        transformers.Mistral4Config(**COMMON, **VARIANTS[request.param]),
        PROMPT,
        batched=(slice(0, 17), slice(3, 12), slice(0, 25)),
        batched_vs_transformers=True,
        # PROMPT[:22] under --max-kv-size, at true positions: RoPE or the Llama-4 query scaling
        # taken from the live length after a trim would differ
        kv_tokens=22,
    )
    return build_tiny(family, tmp_path_factory.mktemp(request.param))


kv_chunk = kv_chunks(EVERY_KV_CHUNK)


def test_cache_holds_latent_and_rope_key(tiny):
    model = tiny.model
    cache = prefilled(model, PROMPT[:7])
    for layer in cache.layers:
        assert isinstance(layer, LatentKVCache)
        assert layer.keys.shape == (1, 7, 8) and layer.values.shape == (1, 7, 4)
    assert model.kv_bytes_per_token(torch.bfloat16) == (8 + 4) * 3 * 2


def test_query_scaling_uses_monotonic_offset_after_trim(tiny):
    # Llama-4 scaling steps every 8 positions; after trimming to 8 live tokens the live length
    # stays below 8 while positions reach 21, so a live-length scale would stay at 1.
    assert_trim_keeps_true_positions(tiny)

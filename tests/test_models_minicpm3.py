"""minicpm3 equals transformers' MiniCPM3ForCausalLM on a tiny random checkpoint.

Exercises MLA with low-rank queries and attention biases, LongRoPE (short factors and attention
factor; long factors past `original_max_position_embeddings`), the embedding scale, depth-scaled
residuals and the logit scaling; under `--max-kv-size`, RoPE must keep the monotonic position.
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
from tests.reference import assert_close, chunked_logits

from kestrel.models.layers.mla import LatentKVCache

COVERS = ("minicpm3",)
# shared checks that do not apply here, and why
OPT_OUTS = {
    "test_sliding_window_chunks_match_transformers": "MiniCPM3's MLA layers attend to every key",
    "test_trim_leaves_recurrent_state_untouched": "no recurrent layers: every layer is attention",
}

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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    family = Family(
        MODEL,
        transformers.MiniCPM3Config(**CONFIG),
        PROMPT,
        batched=(slice(0, 17), slice(3, 12), slice(0, 25)),
        batched_vs_transformers=True,
        kv_tokens=22,  # PROMPT[:22] under --max-kv-size: shorter, as every chunk size runs
    )
    return build_tiny(family, tmp_path_factory.mktemp("minicpm3"))


kv_chunk = kv_chunks(EVERY_KV_CHUNK)


def test_long_prompt_uses_long_factors_like_transformers(tiny):
    # one forward reaching past original_max: transformers switches every position to long factors
    ids = PROMPT + PROMPT[:10]
    assert len(ids) > ORIGINAL_MAX
    assert_close(chunked_logits(tiny.model, ids, len(ids)), tiny.reference(ids))


def test_cache_holds_latent_and_rope_key(tiny):
    model = tiny.model
    cache = prefilled(model, PROMPT[:7])
    for layer in cache.layers:
        assert isinstance(layer, LatentKVCache)
        assert layer.keys.shape == (1, 7, 8) and layer.values.shape == (1, 7, 4)
    assert model.kv_bytes_per_token(torch.float32) == (8 + 4) * 3 * 4


def test_rope_uses_monotonic_offset_after_trim(tiny):
    # After the front trim the live window holds 8 tokens while positions reach 21; RoPE at the
    # live length would rotate every later token wrongly. The reference runs at true positions.
    assert_trim_keeps_true_positions(tiny)

"""llama equals transformers' LlamaForCausalLM on a tiny checkpoint (grouped-query attention,
a head_dim other than hidden / heads, llama-3 RoPE scaling): the whole shared suite."""

import pytest
import transformers
from tests.family_suite import (  # noqa: F401  (the shared tests run here)
    Family,
    build_tiny,
    kv_chunks,
    one_thread,
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

COVERS = ("llama",)
# shared checks that do not apply here, and why
OPT_OUTS = {
    "test_sliding_window_chunks_match_transformers": "Llama has no sliding-window attention",
    "test_trim_leaves_recurrent_state_untouched": "no recurrent layers: every layer is attention",
}

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,  # not hidden / heads: q and o project through 32 features
    max_position_embeddings=256,
    initializer_range=0.1,
    rope_parameters={  # llama-3 scaling with short, medium and long wavelengths at head_dim 8
        "rope_type": "llama3",
        "rope_theta": 10_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
)
PROMPT = [(i * 37 + 11) % 256 for i in range(30)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    family = Family(
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig(**CONFIG),
        PROMPT,
        kestrel_class="LlamaForCausalLM",
    )
    return build_tiny(family, tmp_path_factory.mktemp("llama"))


kv_chunk = kv_chunks([(1, 0), (3, 4), (5, 2), (8, 4)])

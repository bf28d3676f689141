"""qwen3 equals transformers' Qwen3ForCausalLM on a tiny checkpoint (per-head q/k
RMSNorms);
the first layer attends to every key, the next two slide over a window shorter than the prompts
(`use_sliding_window`, `max_window_layers`): the whole shared suite."""

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
    test_sliding_window_chunks_match_transformers,
)
from tests.test_models_qwen2 import CONFIG as QWEN2_CONFIG
from tests.test_models_qwen2 import PROMPT, WINDOW

COVERS = ("qwen3",)
# shared checks that do not apply here, and why
OPT_OUTS = {
    "test_trim_leaves_recurrent_state_untouched": "no recurrent layers: every layer is attention",
}

# qwen2's tiny checkpoint (sliding layers included) with an explicit head size
CONFIG = {**QWEN2_CONFIG, "head_dim": 16}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    family = Family(
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config(**CONFIG),
        PROMPT,
        kestrel_class="LlamaForCausalLM",
        windows={"full_attention": None, "sliding_attention": WINDOW},
    )
    return build_tiny(family, tmp_path_factory.mktemp("qwen3"))


kv_chunk = kv_chunks([(1, 0), (3, 4), (5, 2), (8, 4)])

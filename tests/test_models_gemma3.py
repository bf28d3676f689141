"""gemma3 equals transformers on tiny checkpoints, both as a text model (Gemma3ForCausalLM,
model_type gemma3_text) and as the multimodal checkpoints Gemma 3 is released as
(Gemma3ForConditionalGeneration, model_type gemma3, whose text model kestrel serves): sliding and
global layers with their own RoPE bases, (1 + w) norms, q/k norms, the query scale and the final
logit soft-capping, through the whole shared suite."""

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

COVERS = ("gemma3_text", "gemma3")
# shared checks that do not apply here, and why
OPT_OUTS = {
    "test_trim_leaves_recurrent_state_untouched": "no recurrent layers: every layer is attention",
}

WINDOW = 8
S, F = "sliding_attention", "full_attention"
TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    sliding_window=WINDOW,
    layer_types=[S, S, F],
    query_pre_attn_scalar=16,
    final_logit_softcapping=30.0,
    initializer_range=0.1,
    rope_parameters={
        S: {"rope_type": "default", "rope_theta": 10_000.0},
        F: {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
)
# a SigLIP tower of one block over 8 x 8 images, one token per image: the text model is tested
VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=8,
    patch_size=4,
)
PROMPT = [(i * 37 + 11) % 256 for i in range(30)]


def text_checkpoint():
    return transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(**TEXT)


def multimodal_checkpoint():
    # released Gemma 3 configs set no final soft-capping (transformers' multimodal class ignores
    # one, its text class applies it)
    text = {**TEXT, "final_logit_softcapping": None}
    vision = {"model_type": "siglip_vision_model", **VISION}
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=1
    )
    return transformers.Gemma3ForConditionalGeneration, config


CHECKPOINTS = {"gemma3_text": text_checkpoint, "gemma3": multimodal_checkpoint}


@pytest.fixture(scope="module", params=COVERS)
def tiny(request, tmp_path_factory):
    model_cls, config = CHECKPOINTS[request.param]()
    family = Family(
        model_cls,
        config,
        PROMPT,
        kestrel_class="Gemma3ForCausalLM",
        windows={F: None, S: WINDOW},
    )
    return build_tiny(family, tmp_path_factory.mktemp(request.param))


kv_chunk = kv_chunks([(1, 0), (3, 4), (5, 2), (8, 4)])

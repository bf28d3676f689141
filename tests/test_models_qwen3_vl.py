"""qwen3_vl (Qwen3VLForConditionalGeneration) equals transformers on a tiny checkpoint: text-only
prompts, prompts with two images (chunk boundaries inside them, decode after them, a trimmed KV),
with interleaved M-RoPE, q/k norms and DeepStack features from two ViT blocks."""

import pytest
import transformers
from tests.vl_reference import special_ids, tiny_tokenizer
from tests.vl_suite import (  # noqa: F401  (the shared tests run here)
    MERGE,
    PATCH,
    build_tiny,
    one_thread,
    test_a_prefix_hit_needs_the_same_images,
    test_cli_arch_and_inspect_describe_the_family,
    test_decode_after_image_prompt_matches_transformers,
    test_image_and_text_sequences_batched_match_alone,
    test_image_chunks_split_inside_images_match_transformers,
    test_image_prompt_full_forward_matches_transformers,
    test_images_of_one_step_are_encoded_in_one_vision_forward,
    test_loads_by_model_type,
    test_max_kv_size_image_prefill_matches_dense_reference,
    test_paged_runner_matches_the_reference_with_images,
    test_restore_after_a_failed_image_step,
    test_text_chunked_prefill_matches_transformers,
    test_text_full_forward_matches_transformers,
    test_text_prefill_then_decode_matches_transformers,
)

COVERS = ("qwen3_vl",)
# shared checks that do not apply here, and why
OPT_OUTS = {
    "test_sliding_window_image_chunks_match_transformers": "its text layers attend to every key",
}


def text_config(tokenizer) -> dict:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_parameters={**rope, "mrope_interleaved": True},
    )


def vision_config() -> dict:
    # a 4 x 4 position table resampled to each grid; DeepStack taps blocks 0 and 2
    return dict(
        depth=3,
        hidden_size=16,
        out_hidden_size=32,
        intermediate_size=32,
        num_heads=2,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 2],
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = tiny_tokenizer()
    config = transformers.Qwen3VLConfig(
        text_config=text_config(tokenizer), vision_config=vision_config(), **special_ids(tokenizer)
    )
    model_cls = transformers.Qwen3VLForConditionalGeneration
    return build_tiny(model_cls, config, tmp_path_factory.mktemp("qwen3_vl"))


def test_deepstack_features_reach_the_first_layers(tiny):
    prompt = tiny.prompt
    features = tiny.model.encode_images(prompt.pixel_values, prompt.image_grid_thw)
    n_tokens = sum(e - s for s, e in prompt.image_spans)
    assert [tuple(d.shape) for d in features.deepstack] == [(n_tokens, 32)] * 2

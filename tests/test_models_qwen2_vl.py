"""qwen2_vl (Qwen2VLForConditionalGeneration) equals transformers on a tiny checkpoint: text-only
prompts, prompts with two images (chunk boundaries inside them, decode after them, a trimmed KV)."""

import pytest
import torch
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
    test_sliding_window_image_chunks_match_transformers,
    test_text_chunked_prefill_matches_transformers,
    test_text_full_forward_matches_transformers,
    test_text_prefill_then_decode_matches_transformers,
)

from kestrel.models.layers.mrope import prompt_rope_ids

COVERS = ("qwen2_vl",)
OPT_OUTS = {}  # every shared check applies: layers 1 and 2 slide


def tiny_config() -> transformers.Qwen2VLConfig:
    tokenizer = tiny_tokenizer()
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        # layers 1 and 2 slide over 8 tokens, shorter than the prompts
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    )
    vision = dict(
        depth=2,
        embed_dim=16,
        hidden_size=32,
        num_heads=2,
        mlp_ratio=2,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
    )
    return transformers.Qwen2VLConfig(
        text_config=text, vision_config=vision, **special_ids(tokenizer)
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_cls = transformers.Qwen2VLForConditionalGeneration
    return build_tiny(model_cls, tiny_config(), tmp_path_factory.mktemp("qwen2_vl"))


def test_sliding_and_full_layers(tiny):
    kinds = [(s.kind, s.window) for s in tiny.model.cache_specs()]
    assert kinds == [("full", None), ("sliding", 8), ("sliding", 8)]


def test_prompt_rope_ids_match_transformers_rope_index(tiny):
    ids = torch.tensor([tiny.prompt.token_ids])
    expected, delta = tiny.hf.model.get_rope_index(
        ids, (ids == tiny.image_token_id).int(), tiny.prompt.image_grid_thw
    )
    rope = prompt_rope_ids(ids[0], tiny.image_token_id, tiny.prompt.image_grid_thw, MERGE)
    assert torch.equal(rope, expected[:, 0])
    assert tiny.prompt.rope_delta == int(delta)


def test_checkpoints_saved_before_transformers_4_52_load_by_name(tiny):
    # the Qwen2-VL releases keep the ViT at `visual.*` and the decoder at `model.*`
    params = dict(tiny.model.named_parameters())
    for old in ["visual.blocks.0.attn.qkv.weight", "model.layers.1.self_attn.q_proj.bias"]:
        assert tiny.model.checkpoint_name(old) in params
    for current in params:
        assert tiny.model.checkpoint_name(current) == current

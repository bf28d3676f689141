"""qwen3_vl_moe (Qwen3VLMoeForConditionalGeneration) equals transformers on a tiny checkpoint:
qwen3_vl's checks with MoE layers (the shared models/layers/moe.py) and one dense layer."""

import pytest
import torch
import transformers
from tests.test_models_qwen3_vl import text_config, vision_config
from tests.vl_reference import special_ids, tiny_tokenizer
from tests.vl_suite import (  # noqa: F401  (the shared tests run here)
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

from kestrel.models.layers.moe import SparseMoE
from kestrel.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration

COVERS = ("qwen3_vl_moe",)
# shared checks that do not apply here, and why
OPT_OUTS = {
    "test_sliding_window_image_chunks_match_transformers": "its text layers attend to every key",
}

MOE = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = tiny_tokenizer()
    config = transformers.Qwen3VLMoeConfig(
        text_config={**text_config(tokenizer), **MOE},
        vision_config=vision_config(),
        **special_ids(tokenizer),
    )
    model_cls = transformers.Qwen3VLMoeForConditionalGeneration
    return build_tiny(model_cls, config, tmp_path_factory.mktemp("qwen3_vl_moe"))


def test_moe_and_dense_layers(tiny):
    mlps = [type(layer.mlp) for layer in tiny.model.model.language_model.layers]
    assert mlps[0] is SparseMoE and mlps[2] is SparseMoE and mlps[1] is not SparseMoE


def test_released_expert_layout_is_transposed_on_load(tiny):
    # Qwen's checkpoints store experts as (E, H, 2I) / (E, I, H); transformers saves (E, 2I, H)
    name = "model.language_model.layers.0.mlp.experts.down_proj"
    param = tiny.model.get_parameter(name)
    released = param.transpose(1, 2).contiguous()
    assert torch.equal(tiny.model.checkpoint_tensor(name, released), param)
    assert tiny.model.checkpoint_tensor(name, param) is param
    assert isinstance(tiny.model, Qwen3VLMoeForConditionalGeneration)

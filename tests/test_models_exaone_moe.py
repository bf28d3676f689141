"""exaone_moe equals transformers' ExaoneMoeForCausalLM on a tiny checkpoint, also under --max-kv-size."""

import pytest
import torch
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

from kestrel.models.registry import supported_architectures

COVERS = ("exaone_moe",)
# shared checks that do not apply here, and why
OPT_OUTS = {
    "test_trim_leaves_recurrent_state_untouched": "no recurrent layers: every layer is attention",
}

WINDOW = 6
CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    sliding_window=WINDOW,
    layer_types=[
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ],
    mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"],
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    num_shared_experts=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    initializer_range=0.1,
)
PROMPT = [(i * 37 + 11) % 128 for i in range(30)]
MODEL_CLS = transformers.ExaoneMoeForCausalLM


def _randomize_correction_bias(model) -> None:
    # the bias starts at zero, which would hide a bias ignored or applied to the weights
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn_like(buf) * 0.1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    family = Family(
        MODEL_CLS,
        transformers.ExaoneMoeConfig(**CONFIG),
        PROMPT,
        tweak=_randomize_correction_bias,
        kestrel_class="ExaoneMoeForCausalLM",
        windows={"full_attention": None, "sliding_attention": WINDOW},
    )
    return build_tiny(family, tmp_path_factory.mktemp("exaone_moe"))


kv_chunk = kv_chunks([(chunk, 2) for chunk in (1, 3, 5, 10)])


def test_exaone_moe_is_registered():
    assert "exaone_moe" in supported_architectures()


def test_kv_bytes_per_token(tiny):
    assert tiny.model.kv_bytes_per_token(torch.float32) == 2 * 2 * 8 * 5 * 4

"""glm4_moe_lite equals transformers' Glm4MoeLiteForCausalLM on a tiny random checkpoint.

Exercises MLA with low-rank queries and interleaved RoPE pairs, a dense first layer, then
sigmoid-routed MoE layers with a (randomized) score-correction bias, group-limited top-k, routed
scaling and shared experts. The cache holds only the latent and the shared RoPE key per token.
"""

import json

import pytest
import torch
import transformers
from tests.family_suite import (  # noqa: F401  (the shared tests run here)
    EVERY_KV_CHUNK,
    Family,
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
from tests.reference import assert_close, chunked_logits, load_kestrel, reference_logits, save_tiny

from kestrel.models.layers.mla import LatentKVCache

COVERS = ("glm4_moe_lite",)
# shared checks that do not apply here, and why
OPT_OUTS = {
    "test_sliding_window_chunks_match_transformers": "GLM-4.7-Flash's MLA layers attend to every key",
    "test_trim_leaves_recurrent_state_untouched": "no recurrent layers: every layer is attention",
}

MODEL = transformers.Glm4MoeLiteForCausalLM
CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    mlp_layer_types=["dense", "sparse", "sparse"],
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=1.8,
    q_lora_rank=12,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    rope_interleave=True,
    initializer_range=0.1,
    rope_parameters=dict(rope_type="default", rope_theta=1000.0),
)
PROMPT = [(i * 37 + 11) % 128 for i in range(30)]
LATENT, ROPE_KEY = 8, 4


def randomize_correction_bias(model) -> None:
    # zeros by default, which would hide a bias applied to the weights instead of the choice
    for module in model.modules():
        if getattr(module, "e_score_correction_bias", None) is not None:
            module.e_score_correction_bias.copy_(torch.randn_like(module.e_score_correction_bias))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    family = Family(
        MODEL,
        transformers.Glm4MoeLiteConfig(**CONFIG),
        PROMPT,
        tweak=randomize_correction_bias,
        batched=(slice(0, 17), slice(3, 12), slice(0, 25)),
        batched_vs_transformers=True,
        kv_tokens=22,  # PROMPT[:22] under --max-kv-size: shorter, as every chunk size runs
        restore_after=6,
    )
    return build_tiny(family, tmp_path_factory.mktemp("glm"))


kv_chunk = kv_chunks(EVERY_KV_CHUNK)


def test_cache_holds_only_latent_and_rope_key(tiny):
    model = tiny.model
    cache = prefilled(model, PROMPT[:7])
    for layer in cache.layers:
        assert isinstance(layer, LatentKVCache)
        assert layer.keys.shape == (1, 7, LATENT) and layer.values.shape == (1, 7, ROPE_KEY)
        assert layer.positions.tolist() == list(range(7))
    # latent + rope key per layer, not 2 * heads * head_dim = 2 * 4 * 12 expanded K/V
    assert model.kv_bytes_per_token(torch.float32) == (LATENT + ROPE_KEY) * 3 * 4


def test_multi_token_prediction_layers_are_skipped(tmp_path):
    # GLM checkpoints carry an MTP layer after the decoder layers; saving 4 layers and declaring
    # 3 leaves layer 3's tensors (attention, experts) without a parameter
    config = transformers.Glm4MoeLiteConfig(
        **{
            **CONFIG,
            "num_hidden_layers": 4,
            "mlp_layer_types": CONFIG["mlp_layer_types"] + ["sparse"],
        }
    )
    save_tiny(MODEL, config, tmp_path)
    declared = json.loads((tmp_path / "config.json").read_text())
    declared.update(num_hidden_layers=3, mlp_layer_types=CONFIG["mlp_layer_types"])
    (tmp_path / "config.json").write_text(json.dumps(declared))
    ids = PROMPT[:12]
    assert_close(
        chunked_logits(load_kestrel(tmp_path), ids, 5), reference_logits(tmp_path, MODEL, ids)
    )

"""gemma4 equals transformers' Gemma4ForCausalLM on tiny checkpoints (dense; KV sharing with
per-layer inputs; MoE), and Gemma4ForConditionalGeneration (the released layout, model_type
gemma4) on the KV-sharing one, through the whole shared suite."""

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

COVERS = ("gemma4_text", "gemma4")
# shared checks that do not apply here, and why
OPT_OUTS = {
    "test_trim_leaves_recurrent_state_untouched": "no recurrent layers: every layer is attention",
}

WINDOW = 6
S, F = "sliding_attention", "full_attention"
COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    global_head_dim=16,
    sliding_window=WINDOW,
    max_position_embeddings=256,
    final_logit_softcapping=20.0,
    initializer_range=0.1,
    rope_parameters={
        S: {"rope_type": "default", "rope_theta": 10_000.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1_000_000.0},
    },
)
VARIANTS = {
    # full layers: K = V, a wider head with fewer KV heads, half-rotary proportional RoPE
    "dense": dict(
        num_hidden_layers=5,
        layer_types=[S, S, F, S, F],
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        hidden_size_per_layer_input=0,
    ),
    # the last 3 layers read the caches of layers 2 (sliding) and 3 (full); double-wide MLPs there
    "kv_shared_ple": dict(
        num_hidden_layers=7,
        layer_types=[S, S, S, F, S, S, F],
        num_kv_shared_layers=3,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128,
        use_double_wide_mlp=True,
    ),
    "moe": dict(
        num_hidden_layers=4,
        layer_types=[S, F, S, F],
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=16,
    ),
}
PROMPT = [(i * 37 + 11) % 128 for i in range(30)]
MODEL_CLS = transformers.Gemma4ForCausalLM


def _randomize_scalars(model) -> None:
    # layer scalars and router scales start at one, which would hide one left out
    for name, p in model.named_parameters():
        if name.endswith(("router.scale", "per_expert_scale")):
            p.copy_(1 + torch.randn_like(p) * 0.3)
    for name, buf in model.named_buffers():
        if name.endswith("layer_scalar"):
            buf.copy_(1 + torch.randn_like(buf) * 0.3)


def checkpoint(variant: str):
    """transformers' class and config of a variant. Released Gemma 4 checkpoints are
    Gemma4ForConditionalGeneration (model_type gemma4), whose text model kestrel serves."""
    if variant == "multimodal":
        text = transformers.Gemma4TextConfig(**COMMON, **VARIANTS["kv_shared_ple"])
        config = transformers.Gemma4Config(
            text_config=text.to_dict(), vision_config=None, audio_config=None
        )
        return transformers.Gemma4ForConditionalGeneration, config, text
    text = transformers.Gemma4TextConfig(**COMMON, **VARIANTS[variant])
    return MODEL_CLS, text, text


@pytest.fixture(scope="module", params=[*sorted(VARIANTS), "multimodal"])
def tiny(request, tmp_path_factory):
    model_cls, config, text = checkpoint(request.param)
    family = Family(
        model_cls,
        config,
        PROMPT,
        tweak=_randomize_scalars,
        kestrel_class="Gemma4ForCausalLM",
        windows={F: None, S: WINDOW},
        attend_layers=text.num_hidden_layers,  # shared-KV layers attend too
    )
    return build_tiny(family, tmp_path_factory.mktemp(request.param))


kv_chunk = kv_chunks([(chunk, 2) for chunk in (1, 4, 10)])


def test_gemma4_is_registered():
    assert {"gemma4", "gemma4_text"} <= set(supported_architectures())


def test_kv_bytes_per_token_counts_only_cache_owners(tiny):
    model = tiny.model
    c = model.config
    expected = 0
    for t in c.layer_types[: c.num_hidden_layers - c.num_kv_shared_layers]:
        kv_heads = 1 if (t == F and c.attention_k_eq_v) else 2
        expected += 2 * kv_heads * (16 if t == F else 8)
    assert model.kv_bytes_per_token(torch.float32) == expected * 4

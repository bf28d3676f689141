"""jamba equals transformers' JambaForCausalLM on a tiny checkpoint: Mamba layers with dt/B/C norms,
attention and MoE layers at their periods/offsets, alone, batched, chunked and under --max-kv-size."""

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
    test_trim_leaves_recurrent_state_untouched,
)

from kestrel.models.jamba import JambaForCausalLM

COVERS = ("jamba",)
# shared checks that do not apply here, and why
OPT_OUTS = {
    "test_sliding_window_chunks_match_transformers": "Jamba's attention layers attend to every key",
}

MODEL_CLS = transformers.JambaForCausalLM
# layers: mamba, attention+MoE, mamba, mamba+MoE, attention, mamba+MoE, mamba
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_layer_period=3,
    attn_layer_offset=1,
    num_experts=4,
    num_experts_per_tok=2,
    expert_layer_period=2,
    expert_layer_offset=1,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_dt_rank=8,
)
PROMPT = [(i * 37 + 11) % 256 for i in range(30)]


def perturb(model) -> None:
    # the Mamba scalars initialise to constants (A_log = log(1..N), D = 1)
    for name, p in model.named_parameters():
        if name.endswith(("A_log", ".D", "dt_proj.bias")):
            p.add_(torch.randn_like(p) * 0.3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    family = Family(
        MODEL_CLS,
        transformers.JambaConfig(**CONFIG),
        PROMPT,
        tweak=perturb,
        decode_prefill=11,
        windows={"full_attention": None},
        unmasked=("linear_attention",),
    )
    return build_tiny(family, tmp_path_factory.mktemp("jamba"))


kv_chunk = kv_chunks([(chunk, 2) for chunk in (1, 5, 10)])


def test_loads_by_model_type_with_attention_and_moe_periods(tiny):
    model = tiny.model
    assert isinstance(model, JambaForCausalLM)
    kinds = [spec.kind for spec in model.cache_specs()]
    recurrent, full = "recurrent", "full"
    assert kinds == [recurrent, full, recurrent, recurrent, full, recurrent, recurrent]
    # K and V of the 2 attention layers only: 2 kv heads x head_dim 16, fp32
    assert model.kv_bytes_per_token(torch.float32) == 2 * 2 * (2 * 16) * 4
    moe = [type(layer.feed_forward).__name__ == "SparseMoE" for layer in model.model.layers]
    assert moe == [False, True, False, True, False, True, False]

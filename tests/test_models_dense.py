"""Dense families (llama, mistral, qwen2, qwen3, gemma3) equal transformers on tiny checkpoints."""

import pytest
import transformers
from tests.reference import (
    assert_close,
    chunked_logits,
    decode_logits,
    load_kestrel,
    reference_logits,
    save_tiny,
)

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(head_dim=16)),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=None),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=16)),
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            final_logit_softcapping=30.0,
        ),
    ),
}

PROMPT = [(i * 37 + 11) % 256 for i in range(30)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    config_cls, model_cls, extra = FAMILIES[request.param]
    folder = save_tiny(
        model_cls, config_cls(**COMMON, **extra), tmp_path_factory.mktemp(request.param)
    )
    return load_kestrel(folder), reference_logits(folder, model_cls, PROMPT)


def test_full_prompt_forward_matches_transformers(tiny):
    model, expected = tiny
    assert_close(chunked_logits(model, PROMPT, len(PROMPT)), expected)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_prefill_matches_transformers(tiny, chunk):
    model, expected = tiny
    assert_close(chunked_logits(model, PROMPT, chunk), expected)


def test_prefill_then_decode_matches_transformers(tiny):
    model, expected = tiny
    assert_close(decode_logits(model, PROMPT, prefill=11), expected)


@pytest.mark.parametrize("chunk", [4, 8, 16, 64])
def test_gemma3_sliding_window_chunks_match_full_forward(chunk, tmp_path):
    config_cls, model_cls, extra = FAMILIES["gemma3"]
    folder = save_tiny(model_cls, config_cls(**COMMON, **extra), tmp_path)
    assert_close(
        chunked_logits(load_kestrel(folder), PROMPT, chunk),
        reference_logits(folder, model_cls, PROMPT),
    )

"""exaone_moe equals transformers' ExaoneMoeForCausalLM on a tiny checkpoint, also under --max-kv-size."""

import pytest
import torch
import transformers
from tests.reference import (
    assert_close,
    assert_masks_match_keys,
    chunked_logits,
    decode_logits,
    load_kestrel,
    masked_reference_logits,
    packed_logits,
    reference_logits,
    save_tiny,
    trimmed_visibility,
)

from kestrel.models.registry import supported_architectures

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
    config = transformers.ExaoneMoeConfig(**CONFIG)
    folder = save_tiny(
        MODEL_CLS, config, tmp_path_factory.mktemp("exaone_moe"), tweak=_randomize_correction_bias
    )
    return folder, load_kestrel(folder), reference_logits(folder, MODEL_CLS, PROMPT)


def test_exaone_moe_is_registered():
    assert "exaone_moe" in supported_architectures()


def test_full_prompt_forward_matches_transformers(tiny):
    _, model, expected = tiny
    assert type(model).__name__ == "ExaoneMoeForCausalLM"
    assert_close(chunked_logits(model, PROMPT, len(PROMPT)), expected)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_prefill_matches_transformers(tiny, chunk):
    _, model, expected = tiny
    assert_close(chunked_logits(model, PROMPT, chunk), expected)


def test_prefill_then_decode_matches_transformers(tiny):
    _, model, expected = tiny
    assert_close(decode_logits(model, PROMPT, prefill=9), expected)


@pytest.mark.parametrize("chunk", [1, 3, 5, 10])
def test_max_kv_size_chunks_match_dense_reference(tiny, chunk):
    folder, model, _ = tiny
    max_kv, keep = 12, 2
    with assert_masks_match_keys() as seen:
        actual = chunked_logits(model, PROMPT, chunk, max_kv_size=max_kv, keep=keep)
    assert seen and max(keys for _, keys in seen) <= max_kv
    masks = {
        "full_attention": trimmed_visibility(len(PROMPT), chunk, max_kv, keep),
        "sliding_attention": trimmed_visibility(len(PROMPT), chunk, max_kv, keep, WINDOW),
    }
    assert_close(actual, masked_reference_logits(folder, MODEL_CLS, PROMPT, masks))


def test_kv_bytes_per_token(tiny):
    _, model, _ = tiny
    assert model.kv_bytes_per_token(torch.float32) == 2 * 2 * 8 * 5 * 4


def test_batched_sequences_match_each_run_alone(tiny):
    # different lengths, prefill and decode chunks of several sequences packed in one batch
    model = tiny[1]
    seqs = [PROMPT[:23], PROMPT[3:14], PROMPT[7:30]]
    outs = packed_logits(model, seqs, chunks=[4, 1, 7], prefill=[5, 3, 2])
    for seq, out in zip(seqs, outs, strict=True):
        assert_close(out, chunked_logits(model, seq, len(seq)))

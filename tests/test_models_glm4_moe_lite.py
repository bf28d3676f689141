"""glm4_moe_lite equals transformers' Glm4MoeLiteForCausalLM on a tiny random checkpoint.

Exercises MLA with low-rank queries and interleaved RoPE pairs, a dense first layer, then
sigmoid-routed MoE layers with a (randomized) score-correction bias, group-limited top-k, routed
scaling and shared experts. The cache holds only the latent and the shared RoPE key per token.
"""

import json

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

from kestrel.cache import SequenceCache
from kestrel.models.batch import ForwardBatch
from kestrel.models.mla import LatentKVCache

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
MAX_KV, PROMPT_TRIM = 12, PROMPT[:22]
LATENT, ROPE_KEY = 8, 4


def randomize_correction_bias(model) -> None:
    # zeros by default, which would hide a bias applied to the weights instead of the choice
    for module in model.modules():
        if getattr(module, "e_score_correction_bias", None) is not None:
            module.e_score_correction_bias.copy_(torch.randn_like(module.e_score_correction_bias))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny tensors: one thread avoids OpenMP overhead that dominates on a loaded 2-core machine
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = transformers.Glm4MoeLiteConfig(**CONFIG)
    return save_tiny(MODEL, config, tmp_path_factory.mktemp("glm"), tweak=randomize_correction_bias)


@pytest.fixture(scope="module")
def tiny(folder):
    return load_kestrel(folder), reference_logits(folder, MODEL, PROMPT)


def test_full_prompt_forward_matches_transformers(tiny):
    model, expected = tiny
    assert_close(chunked_logits(model, PROMPT, len(PROMPT)), expected)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_prefill_matches_transformers(tiny, chunk):
    model, expected = tiny
    assert_close(chunked_logits(model, PROMPT, chunk), expected)


def test_prefill_then_decode_matches_transformers(tiny):
    model, expected = tiny
    assert_close(decode_logits(model, PROMPT, prefill=9), expected)


def test_batched_sequences_match_each_alone(folder, tiny):
    seqs = [PROMPT[:17], PROMPT[3:12], PROMPT[:25]]
    outs = packed_logits(tiny[0], seqs, chunks=[4, 1, 7], prefill=[5, 3, 2])
    for ids, out in zip(seqs, outs, strict=True):
        assert_close(out, reference_logits(folder, MODEL, ids))


def test_cache_holds_only_latent_and_rope_key(tiny):
    model = tiny[0]
    cache = SequenceCache(model.cache_specs())
    with torch.no_grad():
        model(ForwardBatch.single(cache, torch.tensor(PROMPT[:7])))
    for layer in cache.layers:
        assert isinstance(layer, LatentKVCache)
        assert layer.keys.shape == (1, 7, LATENT) and layer.values.shape == (1, 7, ROPE_KEY)
        assert layer.positions.tolist() == list(range(7))
    # latent + rope key per layer, not 2 * heads * head_dim = 2 * 4 * 12 expanded K/V
    assert model.kv_bytes_per_token(torch.float32) == (LATENT + ROPE_KEY) * 3 * 4


def test_checkpoint_restore_undoes_a_step(tiny):
    model = tiny[0]
    cache = SequenceCache(model.cache_specs())
    with torch.no_grad():
        model(ForwardBatch.single(cache, torch.tensor(PROMPT[:6])))
        cache.advance(6)
        saved = cache.checkpoint()
        first = model(ForwardBatch.single(cache, torch.tensor(PROMPT[6:9])))
        cache.restore(saved)
        again = model(ForwardBatch.single(cache, torch.tensor(PROMPT[6:9])))
    assert torch.equal(first, again)


def test_multi_token_prediction_layers_are_skipped(folder, tmp_path):
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


@pytest.mark.parametrize(
    "chunk,keep", [(c, k) for k in (0, 2) for c in range(1, MAX_KV - k + 1)]
)  # every chunk size allowed: chunks are at most max_kv_size - keep
def test_max_kv_size_chunks_match_dense_reference(folder, tiny, chunk, keep):
    visible = trimmed_visibility(len(PROMPT_TRIM), chunk, MAX_KV, keep)
    expected = masked_reference_logits(folder, MODEL, PROMPT_TRIM, visible)
    with assert_masks_match_keys() as seen:
        actual = chunked_logits(tiny[0], PROMPT_TRIM, chunk, max_kv_size=MAX_KV, keep=keep)
    assert seen and max(keys for _, keys in seen) <= MAX_KV
    assert_close(actual, expected)

"""jamba equals transformers' JambaForCausalLM on a tiny checkpoint: Mamba layers with dt/B/C norms,
attention and MoE layers at their periods/offsets, alone, batched, chunked and under --max-kv-size."""

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
from kestrel.models.jamba import JambaForCausalLM

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
    config = transformers.JambaConfig(**CONFIG)
    folder = save_tiny(MODEL_CLS, config, tmp_path_factory.mktemp("jamba"), tweak=perturb)
    return folder, load_kestrel(folder), reference_logits(folder, MODEL_CLS, PROMPT)


def test_loads_by_model_type_with_attention_and_moe_periods(tiny):
    _, model, _ = tiny
    assert isinstance(model, JambaForCausalLM)
    kinds = [spec.kind for spec in model.cache_specs()]
    recurrent, full = "recurrent", "full"
    assert kinds == [recurrent, full, recurrent, recurrent, full, recurrent, recurrent]
    # K and V of the 2 attention layers only: 2 kv heads x head_dim 16, fp32
    assert model.kv_bytes_per_token(torch.float32) == 2 * 2 * (2 * 16) * 4
    moe = [type(layer.feed_forward).__name__ == "SparseMoE" for layer in model.model.layers]
    assert moe == [False, True, False, True, False, True, False]


def test_full_prompt_forward_matches_transformers(tiny):
    _, model, expected = tiny
    assert_close(chunked_logits(model, PROMPT, len(PROMPT)), expected)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_prefill_matches_transformers(tiny, chunk):
    _, model, expected = tiny
    assert_close(chunked_logits(model, PROMPT, chunk), expected)


def test_prefill_then_decode_matches_transformers(tiny):
    _, model, expected = tiny
    assert_close(decode_logits(model, PROMPT, prefill=11), expected)


def test_four_sequences_decode_batched_equal_each_alone(tiny):
    folder, model, _ = tiny
    seqs = [PROMPT[:9], PROMPT[3:20], PROMPT[5:17], PROMPT[:30]]
    prefill = [4, 12, 7, 20]
    batched = packed_logits(model, seqs, chunks=[1] * 4, prefill=prefill)
    for seq, p, out in zip(seqs, prefill, batched, strict=True):
        assert_close(out, decode_logits(model, seq, p))
        assert_close(out, reference_logits(folder, MODEL_CLS, seq))


def test_prefilling_and_decoding_sequences_share_a_batch(tiny):
    _, model, _ = tiny
    seqs = [PROMPT[:6], PROMPT[2:25], PROMPT[4:15], PROMPT[:30]]
    batched = packed_logits(model, seqs, chunks=[1, 3, 5, 7])
    for seq, out in zip(seqs, batched, strict=True):
        assert_close(out, chunked_logits(model, seq, len(seq)))


@pytest.mark.parametrize("chunk", [1, 5, 10])
def test_max_kv_size_trims_attention_to_the_dense_reference(tiny, chunk):
    folder, model, _ = tiny
    max_kv, keep = 12, 2
    with assert_masks_match_keys() as seen:
        out = chunked_logits(model, PROMPT, chunk, max_kv_size=max_kv, keep=keep)
    assert seen and max(keys for _, keys in seen) <= max_kv
    visible = trimmed_visibility(len(PROMPT), chunk, max_kv, keep)
    expected = masked_reference_logits(
        folder, MODEL_CLS, PROMPT, {"full_attention": visible, "linear_attention": None}
    )
    assert_close(out, expected)
    assert not torch.allclose(out, tiny[2], atol=1e-3)  # the trim did change what was attended


def test_trim_leaves_recurrent_state_untouched(tiny):
    _, model, _ = tiny
    cache = SequenceCache(model.cache_specs())
    with torch.no_grad():
        model(ForwardBatch.single(cache, torch.tensor(PROMPT[:20])))
    cache.advance(20)
    states = [layer.checkpoint() for layer in cache.layers]
    assert cache.make_room(5, max_kv_size=12, keep=2) > 0
    for spec, layer, before in zip(model.cache_specs(), cache.layers, states, strict=True):
        if spec.kind == "full":
            assert len(layer) == 12 - 5
        if spec.kind == "recurrent":
            assert all(a is b for a, b in zip(layer.checkpoint(), before, strict=True))


def test_restore_undoes_a_step(tiny):
    _, model, _ = tiny
    cache = SequenceCache(model.cache_specs())
    with torch.no_grad():
        model(ForwardBatch.single(cache, torch.tensor(PROMPT[:10])))
        cache.advance(10)
        saved = cache.checkpoint()
        first = model(ForwardBatch.single(cache, torch.tensor(PROMPT[10:13])))
        cache.restore(saved)
        again = model(ForwardBatch.single(cache, torch.tensor(PROMPT[10:13])))
    torch.testing.assert_close(again, first, rtol=0, atol=0)

"""nemotron-nas (DeciLM) against two oracles: transformers' Llama when every block is normal, and a
plain PyTorch reference written here from DeciLM's config semantics when blocks are linear/no-op
or have their own KV-head grouping and MLP width."""

import json
import shutil
from dataclasses import dataclass

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tests.family_suite import (  # noqa: F401  (the shared tests run here)
    Family,
    Tiny,
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
)
from tests.reference import assert_close, load_kestrel, reference_logits, save_tiny
from torch import nn

from kestrel.models.registry import supported_architectures

COVERS = ("nemotron-nas",)
# shared checks that do not apply here, and why
OPT_OUTS = {
    # kestrel refuses blocks with a `window_length` (published checkpoints set none)
    "test_sliding_window_chunks_match_transformers": "no sliding-window blocks",
    "test_trim_leaves_recurrent_state_untouched": "no recurrent layers: attention, linear or none",
}

HIDDEN, HEADS, VOCAB = 32, 4, 128
ROPE = {  # llama-3 scaling with short, medium and long wavelengths at head_dim 8
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
PROMPT = [(i * 37 + 11) % VOCAB for i in range(30)]


def block(attention="gqa", group=2, ffn="mlp", mult=1.0) -> dict:
    """One entry of `block_configs` as published checkpoints write it."""
    return {
        "attention": {
            "n_heads_in_group": group if attention == "gqa" else None,
            "no_op": attention == "none",
            "replace_with_linear": attention == "linear",
            "sparsify": None,
            "num_sink_tokens": None,
            "use_prefill_window_in_sink_attention": False,
            "unshifted_sink": False,
            "window_length": None,
        },
        "ffn": {
            "ffn_mult": mult if ffn == "mlp" else None,
            "no_op": ffn == "none",
            "replace_with_linear": ffn == "linear",
            "sparsify": None,
        },
    }


def nas_config(blocks: list[dict]) -> dict:
    return {
        "architectures": ["DeciLMForCausalLM"],
        "model_type": "nemotron-nas",
        "auto_map": {"AutoConfig": "configuration_decilm.DeciLMConfig"},
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": None,
        "intermediate_size": None,
        "num_hidden_layers": len(blocks),
        "block_configs": blocks,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 256,
        "rope_theta": ROPE["rope_theta"],
        "rope_scaling": {k: v for k, v in ROPE.items() if k != "rope_theta"},
        "tie_word_embeddings": False,
    }


# --- the plain PyTorch reference, from DeciLM's published semantics ----------------------------


def rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_cos_sin(n: int):
    """cos/sin (n, D) from transformers' own llama-3 RoPE."""
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        max_position_embeddings=256,
        rope_parameters=ROPE,
    )
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1), torch.arange(n)[None])
    return cos[0], sin[0]


def rotate(x, cos, sin):  # x (H, n, D): rotate-half RoPE
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def deci_attention(sd, p, x, mask, cos, sin, group):
    n, d = x.shape[0], HIDDEN // HEADS
    q = (x @ sd[p + "q_proj.weight"].T).view(n, HEADS, d).transpose(0, 1)
    k = (x @ sd[p + "k_proj.weight"].T).view(n, HEADS // group, d).transpose(0, 1)
    v = (x @ sd[p + "v_proj.weight"].T).view(n, HEADS // group, d).transpose(0, 1)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = (q @ k.transpose(-1, -2)) / d**0.5
    out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    return out.transpose(0, 1).reshape(n, HIDDEN) @ sd[p + "o_proj.weight"].T


def deci_reference(sd: dict, config: dict, ids: list[int], mask: torch.Tensor) -> torch.Tensor:
    """Logits (n, V) of a DeciLM forward over `ids` where query i sees key j iff mask[i, j]."""
    x = sd["model.embed_tokens.weight"][torch.tensor(ids)]
    cos, sin = rope_cos_sin(len(ids))
    for i, b in enumerate(config["block_configs"]):
        p = f"model.layers.{i}."
        attn, ffn = b["attention"], b["ffn"]
        if not attn["no_op"]:
            h = rms(x, sd[p + "input_layernorm.weight"])
            if attn["replace_with_linear"]:
                x = x + h @ sd[p + "self_attn.linear_attn.weight"].T
            else:
                x = x + deci_attention(
                    sd, p + "self_attn.", h, mask, cos, sin, attn["n_heads_in_group"]
                )
        if not ffn["no_op"]:
            h = rms(x, sd[p + "post_attention_layernorm.weight"])
            if ffn["replace_with_linear"]:
                x = x + h @ sd[p + "mlp.linear_mlp.weight"].T
            else:
                gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
                x = x + (nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


def random_checkpoint(config: dict, folder, seed: int = 0) -> dict:
    """Random weights with DeciLM's names and shapes, saved with config.json into `folder`."""
    torch.manual_seed(seed)
    d, shapes = (
        HIDDEN // HEADS,
        {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN)},
    )
    for i, b in enumerate(config["block_configs"]):
        p, attn, ffn = f"model.layers.{i}.", b["attention"], b["ffn"]
        if not attn["no_op"]:
            shapes[p + "input_layernorm.weight"] = (HIDDEN,)
        if attn["replace_with_linear"]:
            shapes[p + "self_attn.linear_attn.weight"] = (HIDDEN, HIDDEN)
        elif not attn["no_op"]:
            kv = HEADS // attn["n_heads_in_group"] * d
            for name, rows in (("q", HIDDEN), ("k", kv), ("v", kv), ("o", HIDDEN)):
                shapes[p + f"self_attn.{name}_proj.weight"] = (rows, HIDDEN)
        if not ffn["no_op"]:
            shapes[p + "post_attention_layernorm.weight"] = (HIDDEN,)
        if ffn["replace_with_linear"]:
            shapes[p + "mlp.linear_mlp.weight"] = (HIDDEN, HIDDEN)
        elif not ffn["no_op"]:
            width = -(-int(2 * ffn["ffn_mult"] * HIDDEN / 3) // 256) * 256
            shapes |= {
                p + "mlp.gate_proj.weight": (width, HIDDEN),
                p + "mlp.up_proj.weight": (width, HIDDEN),
            }
            shapes[p + "mlp.down_proj.weight"] = (HIDDEN, width)
    shapes["model.norm.weight"] = (HIDDEN,)
    sd = {
        n: (1 + 0.2 * torch.randn(s)) if len(s) == 1 else torch.randn(s) * 0.15
        for n, s in shapes.items()
    }
    save_file(sd, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return sd


MIXED = [
    block("gqa", group=1, mult=1.0),  # 4 KV heads, MLP width 256
    block("linear", mult=13.0),  # linear attention, MLP width 512
    block("gqa", group=4, ffn="none"),  # 1 KV head, no feed-forward
    block("none", ffn="linear"),  # no attention, linear feed-forward
    block("gqa", group=2, mult=1.0),
    block("none", ffn="mlp", mult=13.0),
]


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


@dataclass
class DeciTiny(Tiny):
    """A nemotron-nas checkpoint with blocks transformers has no class for: the oracle is
    `deci_reference` on its weights."""

    weights: dict

    def reference(self, ids: list[int], masks=None) -> torch.Tensor:
        mask = causal(len(ids)) if masks is None else masks
        return deci_reference(self.weights, self.family.config, ids, mask)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nas_mixed")
    config = nas_config(MIXED)
    sd = random_checkpoint(config, folder)
    family = Family(None, config, PROMPT, attend_layers=3)  # the three GQA layers
    expected = deci_reference(sd, config, PROMPT, causal(len(PROMPT)))
    return DeciTiny(family, folder, load_kestrel(folder), expected, sd)


@pytest.fixture(scope="module")
def llama_equivalent(tmp_path_factory):
    """A transformers Llama checkpoint and the same weights as an all-normal nemotron-nas one;
    the Tiny's folder is Llama's, for the oracle."""
    llama_dir = tmp_path_factory.mktemp("llama")
    llama = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=3,
        max_position_embeddings=256,
        rope_parameters=ROPE,
        rms_norm_eps=1e-5,
    )
    save_tiny(transformers.LlamaForCausalLM, llama, llama_dir)
    nas_dir = tmp_path_factory.mktemp("nas_normal")
    shutil.copy(llama_dir / "model.safetensors", nas_dir / "model.safetensors")
    config = nas_config([block("gqa", group=2, mult=1.0)] * 3)
    (nas_dir / "config.json").write_text(json.dumps(config))
    family = Family(transformers.LlamaForCausalLM, config, PROMPT, attend_layers=3)
    expected = reference_logits(llama_dir, transformers.LlamaForCausalLM, PROMPT)
    return Tiny(family, llama_dir, load_kestrel(nas_dir), expected)


@pytest.fixture(scope="module", params=["llama_equivalent", "mixed"])
def tiny(request):
    """Normal blocks against transformers' Llama, mixed blocks against `deci_reference`."""
    return request.getfixturevalue(request.param)


kv_chunk = kv_chunks([(chunk, 2) for chunk in (1, 5, 10)])


def test_nemotron_nas_is_registered(mixed):
    assert "nemotron-nas" in supported_architectures()
    assert type(mixed.model).__name__ == "NemotronNasForCausalLM"


def test_reference_equals_transformers_llama_on_normal_blocks(llama_equivalent):
    sd = load_file(llama_equivalent.folder / "model.safetensors")
    config, expected = llama_equivalent.family.config, llama_equivalent.expected
    assert_close(deci_reference(sd, config, PROMPT, causal(len(PROMPT))), expected)


def test_kv_bytes_count_only_gqa_layers_with_their_own_heads(mixed):
    model = mixed.model
    assert model.kv_bytes_per_token(torch.float32) == 2 * (4 + 1 + 2) * 8 * 4
    assert [s.kind for s in model.cache_specs()] == ["full", "none", "full", "none", "full", "none"]

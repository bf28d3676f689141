"""The `--shape` random-weight models of the seed families' released sizes: their configs carry
the published dimensions, each family's kestrel model accepts them (built scaled down on the CPU,
never at full size), and the roofline counts the weights a decoded token reads."""

from argparse import Namespace

import pytest
import torch
import transformers

from kestrel.bench.offline import Workload
from kestrel.bench.roofline import (
    active_bytes_per_token,
    active_weight_bytes,
    ceilings,
    meta_model,
)
from kestrel.cache.sequence import SequenceCache
from kestrel.models.batch import ForwardBatch
from kestrel.weights.loader import build_model
from kestrel.weights.shapes import SHAPES, decoder_config, randomize, shape_config

BF16 = torch.bfloat16
QWEN_ROPE = {"rope_type": "default", "rope_theta": 5e6, "mrope_interleaved": True}

# Each seed shape shrunk for one CPU forward: widths, heads, experts and layers cut, every kind of
# layer, cache and routing kept (test_scaled_shape_keeps_the_structure holds them to that).
SMALL = {
    "qwen3-vl-30b-a3b": dict(
        text_config=dict(
            vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
            num_experts=8, num_experts_per_tok=2,
            rope_parameters={**QWEN_ROPE, "mrope_section": [3, 3, 2]},
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
            deepstack_visual_indexes=[0, 1],
        ),
    ),
    "glm-4.7-flash": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, mlp_layer_types=["dense", "sparse", "sparse"],
    ),
    "gemma4-26b-a4b": dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1, head_dim=16,
        global_head_dim=32, sliding_window=8, layer_types=SHAPES["gemma4-26b-a4b"]["layer_types"][:6],
        num_experts=8, top_k_experts=2, moe_intermediate_size=32,
    ),
    "gemma4-31b": dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1, head_dim=16,
        global_head_dim=32, sliding_window=8, layer_types=SHAPES["gemma4-31b"]["layer_types"][:6],
    ),
    "nemotron-h-8b": dict(
        vocab_size=512, hidden_size=64, hybrid_override_pattern="M-M*-M-", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=4,
    ),
    "minicpm3-4b": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
    ),
    "nemotron-nas-49b": dict(  # one layer of each kind the 49B has: GQA + MLP, no attention + MLP
        vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        block_configs=[
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 5.25}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.3125}},
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 0.5}},
        ],
    ),
    "jamba-v0.1": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, mamba_dt_rank=8,
    ),
}  # fmt: skip
SEED_SHAPES = sorted(SMALL)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_shape_builds_its_config_and_family_at_full_size_on_meta(name):
    fields = SHAPES[name]
    config = shape_config(name)
    assert config.model_type == fields["model_type"]
    text, published = decoder_config(config), fields.get("text_config", fields)
    assert (text.vocab_size, text.hidden_size) == (
        published["vocab_size"],
        published["hidden_size"],
    )
    model = meta_model(config, BF16)  # the family's whole model, shapes only
    tables = [m.weight.shape for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    assert (text.vocab_size, text.hidden_size) in tables
    assert len(model.cache_specs()) == text.num_hidden_layers


def test_unknown_shape_error_lists_the_seed_shapes():
    with pytest.raises(SystemExit) as error:
        shape_config("llama-9000")
    assert all(name in str(error.value) for name in SEED_SHAPES)


def test_bench_help_lists_the_seed_shapes(capsys):
    from kestrel.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(name in help_text for name in SEED_SHAPES)


# -- the published dimensions against a second source -----------------------------------------

# transformers' config classes whose defaults are the released checkpoint's (their docstrings
# and comments name it): every default the shape shares must be the shape's value
RELEASED_DEFAULTS = {
    "glm-4.7-flash": transformers.Glm4MoeLiteConfig,  # zai-org/GLM-4.7-Flash
    "minicpm3-4b": transformers.MiniCPM3Config,  # openbmb/MiniCPM3-4B
    "jamba-v0.1": transformers.JambaConfig,  # ai21labs/Jamba-v0.1
}
DIMENSIONS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
    "n_shared_experts", "num_experts", "num_experts_per_tok", "routed_scaling_factor",
    "max_position_embeddings", "scale_emb", "scale_depth", "dim_model_base",
    "attn_layer_period", "attn_layer_offset", "expert_layer_period", "expert_layer_offset",
    "mamba_d_state", "mamba_d_conv", "mamba_expand", "mlp_layer_types",
)  # fmt: skip


@pytest.mark.parametrize("name", sorted(RELEASED_DEFAULTS))
def test_shape_matches_the_released_defaults_of_transformers(name):
    config, defaults = shape_config(name), RELEASED_DEFAULTS[name]()
    shared = [key for key in DIMENSIONS if hasattr(defaults, key)]
    assert len(shared) >= 8
    assert {k: getattr(config, k) for k in shared} == {k: getattr(defaults, k) for k in shared}


def test_qwen3_vl_vision_tower_matches_the_released_defaults():
    """Qwen3VLMoeVisionConfig's defaults are the 30B-A3B's tower, but for its output width, which
    is the decoder's hidden size (2048)."""
    vision = shape_config("qwen3-vl-30b-a3b").vision_config
    defaults = transformers.Qwen3VLMoeConfig().vision_config
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size",
                "num_position_embeddings"):  # fmt: skip
        assert getattr(vision, key) == getattr(defaults, key)
    assert tuple(vision.deepstack_visual_indexes) == tuple(defaults.deepstack_visual_indexes)
    assert vision.out_hidden_size == decoder_config(shape_config("qwen3-vl-30b-a3b")).hidden_size


def test_nemotron_h_8b_matches_the_nemotron_h_defaults():
    """NemotronHConfig's defaults share Nemotron-H-8B's widths and Mamba2 mixer."""
    config, defaults = shape_config("nemotron-h-8b"), transformers.NemotronHConfig()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "mamba_num_heads", "mamba_head_dim",
                "n_groups", "ssm_state_size", "conv_kernel", "chunk_size"):  # fmt: skip
        assert getattr(config, key) == getattr(defaults, key)
    types = config.layers_block_type  # 52 layers: 24 Mamba2, 24 MLP, 4 attention
    assert len(types) == 52 and types.count("full_attention") == 4
    assert types.count("linear_attention") == types.count("mlp") == 24


def test_nemotron_super_49b_blocks():
    """80 blocks: 49 GQA layers (8 query heads per KV head), 31 without attention; 49.9B weights."""
    config = shape_config("nemotron-nas-49b")
    blocks = meta_model(config, BF16).model.blocks
    assert len(blocks) == 80 and {b.ffn for b in blocks} == {"mlp"}
    assert [b.kv_heads for b in blocks if b.attention == "gqa"] == [8] * 49
    assert sum(b.attention == "none" for b in blocks) == 31
    assert {b.intermediate for b in blocks} >= {28672, 14336, 2816}  # ffn_mult 5.25, 2.625, 0.5
    params = sum(p.numel() for p in meta_model(config, BF16).parameters())
    assert params == pytest.approx(49.87e9, rel=1e-3)


def test_qwen3_vl_30b_a3b_decoder_counts_match_the_model_card():
    """Qwen3-30B-A3B (the same decoder): 30.5B parameters, 3.3B activated per token."""
    model = meta_model(shape_config("qwen3-vl-30b-a3b"), BF16)
    decoder = model.model.language_model
    total = sum(p.numel() for p in decoder.parameters()) + model.lm_head.weight.numel()
    assert total == pytest.approx(30.5e9, rel=0.01)
    # the card counts the embedding table whole; the roofline reads one row of it
    active = active_weight_bytes(model) / 2 + decoder.embed_tokens.weight.numel() - 2048
    assert active == pytest.approx(3.3e9, rel=0.02)


# -- each family accepts its shape ----------------------------------------------------------------


def small_model(name: str):
    torch.manual_seed(0)
    model = build_model(shape_config(name, **SMALL[name]), torch.float32, torch.device("cpu"))
    randomize(model)
    return model


def forward(model, cache: SequenceCache, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ForwardBatch.single(cache, torch.tensor(ids)))
    cache.advance(len(ids))
    return logits


@pytest.mark.parametrize("name", SEED_SHAPES)
def test_scaled_shape_keeps_the_structure(name):
    """The scaled config builds the same kinds of layers, caches and experts as the full one."""
    full, small = meta_model(shape_config(name), BF16), small_model(name)
    assert {type(m) for m in small.modules()} == {type(m) for m in full.modules()}
    assert {s.kind for s in small.cache_specs()} == {s.kind for s in full.cache_specs()}


@pytest.mark.parametrize("name", SEED_SHAPES)
def test_scaled_shape_prefills_and_decodes_on_the_cpu(name):
    """The family runs the shape's config: a prompt's logits, then a decoded token's, equal those
    of one forward over both."""
    model = small_model(name)
    ids = [300, 301, 302, 303, 304, 305]
    whole = forward(model, SequenceCache(model.cache_specs()), ids)
    cache = SequenceCache(model.cache_specs())
    prefill, step = forward(model, cache, ids[:-1]), forward(model, cache, ids[-1:])
    vocab = SMALL[name].get("text_config", SMALL[name])["vocab_size"]
    assert whole.shape == (6, vocab) and torch.isfinite(whole).all()
    torch.testing.assert_close(torch.cat([prefill, step]), whole, rtol=1e-4, atol=1e-4)


# -- the roofline: weight bytes a decoded token reads ----------------------------------------------


def test_active_bytes_of_a_dense_shape_by_hand():
    """llama3-8b: every layer whole, the untied head whole, one embedding row."""
    H, F, L, V, KV = 4096, 14336, 32, 128256, 1024
    layer = 2 * H * H + 2 * H * KV + 3 * H * F + 2 * H  # q, o; k, v; gate, up, down; 2 norms
    expected = (L * layer + H + V * H + H) * 2  # + final norm, head, one embedding row; bf16
    assert active_bytes_per_token(shape_config("llama3-8b"), BF16) == expected


def test_active_bytes_of_a_moe_shape_by_hand():
    """qwen3-vl-30b-a3b: per layer attention, router and 8 of 128 experts; no vision tower."""
    H, L, V, E, k, F = 2048, 48, 151936, 128, 8, 768
    attention = H * 32 * 128 * 2 + H * 4 * 128 * 2 + 2 * 128  # q, o; k, v; q/k norms
    experts = E * 3 * H * F
    layer = attention + 2 * H + E * H  # + 2 norms, router
    expected = (L * (layer + experts * k / E) + H + V * H + H) * 2
    config = shape_config("qwen3-vl-30b-a3b")
    assert active_bytes_per_token(config, BF16) == pytest.approx(expected, rel=1e-12)
    # a batch of two reads the union of its experts: all but those neither token chose
    two = (L * (layer + experts * (1 - (1 - k / E) ** 2)) + 2 * H + V * H + H) * 2
    assert active_weight_bytes(meta_model(config, BF16), 2) == pytest.approx(two, rel=1e-12)


def test_decode_ceiling_counts_active_not_total_weights():
    model = small_model("qwen3-vl-30b-a3b")
    kv = model.kv_bytes_per_token(torch.float32)
    args = Namespace(bandwidth=1e12, flops=1e15)
    work = Workload(num_requests=1, prompt_tokens=100, output_tokens=8)
    numbers = ceilings(args, model, kv, torch.float32, work, 1)
    active = active_weight_bytes(model)
    assert numbers["active_weight_bytes"] == active < numbers["weight_bytes"] / 2
    assert numbers["ceiling_decode_tok_s"] == pytest.approx(1e12 / (active + kv * 100))


# -- the transformers peer of `kestrel bench --peer transformers` ------------------------------------


def test_peer_of_a_vision_language_shape_generates_from_text():
    """No transformers causal-LM class takes Qwen3-VL-MoE's config: the peer is its
    image-text-to-text model, which generates from token ids alone (one stream and a batch)."""
    from kestrel.bench.offline import peer_latency, peer_model, peer_throughput

    config = shape_config("qwen3-vl-30b-a3b", **SMALL["qwen3-vl-30b-a3b"])
    model = peer_model(config, torch.float32, torch.device("cpu"), seed=0)
    one = peer_latency(model, Workload(1, 6, 3), 512, torch.device("cpu"))
    assert one["decode_tok_s"] > 0
    batch = peer_throughput(model, Workload(2, 6, 3), 512, torch.device("cpu"))
    assert batch["generated_tokens"] == 6


def test_peer_without_a_transformers_class_is_reported_per_mode(tmp_path):
    """transformers has no nemotron-nas class: each peer record carries the error and the shape's
    ceilings, and the run goes on (kestrel's own records come next)."""
    import json

    from kestrel.bench.offline import _run_peer

    out = tmp_path / "peer.jsonl"
    args = Namespace(shape="nemotron-nas-49b", seed=0, bandwidth=4.25e12, flops=786e12)
    modes, one, many = ["latency", "throughput"], Workload(1, 128, 4), Workload(4, 64, 4)
    with out.open("w") as sink:
        _run_peer("transformers", args, BF16, torch.device("cpu"), modes, one, many, {}, sink)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mode"] for r in records] == modes
    assert all("no generating model for 'nemotron-nas'" in r["error"] for r in records)
    active = active_bytes_per_token(shape_config("nemotron-nas-49b"), BF16)
    assert records[0]["active_weight_bytes"] == active
    kv = meta_model(shape_config("nemotron-nas-49b"), BF16).kv_bytes_per_token(BF16)
    assert records[0]["ceiling_decode_tok_s"] == pytest.approx(4.25e12 / (active + kv * 128))
    assert records[1]["ceiling_output_tok_s"] > 0


def test_peer_whose_continuous_batching_fails_generates_in_fixed_batches():
    """transformers' `generate_batch` has no cache for Nemotron-H's Mamba layers: the peer's batch
    then runs through `generate()`, a batch at a time, and the record says so and why."""
    from kestrel.bench.offline import peer_model, peer_throughput

    config = shape_config("nemotron-h-8b", **SMALL["nemotron-h-8b"])
    model = peer_model(config, torch.float32, torch.device("cpu"), seed=0)
    batch = peer_throughput(model, Workload(3, 6, 4), 512, torch.device("cpu"))
    assert batch["generated_tokens"] == 12 and batch["output_tok_s"] > 0
    assert batch["peer_mode"].startswith("generate()") and batch["peer_failed"]
    assert batch["peer_requests"] == 3


def test_generate_peer_stops_starting_batches_past_its_time_limit():
    """The generate() peer runs whole batches (the last one short) and, past its time limit,
    starts no new one: its rate is over the requests it ran, and the record counts them."""
    from kestrel.bench.offline import _batched_generate, peer_model

    config = shape_config("nemotron-h-8b", **SMALL["nemotron-h-8b"])
    model = peer_model(config, torch.float32, torch.device("cpu"), seed=0)
    cpu, work = torch.device("cpu"), Workload(3, 6, 4)
    every = _batched_generate(model, work, 512, cpu, batch=2)
    assert (every["peer_requests"], every["generated_tokens"]) == (3, 12)
    first = _batched_generate(model, work, 512, cpu, batch=2, time_limit=0)
    assert (first["peer_requests"], first["generated_tokens"]) == (2, 8)
    assert first["total_tok_s"] == pytest.approx((8 + 2 * 6) / first["elapsed_s"])

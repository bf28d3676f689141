"""Random-weight models of named shapes (`--shape llama3-8b`) for benchmarks and smoke runs.

A shape is a model_type plus the config fields of its Hugging Face config.json (a multimodal
checkpoint's nested `text_config`/`vision_config` as nested dicts). The seed families' shapes carry
the published dimensions of their released models; each entry names where the numbers come from.
Its tokenizer is synthetic: byte-level BPE with exactly the shape's vocabulary (256 byte tokens,
BOS/EOS, then " t<id>" words), so a server can encode text, apply a chat template and stream every
generated id as text, as it would for a real checkpoint of that vocabulary.
"""

# nvidia/Llama-3_3-Nemotron-Super-49B-v1 config.json `block_configs`, run-length encoded:
# (query heads per KV head, None = attention no_op; ffn_mult; how many layers in a row).
# 80 layers; every FFN is a gated MLP. Read from the config.json that NVIDIA's NeMo
# (llm/gpt/model/llama_nemotron_config.py) copies from the Hub.
NEMOTRON_SUPER_49B_BLOCKS = [
    (8, 2.625, 1), (8, 5.25, 5), (None, 2.625, 2), (8, 5.25, 3), (None, 3.28125, 1),
    (8, 5.25, 30), (None, 1.3125, 1), (None, 2.625, 2), (None, 1.3125, 1), (None, 5.25, 1),
    (None, 1.3125, 1), (None, 2.625, 1), (None, 1.3125, 3), (8, 5.25, 1), (None, 1.3125, 1),
    (None, 1.0, 2), (None, 1.3125, 1), (None, 1.0, 3), (None, 1.3125, 2), (None, 0.5, 2),
    (None, 1.0, 2), (None, 0.5, 2), (None, 1.0, 1), (None, 0.5, 2), (8, 5.25, 9),
]  # fmt: skip


def nas_block_configs(runs: list[tuple[int | None, float, int]]) -> list[dict]:
    """`block_configs` entries, as DeciLM checkpoints write them, from (group, ffn_mult, n) runs."""
    blocks = []
    for group, mult, count in runs:
        attention = {
            "n_heads_in_group": group,
            "no_op": group is None,
            "replace_with_linear": False,
        }
        ffn = {"ffn_mult": mult, "no_op": False, "replace_with_linear": False}
        blocks += [{"attention": dict(attention), "ffn": dict(ffn)} for _ in range(count)]
    return blocks


def gemma4_layer_types(layers: int) -> list[str]:
    """Gemma 4's 5 sliding : 1 full pattern, the last layer full (as the released configs list)."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]


# Gemma 4 text decoders: the fields the 26B-A4B and 31B text_configs share
GEMMA4_TEXT = dict(
    model_type="gemma4_text",
    vocab_size=262144,
    head_dim=256,
    global_head_dim=512,
    attention_k_eq_v=True,
    hidden_activation="gelu_pytorch_tanh",
    hidden_size_per_layer_input=0,  # no per-layer embeddings (those are the E2B/E4B models)
    num_kv_shared_layers=0,
    use_double_wide_mlp=False,
    sliding_window=1024,
    final_logit_softcapping=30.0,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
        },
    },
)

# meta-llama/Llama-3.1-8B; the other Llama 3 shapes differ from it only where listed
LLAMA3_8B = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)

# model_type + config fields of the named shapes (as in their Hugging Face config.json)
SHAPES = {
    "llama3-8b": LLAMA3_8B,
    # Llama-3.1-70B: 141 GB in bf16, more than one H200 holds (-tp 2 or -pp 2 over two)
    "llama3-70b": dict(
        LLAMA3_8B,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
    ),
    # Llama-3.2-1B: the usual draft model for Llama-3.1-8B (the same tokenizer)
    "llama3.2-1b": dict(
        LLAMA3_8B,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        head_dim=64,
        tie_word_embeddings=True,
        rope_scaling=dict(LLAMA3_8B["rope_scaling"], factor=32.0),
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "tiny": dict(  # for CPU smoke runs and tests
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    ),
    # Qwen/Qwen3-VL-30B-A3B-Instruct config.json (its text_config and vision_config); the
    # vision tower is built too (the family serves images) but a text token never reads it
    "qwen3-vl-30b-a3b": dict(
        model_type="qwen3_vl_moe",
        tie_word_embeddings=False,
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        text_config=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,  # unused: every layer is sparse (decoder_sparse_step 1)
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            hidden_act="silu",
            attention_bias=False,
            rms_norm_eps=1e-6,
            max_position_embeddings=262144,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            hidden_act="gelu_pytorch_tanh",
            in_channels=3,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=2048,
            num_position_embeddings=2304,
            deepstack_visual_indexes=[8, 16, 24],
        ),
    ),
    # zai-org/GLM-4.7-Flash config.json (as vLLM's glm4_moe_lite config test copies it; the same
    # numbers are transformers' Glm4MoeLiteConfig defaults): MLA, layer 0 dense, 46 MoE layers
    "glm-4.7-flash": dict(
        model_type="glm4_moe_lite",
        vocab_size=154880,
        hidden_size=2048,
        intermediate_size=10240,
        moe_intermediate_size=1536,
        num_hidden_layers=47,
        num_attention_heads=20,
        num_key_value_heads=20,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        attention_bias=False,
        max_position_embeddings=202752,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rope_interleave=True,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        routed_scaling_factor=1.8,
        n_group=1,
        topk_group=1,
        mlp_layer_types=["dense"] + ["sparse"] * 46,  # first_k_dense_replace 1
        tie_word_embeddings=False,
    ),
    # google/gemma-4-26B-A4B text_config: every layer has a dense MLP and 128 experts beside it
    "gemma4-26b-a4b": dict(
        GEMMA4_TEXT,
        hidden_size=2816,
        intermediate_size=2112,
        num_hidden_layers=30,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_global_key_value_heads=2,
        layer_types=gemma4_layer_types(30),
        enable_moe_block=True,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=704,
    ),
    # google/gemma-4-31B text_config: dense
    "gemma4-31b": dict(
        GEMMA4_TEXT,
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=60,
        num_attention_heads=32,
        num_key_value_heads=16,
        num_global_key_value_heads=4,
        layer_types=gemma4_layer_types(60),
        enable_moe_block=False,
    ),
    # nvidia/Nemotron-H-8B-Base-8K config.json: 24 Mamba2 (M), 24 squared-ReLU MLP (-), 4 attention (*)
    "nemotron-h-8b": dict(
        model_type="nemotron_h",
        vocab_size=131072,
        hidden_size=4096,
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,  # config.json: attention_head_dim
        intermediate_size=21504,
        mlp_hidden_act="relu2",
        mlp_bias=False,
        mamba_num_heads=128,
        mamba_head_dim=64,
        mamba_hidden_act="silu",
        n_groups=8,
        ssm_state_size=128,
        conv_kernel=4,
        expand=2,
        chunk_size=128,
        use_conv_bias=True,
        use_bias=False,
        layer_norm_epsilon=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    # openbmb/MiniCPM3-4B (transformers' MiniCPM3Config defaults are this checkpoint's). The
    # checkpoint's LongRoPE factor lists were not found; plain RoPE (theta 1e4) stands in: the
    # same work per token, and LongRoPE's short factors apply anyway below 32768 tokens
    "minicpm3-4b": dict(
        model_type="minicpm3",
        vocab_size=73448,
        hidden_size=2560,
        intermediate_size=6400,
        num_hidden_layers=62,
        num_attention_heads=40,
        num_key_value_heads=40,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        q_lora_rank=768,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        scale_emb=12,
        scale_depth=1.4,
        dim_model_base=256,
        tie_word_embeddings=True,
    ),
    # nvidia/Llama-3_3-Nemotron-Super-49B-v1 config.json (DeciLM): 49.9B parameters, bf16 fits
    # one H200
    "nemotron-nas-49b": dict(
        model_type="nemotron-nas",
        vocab_size=128256,
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=None,
        block_configs=nas_block_configs(NEMOTRON_SUPER_49B_BLOCKS),
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
    ),
    # ai21labs/Jamba-v0.1 (transformers' JambaConfig defaults are this checkpoint's): attention
    # every 8th layer from 4, a 16-expert top-2 MoE every 2nd layer from 1, Mamba elsewhere
    "jamba-v0.1": dict(
        model_type="jamba",
        vocab_size=65536,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        attn_layer_period=8,
        attn_layer_offset=4,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=16,
        num_experts_per_tok=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=256,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        tie_word_embeddings=False,
    ),
}
BOS, EOS = "<|bos|>", "<|eos|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def shape_config(name: str, **overrides):
    """transformers' config of a named shape; `overrides` replace its fields (for a nested
    `text_config`/`vision_config`, a dict updates the shape's one), e.g. to shrink it for a test."""
    from transformers import AutoConfig

    from kestrel.models.registry import model_class

    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    fields = {**SHAPES[name]}
    for key, value in overrides.items():
        nested = isinstance(value, dict) and isinstance(fields.get(key), dict)
        fields[key] = {**fields[key], **value} if nested and key.endswith("_config") else value
    model_type = fields.pop("model_type")
    model_class(model_type)  # a family whose config transformers lacks registers it on import
    # the synthetic tokenizer's special ids (byte tokens take 0..255)
    special = dict(bos_token_id=256, eos_token_id=257)
    if "text_config" in fields:
        fields["text_config"] = {**fields["text_config"], **special}
    return AutoConfig.for_model(model_type, **special, **fields)


def decoder_config(config):
    """The config of the text decoder: a multimodal config's `text_config`, else the config."""
    return config.get_text_config()


def random_model(name: str, dtype, device, seed: int = 0, select=None, mtp: bool = False):
    """(model, config): random weights of the named shape, built on `device`; `select(model)`:
    names of parameters left on the meta device (a pipeline stage's other layers, as
    weights.loader.load_model leaves them); `mtp`: with a multi-token-prediction layer."""
    import torch

    from kestrel.weights.loader import build_model

    config = shape_config(name)
    torch.manual_seed(seed)
    if select is None:
        model = build_model(config, dtype, device, mtp=mtp)
    else:
        model = build_model(config, dtype, device, empty=True, mtp=mtp)
        _materialize(model, device, set(select(model)))
    randomize(model)
    return model, config


def fill_random(model, device, names: set[str]) -> None:
    """The meta parameters `names` of a shape built with `select`, materialized and randomized
    (a later group of `loading.load_in_groups`; the same values on every rank)."""
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    _materialize(model, device, every - names)
    randomize(model, names)


def _materialize(model, device, skip: set[str]) -> None:
    """Every parameter not in `skip` moves from the meta device to `device` (uninitialized; a
    parameter under several names once)."""
    import torch
    from torch import nn

    done: dict[int, nn.Parameter] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if name in skip or not p.is_meta:
            continue
        if id(p) not in done:
            done[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=False)
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, done[id(p)])


def randomize(model, names: set[str] | None = None) -> None:
    """Random weights for every parameter (`names`: only those)."""
    import torch

    # small normal weights keep activations finite through many layers of random matrices
    with torch.no_grad():
        for name, p in model.named_parameters():
            if names is not None and name not in names:
                continue
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)


def shape_tokenizer(vocab_size: int):
    """Byte-level BPE over exactly `vocab_size` ids; every id decodes to non-empty text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte-level characters
    tokens = [*alphabet, BOS, EOS]
    tokens += [f"\u0120t{i}" for i in range(len(tokens), vocab_size)]  # "\u0120" = a space
    vocab = {t: i for i, t in enumerate(tokens[:vocab_size])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, chat_template=CHAT_TEMPLATE
    )


def load_shape(name: str, dtype, device, seed: int = 0, select=None, mtp: bool = False):
    """(model, tokenizer) of a named random shape, as weights.loader.load gives a checkpoint's
    (`select` and `mtp` as `random_model`)."""
    model, config = random_model(name, dtype, device, seed, select, mtp)
    return model, shape_tokenizer(decoder_config(config).vocab_size)

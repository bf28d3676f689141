"""Random-weight models of named shapes (`--shape llama3-8b`) for benchmarks and smoke runs.

A shape is a model_type plus the config fields of its Hugging Face config.json. Its tokenizer is
synthetic: byte-level BPE with exactly the shape's vocabulary (256 byte tokens, BOS/EOS, then
" t<id>" words), so a server can encode text, apply a chat template and stream every generated
id as text, as it would for a real checkpoint of that vocabulary.
"""

# model_type + config fields of the named shapes (as in their Hugging Face config.json)
SHAPES = {
    "llama3-8b": dict(
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
}
BOS, EOS = "<|bos|>", "<|eos|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def shape_config(name: str):
    from transformers import AutoConfig

    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    fields = dict(SHAPES[name])
    model_type = fields.pop("model_type")
    # the synthetic tokenizer's special ids (byte tokens take 0..255)
    return AutoConfig.for_model(model_type, bos_token_id=256, eos_token_id=257, **fields)


def random_model(name: str, dtype, device, seed: int = 0):
    """(model, config): random weights of the named shape, built on `device`."""
    import torch

    from kestrel.weights.loader import build_model

    config = shape_config(name)
    torch.manual_seed(seed)
    model = build_model(config, dtype, device)
    randomize(model)
    return model, config


def randomize(model) -> None:
    import torch

    # small normal weights keep activations finite through many layers of random matrices
    with torch.no_grad():
        for name, p in model.named_parameters():
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


def load_shape(name: str, dtype, device, seed: int = 0):
    """(model, tokenizer) of a named random shape, as weights.loader.load gives a checkpoint's."""
    model, config = random_model(name, dtype, device, seed)
    return model, shape_tokenizer(config.vocab_size)

"""GGUF files of gemma4, exaone-moe and deci (nemotron-nas), written from tiny random checkpoints
the way llama.cpp's converter writes them (tests/gguf_writer.py): kestrel's logits from the GGUF
equal the oracle's on the Hugging Face checkpoint, and transformers' own GGUF loader where it
reads the file; an architecture no family serves fails with a clear error."""

import gguf
import pytest
import torch
import transformers
from tests.family_suite import one_thread  # noqa: F401  (tiny tensors: one thread is faster)
from tests.gguf_writer import state_dict, write_gguf, write_vocab
from tests.reference import (
    assert_close,
    assert_differ,
    chunked_logits,
    load_kestrel,
    reference_logits,
    save_tiny,
)
from tests.test_models_exaone_moe import CONFIG as EXAONE_CONFIG
from tests.test_models_exaone_moe import _randomize_correction_bias
from tests.test_models_gemma4 import COMMON as GEMMA4_COMMON
from tests.test_models_gemma4 import VARIANTS as GEMMA4_VARIANTS
from tests.test_models_gemma4 import _randomize_scalars
from tests.test_models_nemotron_nas import (
    PROMPT,
    block,
    causal,
    deci_reference,
    nas_config,
    random_checkpoint,
)

from kestrel.errors import KestrelError
from kestrel.weights.loader import load_model, load_tokenizer, resolve


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path / "cache"))


def load_gguf(path):
    return load_model(resolve(str(path)), torch.float32, torch.device("cpu"), progress=False)


def hf_state(model_cls, folder) -> dict:
    return state_dict(model_cls.from_pretrained(folder, torch_dtype=torch.float32))


def check_gguf(gguf_path, folder, expected, atol=None):
    """kestrel on the GGUF (full prompt and chunked) equals `expected` and kestrel on the folder;
    the config rebuilt from metadata drives the same model."""
    model = load_gguf(gguf_path)
    assert_close(chunked_logits(model, PROMPT, len(PROMPT)), expected)
    assert_close(chunked_logits(model, PROMPT, 5), expected)
    assert_close(chunked_logits(model, PROMPT, 7), chunked_logits(load_kestrel(folder), PROMPT, 7))
    return model


# --- gemma4 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(GEMMA4_VARIANTS))
def test_gemma4_gguf_matches_transformers(variant, tmp_path):
    config = transformers.Gemma4TextConfig(**GEMMA4_COMMON, **GEMMA4_VARIANTS[variant])
    folder = save_tiny(
        transformers.Gemma4ForCausalLM, config, tmp_path / "hf", tweak=_randomize_scalars
    )
    expected = reference_logits(folder, transformers.Gemma4ForCausalLM, PROMPT)
    state = hf_state(transformers.Gemma4ForCausalLM, folder)
    path = write_gguf(tmp_path / "gemma4.gguf", "gemma4", state, config)
    model = check_gguf(path, folder, expected)
    c = model.config
    assert (c.layer_types, c.num_kv_shared_layers, c.attention_k_eq_v) == (
        config.layer_types,
        config.num_kv_shared_layers,
        config.attention_k_eq_v,
    )


# --- exaone-moe -------------------------------------------------------------------------------


def test_exaone_moe_gguf_matches_transformers(tmp_path):
    # llama.cpp writes a leading dense block count: dense layers come first
    config = transformers.ExaoneMoeConfig(
        **{**EXAONE_CONFIG, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"]}
    )
    cls = transformers.ExaoneMoeForCausalLM
    folder = save_tiny(cls, config, tmp_path / "hf", tweak=_randomize_correction_bias)
    expected = reference_logits(folder, cls, PROMPT)
    path = write_gguf(tmp_path / "exaone.gguf", "exaone-moe", hf_state(cls, folder), config)
    model = check_gguf(path, folder, expected)
    assert model.config.mlp_layer_types == config.mlp_layer_types
    assert model.config.layer_types == config.layer_types


# --- deci (nemotron-nas) ----------------------------------------------------------------------

# the block kinds llama.cpp's deci graph has: GQA with its own grouping, linear and no-op
# attention, MLPs of their own width and no-op feed-forwards
DECI_BLOCKS = [
    block("gqa", group=1, mult=1.0),
    block("linear", mult=13.0),
    block("gqa", group=4, ffn="none"),
    block("none", ffn="mlp", mult=13.0),
    block("gqa", group=2, mult=1.0),
]


def test_deci_gguf_matches_reference(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    config = nas_config(DECI_BLOCKS)
    sd = random_checkpoint(config, folder)
    expected = deci_reference(sd, config, PROMPT, causal(len(PROMPT)))
    hf_config = load_kestrel(folder).config
    path = write_gguf(tmp_path / "deci.gguf", "deci", sd, hf_config)
    model = check_gguf(path, folder, expected)
    assert [b for b in model.model.blocks] == [b for b in load_kestrel(folder).model.blocks]


# --- quantized, tokenizer, errors -------------------------------------------------------------


def q8_0_roundtrip(t: torch.Tensor) -> torch.Tensor:
    """The values a Q8_0 tensor holds, where the writer quantizes it (rows of 32)."""
    if t.dim() < 2 or t.shape[-1] % 32:
        return t
    qtype = gguf.GGMLQuantizationType.Q8_0
    data = gguf.quants.quantize(t.float().numpy(), qtype)
    return torch.from_numpy(gguf.quants.dequantize(data, qtype)).reshape(t.shape)


def test_q8_0_gguf_equals_its_dequantized_weights(tmp_path):
    # Q8_0 blocks dequantize in the right layout: the Q8_0 file equals an F32 file of the values
    # it holds, and differs from the unquantized weights
    (tmp_path / "hf").mkdir()
    sd = random_checkpoint(nas_config(DECI_BLOCKS), tmp_path / "hf")
    config = load_kestrel(tmp_path / "hf").config
    q8 = load_gguf(write_gguf(tmp_path / "q.gguf", "deci", sd, config, "Q8_0"))
    held = {k: q8_0_roundtrip(v) for k, v in sd.items()}
    f32 = load_gguf(write_gguf(tmp_path / "f.gguf", "deci", held, config))
    q8_logits = chunked_logits(q8, PROMPT, 30)
    assert_close(q8_logits, chunked_logits(f32, PROMPT, 30))
    assert_differ(q8_logits, deci_reference(sd, nas_config(DECI_BLOCKS), PROMPT, causal(30)))


@pytest.mark.parametrize("arch", ["deci", "exaone-moe", "gemma4"])
def test_tokenizer_loads_from_each_family_gguf(arch, tmp_path):
    # the writer's vocabulary: sentencepiece ("llama") for deci/gemma4, byte-level BPE for exaone
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    write_vocab(writer, 128, "gpt2" if arch == "exaone-moe" else "llama")
    writer.add_tensor("token_embd.weight", torch.zeros(128, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer = load_tokenizer(resolve(str(path)))
    ids = tokenizer.encode(" ab", add_special_tokens=False)
    assert len(ids) >= 2 and tokenizer.eos_token == "</s>"
    assert tokenizer.decode(ids).strip() == "ab"


def test_unsupported_gguf_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(KestrelError, match="architecture bert is not supported"):
        load_gguf(path)

"""GGUF weights kept quantized on the CPU (models/layers/quant.py): per type, a tiny llama written
in that type gives the logits of the same file dequantized at load, from packed layers that hold
the file's bytes; a tied head reads its embedding's bytes; bad quantized files fail naming the
tensor."""

import logging

import gguf
import numpy as np
import pytest
import torch
import transformers
from tests.family_suite import one_thread  # noqa: F401  (tiny tensors: one thread is faster)
from tests.gguf_writer import random_blocks, state_dict, write_gguf
from tests.reference import assert_close, chunked_logits
from tests.test_models_exaone_moe import CONFIG as EXAONE_CONFIG

from kestrel.errors import ModelLoadError, UnsupportedModelError
from kestrel.kernels.quant import BLOCKS
from kestrel.models.layers.moe import PackedStack
from kestrel.models.layers.quant import QuantEmbedding, QuantLinear
from kestrel.weights.loader import load_model, resolve

T = gguf.GGMLQuantizationType
PROMPT = [1, 5, 9, 30, 31, 40, 2, 7, 12, 50, 3, 8]
# rows of 256: every type's blocks fit (k-quants hold 256 elements a block)
CONFIG = dict(
    vocab_size=320,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path / "cache"))


def tiny_llama_gguf(path, quant: str, tied: bool = True):
    config = transformers.LlamaConfig(**CONFIG, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    return write_gguf(path, "llama", state_dict(model), config, quant)


def load(path, packed: bool):
    return load_model(
        resolve(str(path)), torch.float32, torch.device("cpu"), progress=False, packed=packed
    )


def resident_bytes(model) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("quant", sorted(BLOCKS))
def test_packed_logits_equal_dequantized_at_load(quant, tmp_path):
    path = tiny_llama_gguf(tmp_path / f"{quant}.gguf", quant)
    packed, dense = load(path, packed=True), load(path, packed=False)
    expected = chunked_logits(dense, PROMPT, len(PROMPT))
    assert expected.abs().max() > 0.1  # the random blocks give non-trivial logits
    assert_close(chunked_logits(packed, PROMPT, len(PROMPT)), expected)
    assert_close(chunked_logits(packed, PROMPT, 5), expected)
    # every matrix stays in its blocks: q/k rows reordered, embedding and tied head shared
    layers = [m for m in packed.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 7 + 1 and {m.qtype for m in layers} == {quant}
    embed = packed.model.embed_tokens
    assert isinstance(embed, QuantEmbedding) and packed.lm_head.qweight is embed.qweight
    assert resident_bytes(packed) < resident_bytes(dense) / 3


def test_untied_head_is_its_own_packed_tensor(tmp_path):
    path = tiny_llama_gguf(tmp_path / "q8.gguf", "Q8_0", tied=False)
    packed, dense = load(path, packed=True), load(path, packed=False)
    assert isinstance(packed.lm_head, QuantLinear)
    assert packed.lm_head.qweight is not packed.model.embed_tokens.qweight
    assert_close(chunked_logits(packed, PROMPT, 4), chunked_logits(dense, PROMPT, 4))


def test_loaded_parameters_are_never_left_on_meta(tmp_path):
    model = load(tiny_llama_gguf(tmp_path / "q4.gguf", "Q4_K"), packed=True)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])


# rows of 256 in every expert projection (k-quant blocks), layer 0 dense as llama.cpp writes it
MOE_CONFIG = {
    **EXAONE_CONFIG,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 256,
    "head_dim": 64,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
}


def tiny_moe_gguf(path, quant: str, types: dict | None = None):
    config = transformers.ExaoneMoeConfig(**MOE_CONFIG)
    torch.manual_seed(0)
    state = state_dict(transformers.ExaoneMoeForCausalLM(config))
    return write_gguf(path, "exaone-moe", state, config, quant, types)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K"])
def test_moe_experts_stay_packed_and_give_the_logits_of_the_dequantized_file(quant, tmp_path):
    """Expert stacks keep the file's blocks (gate and up, stored apart, fill one stack), so a
    quantized MoE file takes about its own size; prefill and one-token steps give the logits
    of the file dequantized at load."""
    path = tiny_moe_gguf(tmp_path / f"{quant}.gguf", quant)
    packed, dense = load(path, packed=True), load(path, packed=False)
    experts = packed.model.layers[1].mlp.experts
    for stack in (experts.gate_up_proj, experts.down_proj):
        assert isinstance(stack, PackedStack) and stack.qtype == quant
    assert tuple(experts.gate_up_proj.shape) == tuple(
        dense.model.layers[1].mlp.experts.gate_up_proj.shape
    )
    expected = chunked_logits(dense, PROMPT, len(PROMPT))
    assert expected.abs().max() > 0.1
    assert_close(chunked_logits(packed, PROMPT, len(PROMPT)), expected)
    assert_close(chunked_logits(packed, PROMPT, 1), expected)  # decode: two experts a token
    assert resident_bytes(packed) < resident_bytes(dense) / 3


def test_an_expert_stack_of_two_types_is_dequantized_at_load(tmp_path, caplog):
    """gate in Q4_K and up in Q6_K cannot share one block tensor: that stack is dense, with a
    log line; down stays packed and the logits are those of the dequantized file."""
    path = tiny_moe_gguf(tmp_path / "mix.gguf", "Q4_K", {"ffn_up_exps": "Q6_K"})
    with caplog.at_level(logging.INFO, logger="kestrel.weights"):
        packed = load(path, packed=True)
    assert "expert stack's parts are of different types" in caplog.text
    experts = packed.model.layers[1].mlp.experts
    assert isinstance(experts.gate_up_proj, torch.nn.Parameter)
    assert isinstance(experts.down_proj, PackedStack)
    assert isinstance(packed.model.layers[1].self_attn.q_proj, QuantLinear)
    expected = chunked_logits(load(path, packed=False), PROMPT, 5)
    assert_close(chunked_logits(packed, PROMPT, 5), expected)


# --- bad files ----------------------------------------------------------------------------------


def write_one(path, qtype, data: np.ndarray):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def patch_record(path, offset: int, value: int, size: int) -> None:
    """Overwrite one field of token_embd.weight's record: `offset` bytes past its name (then come
    n_dims as 4 bytes, each dim as 8, the type id as 4)."""
    data = bytearray(path.read_bytes())
    at = data.index(b"token_embd.weight") + len("token_embd.weight") + offset
    data[at : at + size] = value.to_bytes(size, "little")
    path.write_bytes(bytes(data))


def test_truncated_block_data_names_the_tensor(tmp_path):
    blocks = random_blocks((8, 256), T.Q4_K, np.random.default_rng(0))
    path = write_one(tmp_path / "model.gguf", T.Q4_K, blocks)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match=r"truncated .*tensor token_embd.weight \(Q4_K\)"):
        load(path, packed=True)


def test_unknown_type_id_names_the_tensor(tmp_path):
    path = write_one(tmp_path / "model.gguf", T.Q8_0, np.zeros((4, 34), dtype=np.uint8))
    patch_record(path, 4 + 2 * 8, 250, 4)
    with pytest.raises(UnsupportedModelError, match="token_embd.weight has unknown .* id 250"):
        load(path, packed=True)


def test_rows_not_whole_blocks_name_the_tensor(tmp_path):
    # four Q8_0 rows of 32 elements declared as eight rows of 16 (a block holds 32)
    path = write_one(tmp_path / "model.gguf", T.Q8_0, np.zeros((4, 34), dtype=np.uint8))
    patch_record(path, 4, 16, 8)
    patch_record(path, 4 + 8, 8, 8)
    with pytest.raises(ModelLoadError, match="token_embd.weight: rows of 16 .* Q8_0 blocks of 32"):
        load(path, packed=True)


def test_blocks_stay_packed_on_the_cpu_where_its_kernels_load(monkeypatch):
    """With the native kernels every model keeps its blocks; without them (no compiler), only a
    model whose dequantized weights would not fit in half the memory does."""
    from kestrel.kernels import cpu_native
    from kestrel.weights.loader import keep_packed, physical_memory

    cpu = torch.device("cpu")
    assert cpu_native.available()  # CI has a compiler: the kernels load
    assert keep_packed(cpu, 300 << 20)  # the embedded models
    monkeypatch.setattr(cpu_native, "available", lambda: False)
    assert keep_packed(cpu, physical_memory())  # an 8B Q4_K_M on a laptop: its blocks stay
    assert not keep_packed(cpu, 300 << 20)  # the embedded models: float32


@pytest.mark.parametrize("setting,packed", [("keep", True), ("dequantize", False)])
def test_the_quantized_weights_setting_keeps_or_dequantizes_the_blocks(tmp_path, setting, packed):
    """`--quantized-weights keep|dequantize` (LLM's `quantized_weights`) overrides the default."""
    from kestrel import LLM

    path = tiny_llama_gguf(tmp_path / "q4k.gguf", "Q4_K")
    llm = LLM(str(path), quantized_weights=setting, device="cpu")
    layers = [m for m in llm.model.modules() if isinstance(m, QuantLinear)]
    assert bool(layers) == packed


def test_an_unknown_quantized_weights_setting_is_refused_by_name(tmp_path):
    from kestrel import LLM

    path = tiny_llama_gguf(tmp_path / "q8.gguf", "Q8_0")
    with pytest.raises(ValueError, match="quantized_weights 'packed'; supported: auto, keep"):
        LLM(str(path), quantized_weights="packed", device="cpu")

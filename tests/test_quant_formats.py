"""Quantized safetensors checkpoints stay quantized (models/layers/quant.py): per format (MLX
affine, FP8 block-wise and compressed-tensors, NVFP4 ModelOpt and compressed-tensors), a tiny
llama written in that format gives the logits of its dequantized values, loaded from a float
checkpoint by kestrel and by transformers, while holding the checkpoint's bytes; bad files fail at
load naming the tensor."""

import itertools
import json
import logging

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file
from tests.family_suite import one_thread  # noqa: F401  (tiny tensors: one thread is faster)
from tests.gguf_writer import random_blocks
from tests.quant_writer import (
    fp8_quantize,
    mlx_quantize,
    quant_config,
    quantize_state,
    split_experts,
    write_folder,
    write_random_shape,
)
from tests.reference import assert_close, chunked_logits, decode_logits
from tests.test_gguf_quantized import CONFIG, PROMPT
from tests.test_models_glm4_moe_lite import CONFIG as GLM
from tests.test_models_glm4_moe_lite import randomize_correction_bias

from kestrel.bench.roofline import active_weight_bytes, weight_bytes
from kestrel.errors import ModelLoadError, UnsupportedModelError
from kestrel.kernels.formats import FP8Format
from kestrel.models.layers.linear import Linear, concat_projection
from kestrel.models.layers.moe import PackedStack
from kestrel.models.layers.quant import QuantEmbedding, QuantLinear
from kestrel.weights.loader import build_model, checkpoint_summary, load_model, resolve

# the GGUF tests' tiny llama: its vocab 320 is not a multiple of 128, so the FP8 head's last
# scale tile is clipped
# format -> (quantizer options, whether it stores the embedding quantized, expected layer type)
FORMATS = {
    "mlx-4": ("mlx", dict(bits=4, group=64), True, "MLX_Q4_G64"),
    "mlx-8": ("mlx", dict(bits=8, group=32), True, "MLX_Q8_G32"),
    "mlx-3": ("mlx", dict(bits=3, group=32), True, "MLX_Q3_G32"),
    "fp8-block": ("fp8", dict(block=(128, 128)), False, "FP8_E4M3_128x128"),
    "fp8-channel": ("compressed-fp8", dict(strategy="channel"), False, "FP8_E4M3_CHANNEL"),
    "fp8-tensor": ("compressed-fp8", dict(strategy="tensor"), False, "FP8_E4M3_TENSOR"),
    "fp8-modelopt": ("modelopt-fp8", {}, False, "FP8_E4M3_TENSOR"),
    "nvfp4-modelopt": ("nvfp4", {}, False, "NVFP4"),
    "nvfp4-compressed": ("compressed-nvfp4", {}, False, "NVFP4"),
}


def float_llama(tied: bool, family: str = "Llama"):
    """A tiny random llama (or another family of transformers' `<family>ForCausalLM`)."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**CONFIG, tie_word_embeddings=tied)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def write_pair(tmp_path, key: str, tied: bool = True, family: str = "Llama"):
    """(quantized folder, float folder of its dequantized values) for format `key`."""
    fmt, options, embedding, _ = FORMATS[key]
    model = float_llama(tied, family)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight")
    tensors, dequantized = quantize_state(state, fmt, embedding, **options)
    config_key, value = quant_config(fmt, **options)
    quant = write_folder(tmp_path / key, model.config, tensors, {config_key: value})
    return quant, write_folder(tmp_path / f"{key}-float", model.config, dequantized)


def load(folder, packed=None):
    return load_model(resolve(str(folder)), torch.float32, torch.device("cpu"), False, packed)


def resident_bytes(model) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if t is not None}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("key", sorted(FORMATS))
def test_quantized_logits_equal_the_dequantized_checkpoint(key, tmp_path):
    quant, floats = write_pair(tmp_path, key)
    model = load(quant)
    expected = chunked_logits(load(floats), PROMPT, len(PROMPT))
    assert expected.abs().max() > 0.1
    assert_close(chunked_logits(model, PROMPT, len(PROMPT)), expected)
    assert_close(chunked_logits(model, PROMPT, 5), expected)
    assert_close(chunked_logits(load(quant, packed=False), PROMPT, 5), expected)
    with torch.no_grad():
        hf = transformers.LlamaForCausalLM.from_pretrained(floats, dtype=torch.float32)
        assert_close(hf(torch.tensor([PROMPT])).logits[0], expected)


@pytest.mark.parametrize("key", sorted(FORMATS))
def test_every_quantized_matrix_stays_in_its_checkpoint_bytes(key, tmp_path):
    quant, floats = write_pair(tmp_path, key)
    model = load(quant)
    _, _, embedding, qtype = FORMATS[key]
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 7 + (1 if embedding else 0)  # the tied head reads the embedding's
    assert {m.qtype for m in layers} == {qtype}
    assert isinstance(model.model.embed_tokens, QuantEmbedding) == embedding
    stored = sum(
        t.numel() * t.element_size() for t in load_file(quant / "model.safetensors").values()
    )
    # what the layers hold is the checkpoint as stored (+ float32 FP8 scales, a row scale each)
    assert resident_bytes(model) < resident_bytes(load(floats)) / 3
    assert abs(resident_bytes(model) - 2 * stored) < stored  # float32 norms/embedding from bf16
    meta = build_model(model.config, torch.float32, torch.device("meta"))  # as `kestrel inspect`
    summary = checkpoint_summary(meta, resolve(str(quant)), torch.device("cpu"), torch.float32)
    assert summary["resident"] == pytest.approx(resident_bytes(model), rel=0.05)
    assert sum(
        n for t, n in summary["types"].items() if t.startswith(("MLX", "FP8", "NVFP4"))
    ) == len(layers)


def test_untied_mlx_head_is_its_own_quantized_layer(tmp_path):
    quant, floats = write_pair(tmp_path, "mlx-4", tied=False)
    model = load(quant)
    assert isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.qweight is not model.model.embed_tokens.qweight
    assert_close(chunked_logits(model, PROMPT, 4), chunked_logits(load(floats), PROMPT, 4))


def test_mlx_per_module_override_and_float_module(tmp_path):
    # o_proj of layer 0 at 8 bits in groups of 32; down_proj of layer 1 left float (`false`)
    quant, floats = write_pair(tmp_path, "mlx-4")
    tensors, dense = load_file(quant / "model.safetensors"), load_file(floats / "model.safetensors")
    o, down = "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"
    packed, dense[f"{o}.weight"] = mlx_quantize(
        float_llama(True).state_dict()[f"{o}.weight"], 8, 32
    )
    tensors.update({f"{o}.{k}": v for k, v in packed.items()})
    for role in ("scales", "biases"):
        tensors.pop(f"{down}.{role}")
    tensors[f"{down}.weight"] = dense[f"{down}.weight"]
    save_file(tensors, str(quant / "model.safetensors"))
    save_file(dense, str(floats / "model.safetensors"))
    config = json.loads((quant / "config.json").read_text())
    config["quantization"].update({o: {"bits": 8, "group_size": 32}, down: False})
    (quant / "config.json").write_text(json.dumps(config))
    model = load(quant)
    assert model.model.layers[0].self_attn.o_proj.qtype == "MLX_Q8_G32"
    assert type(model.model.layers[1].mlp.down_proj) is Linear
    assert_close(chunked_logits(model, PROMPT, 5), chunked_logits(load(floats), PROMPT, 5))


def test_dense_only_layer_is_dequantized_at_load_with_a_log_line(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("kestrel.weights.loader.DENSE_LINEARS", frozenset({"down_proj"}))
    quant, floats = write_pair(tmp_path, "fp8-block")
    with caplog.at_level(logging.INFO, logger="kestrel.weights"):
        model = load(quant)
    assert "2 FP8_E4M3_128x128 tensors dequantized at load: the model reads it whole" in caplog.text
    assert type(model.model.layers[0].mlp.down_proj) is Linear
    assert_close(chunked_logits(model, PROMPT, 5), chunked_logits(load(floats), PROMPT, 5))


# --- bad files ----------------------------------------------------------------------------------


def edit(folder, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


Q = "model.layers.0.self_attn.q_proj"


def test_mlx_scales_of_the_wrong_shape_name_the_tensor(tmp_path):
    quant, _ = write_pair(tmp_path, "mlx-4")
    edit(quant, lambda t: t.update({f"{Q}.scales": t[f"{Q}.scales"][:, :2].contiguous()}))
    with pytest.raises(ModelLoadError, match=rf"{Q}.scales has shape \(256, 2\).*needs \(256, 4\)"):
        load(quant)


def test_mlx_packed_weight_not_matching_bits_names_the_tensor(tmp_path):
    quant, _ = write_pair(tmp_path, "mlx-4")
    config = json.loads((quant / "config.json").read_text())
    config["quantization"]["bits"] = 8  # the words hold 4-bit values
    (quant / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"\.weight has shape .*needs .*uint32 words of 8-bit"):
        load(quant)


def test_missing_fp8_scales_name_the_tensor(tmp_path):
    quant, _ = write_pair(tmp_path, "fp8-block")
    edit(quant, lambda t: t.pop(f"{Q}.weight_scale_inv"))
    with pytest.raises(ModelLoadError, match=rf"missing tensor {Q}.weight_scale_inv"):
        load(quant)


def test_nvfp4_block_scales_of_the_wrong_shape_name_the_tensor(tmp_path):
    quant, _ = write_pair(tmp_path, "nvfp4-modelopt")
    edit(
        quant, lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"][:, :8].contiguous()})
    )
    with pytest.raises(ModelLoadError, match=rf"{Q}.weight_scale has shape \(256, 8\).*one per 16"):
        load(quant)


def test_unknown_quant_method_names_it(tmp_path):
    quant, _ = write_pair(tmp_path, "fp8-block")
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "awq9"
    (quant / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="unknown quantization method 'awq9'"):
        load(quant)


def test_inspect_lists_quantized_layers_by_format_and_their_resident_bytes(tmp_path, capsys):
    from kestrel.cli import main

    quant, _ = write_pair(tmp_path, "mlx-4")
    assert main(["inspect", "-m", str(quant)]) == 0
    info = json.loads(capsys.readouterr().out)
    # 14 projections and the embedding (the tied head reads it), 5 float32 norms
    assert info["tensor_types"] == {"MLX_Q4_G64": 15, "F32": 5}
    stored = sum(
        t.numel() * t.element_size() for t in load_file(quant / "model.safetensors").values()
    )
    norm_elements = 5 * 256
    assert info["resident_bytes"]["cpu"] == stored  # quantized as stored, float32 norms as is
    assert info["resident_bytes"]["cuda"] == stored - 2 * norm_elements  # bfloat16 norms


def stack_experts(state: dict, template: dict) -> dict:
    """The inverse of `split_experts`, for the float checkpoint transformers reads."""
    out = {k: v for k, v in state.items() if ".experts." not in k}
    for name, t in template.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix, proj = name.rsplit(".", 1)
            parts = ["gate_proj", "up_proj"] if proj == "gate_up_proj" else ["down_proj"]
            out[name] = torch.stack(
                [
                    torch.cat([state[f"{prefix}.{e}.{p}.weight"] for p in parts])
                    for e in range(len(t))
                ]
            )
    return out


def tiny_glm():
    """A tiny random glm4_moe_lite from transformers: (config, its float state dict)."""
    config = transformers.Glm4MoeLiteConfig(**GLM)
    torch.manual_seed(0)
    model = transformers.Glm4MoeLiteForCausalLM(config)
    with torch.no_grad():
        randomize_correction_bias(model)
    return config, {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_glm_pair(tmp_path, key: str, options: dict):
    """A tiny glm4_moe_lite (MLA, routed experts stored one tensor per expert) in format `key`
    and the float checkpoint of its dequantized values: (quantized folder, float folder). Only
    matrices of whole groups are quantized, and not the head."""
    fmt = FORMATS[key][0]
    config, state = tiny_glm()
    split = split_experts(state, GLM["moe_intermediate_size"])
    group = options.get("group", 16 if "nvfp4" in fmt else 1)
    keep = {
        n.removesuffix(".weight") for n, w in split.items() if w.dim() == 2 and w.shape[1] % group
    }
    tensors, dequantized = quantize_state(split, fmt, False, (*keep, "lm_head"), **options)
    config_key, value = quant_config(fmt, **options)
    quant = write_folder(tmp_path / key, config, tensors, {config_key: value})
    return quant, write_folder(tmp_path / f"{key}-float", config, stack_experts(dequantized, state))


@pytest.mark.parametrize("key", ["mlx-4", "fp8-block", "fp8-tensor", "nvfp4-compressed"])
def test_moe_experts_stay_quantized_and_give_the_dequantized_logits(key, tmp_path, caplog):
    fmt, options, _, _ = FORMATS[key]
    options = {**options, "group": 16} if fmt == "mlx" else options  # the experts are 16 wide
    quant, floats = write_glm_pair(tmp_path, key, options)
    with caplog.at_level(logging.INFO, logger="kestrel.weights"):
        kestrel = load(quant)
    dense = [r.message for r in caplog.records if "dequantized at load" in r.message]
    assert not [m for m in dense if "experts" in m]  # only MLA's kv_b_proj, read whole
    experts = kestrel.model.layers[1].mlp.experts
    for stack in (experts.gate_up_proj, experts.down_proj):
        assert isinstance(stack, PackedStack) and stack.fmt.kind in fmt  # "fp8" of "compressed-fp8"
    dense_bytes = experts.num_experts * 3 * GLM["moe_intermediate_size"] * GLM["hidden_size"] * 4
    assert resident_bytes(experts) < dense_bytes / 3
    meta = build_model(kestrel.config, torch.float32, torch.device("meta"))
    summary = checkpoint_summary(meta, resolve(str(quant)), torch.device("cpu"), torch.float32)
    # FP8 stacks repeat their tile scales per row, a few percent more than stored
    assert summary["resident"] == pytest.approx(resident_bytes(kestrel), rel=0.1)
    # `kestrel bench`'s roofline counts the stacks as they are held, a token reading k of E
    assert weight_bytes(kestrel) == pytest.approx(summary["resident"], rel=0.1)
    stacks = sum(resident_bytes(kestrel.model.layers[i].mlp.experts) for i in (1, 2))
    embedding = resident_bytes(kestrel.model.embed_tokens) * (1 - 1 / GLM["vocab_size"])
    unread = embedding + stacks * (1 - GLM["num_experts_per_tok"] / GLM["n_routed_experts"])
    assert weight_bytes(kestrel) - active_weight_bytes(kestrel) == pytest.approx(unread)

    ids = [(i * 37 + 11) % 128 for i in range(20)]
    expected = chunked_logits(load(floats), ids, len(ids))
    assert expected.abs().max() > 0.1
    assert_close(decode_logits(kestrel, ids, 6), expected)  # a prefill, then one token a step
    assert_close(chunked_logits(load(quant, packed=False), ids, 6), expected)
    with torch.no_grad():
        hf = transformers.Glm4MoeLiteForCausalLM.from_pretrained(floats, dtype=torch.float32)
        assert_close(hf(torch.tensor([ids])).logits[0], expected)


def test_expert_parts_of_different_formats_load_dense(tmp_path, caplog):
    # MLX may quantize one module otherwise (config.json's per-module overrides): a stack whose
    # parts differ in format is dequantized whole, with a log line
    options = {**FORMATS["mlx-4"][1], "group": 16}
    quant, floats = write_glm_pair(tmp_path, "mlx-4", options)
    module, width = "model.layers.1.mlp.experts.3.up_proj", GLM["moe_intermediate_size"]
    tensors, float_state = (
        load_file(quant / "model.safetensors"),
        load_file(floats / "model.safetensors"),
    )
    stacked = float_state["model.layers.1.mlp.experts.gate_up_proj"]
    eight_bit, dequantized = mlx_quantize(stacked[3, width:], bits=8, group=16)
    tensors.update({f"{module}.{role}": t for role, t in eight_bit.items()})
    stacked[3, width:] = dequantized
    save_file(tensors, str(quant / "model.safetensors"))
    save_file(float_state, str(floats / "model.safetensors"))
    config = json.loads((quant / "config.json").read_text())
    config["quantization"][module] = {"bits": 8, "group_size": 16}
    (quant / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="kestrel.weights"):
        kestrel = load(quant)
    assert "its expert stack's parts are of different formats" in caplog.text
    experts = kestrel.model.layers[1].mlp.experts
    assert type(experts.gate_up_proj) is torch.nn.Parameter
    assert isinstance(experts.down_proj, PackedStack)
    ids = [(i * 37 + 11) % 128 for i in range(20)]
    assert_close(chunked_logits(kestrel, ids, 6), chunked_logits(load(floats), ids, len(ids)))


def test_fp8_modules_to_not_convert_stay_in_float(tmp_path):
    model = float_llama(tied=False)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tensors, dequantized = quantize_state(state, "fp8", False, keep=("lm_head",))
    key, value = quant_config("fp8")
    value["modules_to_not_convert"] = ["lm_head"]
    quant = write_folder(tmp_path / "fp8", model.config, tensors, {key: value})
    floats = write_folder(tmp_path / "float", model.config, dequantized)
    kestrel = load(quant)
    assert type(kestrel.lm_head) is Linear
    assert isinstance(kestrel.model.layers[0].mlp.up_proj, QuantLinear)
    assert_close(chunked_logits(kestrel, PROMPT, 5), chunked_logits(load(floats), PROMPT, 5))


def test_weight_stored_quantized_where_the_config_says_float_names_it(tmp_path):
    quant, _ = write_pair(tmp_path, "mlx-4")
    config = json.loads((quant / "config.json").read_text())
    config["quantization"][Q] = False
    (quant / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"tensor {Q}.weight is stored quantized \(U32\)"):
        load(quant)


def test_truncated_quantized_file_fails_naming_it(tmp_path):
    quant, _ = write_pair(tmp_path, "nvfp4-compressed")
    path = quant / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="model.safetensors: truncated or corrupt"):
        load(quant)


def test_unsupported_compressed_tensors_format_names_it(tmp_path):
    quant, _ = write_pair(tmp_path, "fp8-channel")
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"]["format"] = "pack-quantized"  # int4 weights: not served
    (quant / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="compressed-tensors format 'pack-quantized'"):
        load(quant)


def test_scales_in_another_shard_than_their_weights(tmp_path):
    # sharded checkpoints may split one module's tensors; each is found through the index
    quant, floats = write_pair(tmp_path, "fp8-block")
    tensors = load_file(quant / "model.safetensors")
    (quant / "model.safetensors").unlink()
    scales = {k: v for k, v in tensors.items() if k.endswith("_scale_inv")}
    weights = {k: v for k, v in tensors.items() if k not in scales}
    save_file(scales, str(quant / "model-00001-of-00002.safetensors"))
    save_file(weights, str(quant / "model-00002-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 if k in scales else 2}-of-00002.safetensors" for k in tensors}
    (quant / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load(quant)
    assert isinstance(model.model.layers[1].mlp.down_proj, QuantLinear)
    assert_close(chunked_logits(model, PROMPT, 5), chunked_logits(load(floats), PROMPT, 5))


def test_inputs_not_whole_groups_name_the_tensor(tmp_path):
    quant, _ = write_pair(tmp_path, "mlx-4")
    config = json.loads((quant / "config.json").read_text())
    config["quantization"]["group_size"] = 96
    (quant / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"\.weight: 256 inputs are not whole groups of 96"):
        load(quant)


@pytest.mark.parametrize("key", ["mlx-4", "fp8-channel"])
def test_quantized_projections_keep_their_float_biases(key, tmp_path):
    # qwen2's q/k/v projections have biases, stored in float beside the quantized weights
    quant, floats = write_pair(tmp_path, key, family="Qwen2")
    model = load(quant)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QuantLinear) and q_proj.bias is not None
    assert not q_proj.bias.is_meta
    expected = chunked_logits(load(floats), PROMPT, len(PROMPT))
    assert_close(chunked_logits(model, PROMPT, 5), expected)
    with torch.no_grad():
        hf = transformers.Qwen2ForCausalLM.from_pretrained(floats, dtype=torch.float32)
        assert_close(hf(torch.tensor([PROMPT])).logits[0], expected)


def fp8_projections(rows: list[int], block) -> torch.nn.Module:
    """A module with FP8 QuantLinears q/k/v of `rows` outputs over 256 inputs, `block` tiles
    (None: one tile per tensor)."""
    module = torch.nn.Module()
    for name, n in zip(("q_proj", "k_proj", "v_proj"), rows, strict=True):
        tiles = block or (n, 256)
        q, scale, _ = fp8_quantize(torch.randn(n, 256), tiles)
        setattr(module, name, QuantLinear(q, FP8Format(block=tiles), 256, scale=scale))
    return module


PROJECTIONS = ["q_proj", "k_proj", "v_proj"]


def _assert_joined_in_runs(module, x, runs: list[int]) -> None:
    """The joined projection equals the projections side by side, and the neighbours that
    stack share one tensor (`runs`: how many in each run), which the layers keep views of."""
    linears = [getattr(module, name) for name in PROJECTIONS]
    expected = torch.cat([linear(x) for linear in linears], dim=1)
    joined = concat_projection(module, PROJECTIONS)
    torch.testing.assert_close(joined(x), expected, rtol=1e-5, atol=1e-5)
    storages = [linear.qweight.untyped_storage().data_ptr() for linear in linears]
    assert [len(list(run)) for _, run in itertools.groupby(storages)] == runs
    start = linears[0].out_features
    torch.testing.assert_close(
        module.k_proj(x), expected[:, start : start + linears[1].out_features]
    )


@pytest.mark.parametrize(
    "rows, block, runs",
    [
        ([256, 128, 128], (128, 128), [3]),  # tiles stack
        ([256, 128, 128], (1, 256), [3]),  # a scale per row
        ([128, 128, 128], None, [3]),  # one tile per tensor, all of one shape
        ([256, 128, 128], None, [1, 2]),  # one tile per tensor: q's differs, k's and v's alike
        ([256, 128, 64], (128, 128), [3]),  # only the last ends inside a tile (MLA's kv_a)
        ([256, 64, 64], (128, 128), [2, 1]),  # k ends inside a tile v would straddle: v apart
    ],
)
def test_fp8_projections_join_where_their_scale_tiles_line_up(rows, block, runs):
    """The paged runner's fusion joins FP8 projections into one weight and one scale grid where
    their tiles stack, and runs the others apart."""
    torch.manual_seed(0)
    _assert_joined_in_runs(fp8_projections(rows, block), torch.randn(3, 256), runs)


@pytest.mark.parametrize(
    "types, runs",
    [
        (["Q4_K", "Q4_K", "Q6_K"], [2, 1]),  # llama.cpp's Q4_K_M: v in Q6_K in half the layers
        (["Q5_0", "Q5_0", "Q8_0"], [2, 1]),  # gemma3-270m's Q4_K_M file
        (["Q4_K", "Q6_K", "Q4_K"], [1, 1, 1]),
        (["Q8_0", "Q8_0", "Q8_0"], [3]),
    ],
)
def test_gguf_projections_of_two_types_join_by_type(types, runs):
    """q and k of one GGUF type join into one block tensor even where v is of another; the
    joined projection equals the three side by side."""
    rng = np.random.default_rng(0)
    module = torch.nn.Module()
    for name, qtype, rows in zip(PROJECTIONS, types, [64, 32, 32], strict=True):
        blocks = random_blocks((rows, 256), GGMLQuantizationType[qtype], rng)
        setattr(module, name, QuantLinear(torch.from_numpy(blocks), qtype, 256))
    _assert_joined_in_runs(module, torch.randn(3, 256), runs)


def test_random_shape_checkpoint_loads_with_its_experts_quantized(tmp_path):
    # benchmarks/quantized_speed.py --formats moe_fp8 writes GLM-4.7-Flash's shape this way
    small = dict(num_hidden_layers=3, n_routed_experts=8, vocab_size=512, hidden_size=256)
    small.update(intermediate_size=512, moe_intermediate_size=128, num_attention_heads=2)
    small.update(num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128)
    folder = write_random_shape(tmp_path / "glm", "fp8", "glm-4.7-flash", **small)
    model = load(folder)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts.gate_up_proj, PackedStack)
    assert experts.gate_up_proj.shape == (8, 256, 256)
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantLinear)  # the dense layer
    logits = chunked_logits(model, [1, 2, 3, 4, 5], 5)
    assert torch.isfinite(logits).all() and logits.abs().max() > 0


def to_mlx_lm(state: dict, c: dict) -> dict:
    """A transformers glm4_moe_lite state in mlx-lm's layout: experts stacked per projection in
    `switch_mlp` (E, out, in), `kv_b_proj` split per head into `embed_q` (H, r, dn) and
    `unembed_out` (H, dv, r)."""
    I, dn, r = c["moe_intermediate_size"], c["qk_nope_head_dim"], c["kv_lora_rank"]  # noqa: E741
    out = {}
    for name, t in state.items():
        prefix = name.rpartition(".")[0]
        switch = prefix.removesuffix(".experts") + ".switch_mlp"
        if name.endswith("experts.gate_up_proj"):
            out[f"{switch}.gate_proj.weight"], out[f"{switch}.up_proj.weight"] = t[:, :I], t[:, I:]
        elif name.endswith("experts.down_proj"):
            out[f"{switch}.down_proj.weight"] = t
        elif name.endswith("kv_b_proj.weight"):
            w = t.view(c["num_attention_heads"], -1, r)
            out[prefix.replace("kv_b_proj", "embed_q.weight")] = w[:, :dn].transpose(1, 2)
            out[prefix.replace("kv_b_proj", "unembed_out.weight")] = w[:, dn:]
        else:
            out[name] = t
    return out


def from_mlx_lm(state: dict, c: dict) -> dict:
    """The inverse of `to_mlx_lm`."""
    out = {}
    for name, t in state.items():
        module = name.removesuffix(".weight")
        if module.endswith("switch_mlp.gate_proj"):
            experts = module.replace("switch_mlp.gate_proj", "experts")
            up = state[name.replace("gate_proj", "up_proj")]
            out[f"{experts}.gate_up_proj"] = torch.cat([t, up], 1)
        elif module.endswith("switch_mlp.down_proj"):
            out[module.replace("switch_mlp.down_proj", "experts.down_proj")] = t
        elif module.endswith("embed_q"):
            w = torch.cat([t.transpose(1, 2), state[name.replace("embed_q", "unembed_out")]], 1)
            out[name.replace("embed_q", "kv_b_proj")] = w.reshape(-1, c["kv_lora_rank"])
        elif not module.endswith(("switch_mlp.up_proj", "unembed_out")):
            out[name] = t
    return out


def mlx_quantize_stack(w: torch.Tensor, bits: int, group: int) -> tuple[dict, torch.Tensor]:
    """`mlx_quantize` over the last two dims of a (..., rows, cols) tensor, as mx.quantize does."""
    parts = [mlx_quantize(m, bits, group) for m in w.reshape(-1, *w.shape[-2:])]
    tensors = {
        role: torch.stack([p[role] for p, _ in parts]).reshape(*w.shape[:-2], *t.shape)
        for role, t in parts[0][0].items()
    }
    return tensors, torch.stack([d for _, d in parts]).reshape(w.shape)


def write_mlx_lm_glm(tmp_path, quantized: bool):
    """A tiny glm4_moe_lite as mlx-lm saves it (`to_mlx_lm`), in MLX 4-bit (every weight of
    whole groups of 8, the embedding and head too; the router stays float) when `quantized`, and
    the float checkpoint of its values in transformers' layout: (mlx folder, float folder)."""
    config, state = tiny_glm()
    mlx = to_mlx_lm(state, GLM)
    tensors, values = {}, {}
    for name, w in mlx.items():
        module = name.removesuffix(".weight")
        linear = module.endswith(("_proj", "embed_q", "unembed_out", "lm_head", "embed_tokens"))
        if not quantized or not linear or w.shape[-1] % 8:
            tensors[name] = values[name] = w
            continue
        quant, values[name] = mlx_quantize_stack(w, 4, 8)
        tensors.update({f"{module}.{role}": t for role, t in quant.items()})
    extra = {"quantization": {"group_size": 8, "bits": 4}} if quantized else {}
    folder = write_folder(tmp_path / "mlx", config, tensors, extra)
    return folder, write_folder(tmp_path / "float", config, from_mlx_lm(values, GLM))


@pytest.mark.parametrize("quantized", [True, False], ids=["mlx-4", "bf16"])
def test_mlx_lm_layout_loads_stacked_experts_and_split_latent_projection(quantized, tmp_path):
    # mlx-community MoE folders: experts in one tensor per projection (`switch_mlp`), MLA's
    # kv_b_proj as per-head `embed_q` and `unembed_out`
    mlx, floats = write_mlx_lm_glm(tmp_path, quantized)
    kestrel = load(mlx)
    experts = kestrel.model.layers[1].mlp.experts
    for stack in (experts.gate_up_proj, experts.down_proj):
        assert isinstance(stack, PackedStack) == quantized
    ids = [(i * 37 + 11) % 128 for i in range(20)]
    expected = chunked_logits(load(floats), ids, len(ids))
    assert expected.abs().max() > 0.1
    assert_close(decode_logits(kestrel, ids, 6), expected)
    with torch.no_grad():
        hf = transformers.Glm4MoeLiteForCausalLM.from_pretrained(floats, dtype=torch.float32)
        assert_close(hf(torch.tensor([ids])).logits[0], expected)


def test_stacked_experts_of_the_wrong_count_name_the_tensor(tmp_path):
    mlx, _ = write_mlx_lm_glm(tmp_path, quantized=True)
    tensors = load_file(mlx / "model.safetensors")
    name = "model.layers.2.mlp.switch_mlp.down_proj"
    for role in ("weight", "scales", "biases"):
        tensors[f"{name}.{role}"] = tensors[f"{name}.{role}"][:-1]
    save_file(tensors, str(mlx / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"{name}\.weight stacks 7 parts; .* takes 8"):
        load(mlx)

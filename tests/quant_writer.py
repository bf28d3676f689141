"""Write tiny quantized Hugging Face checkpoint folders (MLX affine, FP8, NVFP4) from a float
model, with the float checkpoint of their dequantized values beside them. The quantizers follow
each format's definition, independently of kernels/quant.py:

- MLX affine: per group of `group_size` inputs, scale = (max - min) / (2^bits - 1), bias = min,
  q = round((w - bias) / scale); values packed as a little-endian bit stream into uint32 words;
  scales and biases stored in bfloat16 (the dequantized value uses the stored ones).
- FP8 (`quant_method: fp8`): per (128, 128) tile, scale_inv = amax / 448, weight = w / scale_inv
  as float8_e4m3fn. compressed-tensors FP8: the same with one scale per row (`channel`) or per
  tensor, named `weight_scale`.
- NVFP4: per tensor scale_2 = amax / (448 * 6); per 16 inputs an fp8 scale = amax / 6 / scale_2;
  each value rounded to the nearest e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6, signed), two a byte, the even
  element in the low nibble. compressed-tensors stores 1 / scale_2 as `weight_global_scale`.
"""

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from kestrel.weights.shapes import SHAPES

FP8_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mlx_quantize(w: torch.Tensor, bits: int, group: int) -> tuple[dict, torch.Tensor]:
    """(rows, cols) float -> ({weight, scales, biases}, dequantized (rows, cols) float32)."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / (2**bits - 1)).clamp(min=1e-8).to(torch.bfloat16)
    biases = lo.to(torch.bfloat16)
    q = ((g - biases.float()[..., None]) / scales.float()[..., None]).round()
    q = q.clamp(0, 2**bits - 1).to(torch.int64)
    dequantized = (q * scales.float()[..., None] + biases.float()[..., None]).reshape(rows, cols)
    return {
        "weight": pack_bits(q.reshape(rows, cols), bits),
        "scales": scales,
        "biases": biases,
    }, dequantized


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, cols) ints < 2^bits -> (rows, cols * bits / 32) uint32: value i at bit i * bits."""
    values = q.numpy().astype(np.uint64)
    stream = (values[..., None] >> np.arange(bits, dtype=np.uint64)) & 1  # (rows, cols, bits)
    packed = np.packbits(stream.reshape(q.shape[0], -1).astype(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(packed.view("<u4").astype(np.uint32).copy())


def fp8_quantize(
    w: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, cols) -> (float8 weight, scale per (block) tile (ceil(rows/b0), ceil(cols/b1)) float32,
    dequantized float32)."""
    rows, cols = w.shape
    b0, b1 = block
    tiles = (math.ceil(rows / b0), math.ceil(cols / b1))
    padded = torch.zeros(tiles[0] * b0, tiles[1] * b1)
    padded[:rows, :cols] = w.float()
    grid = padded.reshape(tiles[0], b0, tiles[1], b1)
    scale = (grid.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # (tiles)
    full = scale[:, None, :, None].expand_as(grid).reshape(padded.shape)[:rows, :cols]
    q = (w.float() / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (sign in bit 3) of each float (already scaled to at most 6)."""
    magnitude = (x.abs()[..., None] - E2M1).abs().argmin(-1)
    return magnitude | ((x < 0) & (magnitude > 0)).to(torch.int64) << 3


def nvfp4_quantize(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """(rows, cols) -> ({weight, weight_scale, weight_scale_2}, dequantized float32)."""
    rows, cols = w.shape
    scale_2 = w.abs().amax().float() / (FP8_MAX * 6)
    g = w.float().reshape(rows, cols // 16, 16)
    scale = (g.abs().amax(-1) / 6 / scale_2).to(torch.float8_e4m3fn)  # (rows, cols / 16)
    step = scale.float()[..., None] * scale_2
    codes = e2m1_codes(g / step.clamp(min=1e-30)).reshape(rows, cols)
    signed = torch.cat([E2M1, -E2M1])
    dequantized = (signed[codes].reshape(rows, cols // 16, 16) * step).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    tensors = {"weight": packed, "weight_scale": scale, "weight_scale_2": scale_2.reshape(())}
    return tensors, dequantized


def quantize_state(
    state: dict, fmt: str, quantize_embedding: bool, keep: tuple = (), **kw
) -> tuple[dict, dict]:
    """A float state dict -> (the checkpoint's tensors in `fmt`, the float state of the values
    they decode to). Every 2-D linear weight is quantized but the modules in `keep`; the
    embedding when asked."""
    out, dequantized = {}, {}
    for name, w in state.items():
        module = name.removesuffix(".weight")
        linear = name.endswith("_proj.weight") or name == "lm_head.weight"
        quantize = linear or (quantize_embedding and "embed_tokens" in name)
        if w.dim() != 2 or not quantize or module in keep:
            out[name] = dequantized[name] = w
            continue
        tensors, dequantized[name] = QUANTIZERS[fmt](w, **kw)
        out.update({f"{module}.{k}": v for k, v in tensors.items()})
    return out, dequantized


def _mlx(w, bits=4, group=64):
    return mlx_quantize(w, bits, group)


def _fp8_blocks(w, block=(128, 128)):
    q, scale, dequantized = fp8_quantize(w, block)
    return {"weight": q, "weight_scale_inv": scale}, dequantized


def _fp8_compressed(w, strategy="channel"):
    block = (1, w.shape[1]) if strategy == "channel" else tuple(w.shape)
    q, scale, dequantized = fp8_quantize(w, block)
    scale = scale.reshape(-1, 1) if strategy == "channel" else scale.reshape(1)
    return {"weight": q, "weight_scale": scale, "input_scale": torch.ones(1)}, dequantized


def _nvfp4_modelopt(w):
    tensors, dequantized = nvfp4_quantize(w)
    return {**tensors, "input_scale": torch.ones(())}, dequantized


def _nvfp4_compressed(w):
    t, dequantized = nvfp4_quantize(w)
    tensors = {
        "weight_packed": t["weight"],
        "weight_scale": t["weight_scale"],
        "weight_global_scale": (1 / t["weight_scale_2"]).reshape(1),
        "input_global_scale": torch.ones(1),
    }
    return tensors, dequantized


QUANTIZERS = {
    "mlx": _mlx,
    "fp8": _fp8_blocks,
    "compressed-fp8": _fp8_compressed,
    "modelopt-fp8": lambda w: _fp8_compressed(w, "tensor"),
    "nvfp4": _nvfp4_modelopt,
    "compressed-nvfp4": _nvfp4_compressed,
}


def quant_config(fmt: str, **kw) -> tuple[str, dict]:
    """(config.json key, value) declaring `fmt` as its producers write it."""
    if fmt == "mlx":
        return "quantization", {"group_size": kw.get("group", 64), "bits": kw.get("bits", 4)}
    if fmt == "fp8":
        block = list(kw.get("block", (128, 128)))
        return "quantization_config", {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": block,
        }
    if fmt == "compressed-fp8":
        weights = {"num_bits": 8, "type": "float", "strategy": kw.get("strategy", "channel")}
        return "quantization_config", _compressed("float-quantized", weights)
    if fmt == "modelopt-fp8":
        return "quantization_config", {"quant_method": "modelopt", "quant_algo": "FP8"}
    if fmt == "nvfp4":
        return "quantization_config", {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
        }
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    return "quantization_config", _compressed("nvfp4-pack-quantized", weights)


def _compressed(fmt: str, weights: dict) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


def write_folder(folder: Path, config, tensors: dict, extra: dict | None = None) -> Path:
    """config.json (plus `extra` keys) and one model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    data = config.to_dict()
    data.update(extra or {})
    (folder / "config.json").write_text(json.dumps(data))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


# Llama-3.1-8B's shapes, for the GPU memory and speed measurements (random weights)
LLAMA_8B = {k: v for k, v in SHAPES["llama3-8b"].items() if k != "model_type"}


def write_random_llama(folder: Path, fmt: str, shape: dict = LLAMA_8B, **kw) -> Path:
    """A random-weight llama of `shape` in format `fmt`, generated and quantized one tensor at a
    time and written one layer a shard (an 8B model never exists in float in memory)."""
    import transformers

    config = transformers.LlamaConfig(**shape)
    key, value = quant_config(fmt, **kw)
    write_folder(folder, config, {}, {key: value})
    (folder / "model.safetensors").unlink()
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for shard, names in enumerate(_llama_shards(config)):
        state = {n: torch.randn(s, generator=g) * (0.02 if len(s) == 2 else 1) for n, s in names}
        state = {n: (1 + 0.1 * t if "norm" in n else t) for n, t in state.items()}
        tensors, _ = quantize_state(state, fmt, fmt == "mlx", **kw)
        tensors = {
            n: t.to(torch.bfloat16) if t.dtype == torch.float32 and t.dim() == 2 else t
            for n, t in tensors.items()
        }
        file = f"model-{shard:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / file))
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def split_experts(state: dict, intermediate: int) -> dict:
    """Stacked expert tensors -> one 2-D tensor per expert and projection, as FP8 MoE releases
    (DeepSeek-V3, Qwen3-MoE-FP8) store them."""
    out = {}
    for name, t in state.items():
        prefix = name.removesuffix("gate_up_proj").removesuffix("down_proj")
        if name.endswith("experts.gate_up_proj"):
            for e, w in enumerate(t):
                out[f"{prefix}{e}.gate_proj.weight"] = w[:intermediate]
                out[f"{prefix}{e}.up_proj.weight"] = w[intermediate:]
        elif name.endswith("experts.down_proj"):
            out.update({f"{prefix}{e}.down_proj.weight": w for e, w in enumerate(t)})
        else:
            out[name] = t
    return out


def write_random_shape(folder: Path, fmt: str, shape: str, **overrides) -> Path:
    """`kestrel bench --shape` `shape` (its config fields changed by `overrides`) as a random
    checkpoint in `fmt` (its default options), one decoder layer a shard, routed experts one
    tensor per expert as Hugging Face FP8 MoE releases store them. Each distinct tensor shape is
    drawn and quantized once and written wherever it occurs: a 30B shape writes in seconds, and a
    speed measurement reads every byte whether or not the layers differ."""
    import re

    from kestrel.weights.loader import build_model
    from kestrel.weights.shapes import decoder_config, shape_config

    config = shape_config(shape, **overrides)
    model = build_model(config, torch.bfloat16, torch.device("meta"))
    key, value = quant_config(fmt)
    write_folder(folder, config, {}, {key: value})
    (folder / "model.safetensors").unlink()
    shards: dict[str, dict] = {}  # "" (embedding, norm, head) or a layer's prefix -> its tensors
    for name, p in model.named_parameters():
        layer = re.match(r".*?layers\.\d+\.", name)
        shards.setdefault(layer[0] if layer else "", {})[name] = tuple(p.shape)
    width = getattr(decoder_config(config), "moe_intermediate_size", None)
    made: dict = {}
    weight_map = {}
    for index, params in enumerate(shards.values()):
        state = {n: _drawn(made, n, s) for n, s in params.items()}
        tensors = {}
        for name, w in split_experts(state, width).items():
            tensors.update(_quantized_once(made, name, w, fmt))
        file = f"model-{index:05d}.safetensors"
        save_file(tensors, str(folder / file))
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _drawn(made: dict, name: str, shape: tuple) -> torch.Tensor:
    """A random tensor of `shape` (norms near 1, the rest small), drawn once per shape."""
    key = ("norm" in name, shape)
    if key not in made:
        noise = torch.randn(shape)
        made[key] = 1 + 0.1 * noise if "norm" in name else 0.02 * noise
    return made[key]


def _quantized_once(made: dict, name: str, w: torch.Tensor, fmt: str) -> dict:
    """`quantize_state` of one tensor (float matrices left in bfloat16), a linear weight's
    roles made once per shape; copies, since a safetensors file holds no shared memory."""
    if not (name.endswith("_proj.weight") or name == "lm_head.weight") or w.dim() != 2:
        return {name: w.to(torch.bfloat16) if w.dim() == 2 else w.clone()}
    module = name.removesuffix(".weight")
    if ("quantized", w.shape) not in made:
        tensors, _ = quantize_state({name: w}, fmt, False)
        made["quantized", w.shape] = {k.removeprefix(module): v for k, v in tensors.items()}
    return {module + suffix: t.clone() for suffix, t in made["quantized", w.shape].items()}


def _llama_shards(config):
    """Per shard, (name, shape) of its tensors: the embedding, each layer, the norm and head."""
    h, i, d = (
        config.hidden_size,
        config.intermediate_size,
        config.hidden_size // config.num_attention_heads,
    )
    kv = config.num_key_value_heads * d
    yield [("model.embed_tokens.weight", (config.vocab_size, h))]
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}"
        yield [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (h, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, h)),
            (f"{p}.mlp.gate_proj.weight", (i, h)),
            (f"{p}.mlp.up_proj.weight", (i, h)),
            (f"{p}.mlp.down_proj.weight", (h, i)),
        ]
    yield [("model.norm.weight", (h,)), ("lm_head.weight", (config.vocab_size, h))]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description="write a random Llama-3.1-8B-shaped quantized folder"
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("--format", default="fp8", choices=sorted(QUANTIZERS))
    args = parser.parse_args()
    print(write_random_llama(args.folder, args.format))

"""Quantized Hugging Face checkpoints: which format a folder declares and which tensors hold each
quantized weight. Formats: MLX affine (mlx-lm's `quantization` in config.json), FP8 (`quant_method:
fp8`, block-wise `weight_scale_inv`; compressed-tensors `float-quantized`) and NVFP4 (ModelOpt,
compressed-tensors `nvfp4-pack-quantized`). Each format is a class of kernels/formats.py, which
says what it stores and how it decodes; here a folder's config is read into one, and the
checkpoint's tensors are checked against the weight's shape, so a bad file fails at load naming
the tensor.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from kestrel.errors import ModelLoadError, UnsupportedModelError
from kestrel.kernels.formats import WHOLE, FP8Format, MLXFormat, NVFP4Format, QuantFormat

METHODS = (
    "mlx (config.json `quantization`), fp8, compressed-tensors (float-quantized, "
    "nvfp4-pack-quantized), modelopt (FP8, NVFP4)"
)


@dataclass(frozen=True)
class Scheme:
    """A folder's quantization: the format of its quantized weights, the checkpoint suffix of
    each role's tensor (`qweight` is the packed values), suffixes it stores but compute does not
    read, and per-module MLX overrides (a format, or None: left in float)."""

    fmt: QuantFormat
    roles: dict[str, str]
    unused: tuple[str, ...] = ()
    overrides: dict[str, QuantFormat | None] = field(default_factory=dict)
    inverse_scale_2: bool = False  # compressed-tensors stores the global scale's reciprocal

    def format_for(self, module: str) -> QuantFormat | None:
        return self.overrides.get(module, self.fmt)

    def tensor_names(self, module: str) -> dict[str, str]:
        return {role: f"{module}.{suffix}" for role, suffix in self.roles.items()}

    def module_of(self, name: str) -> str | None:
        """The module whose packed values tensor `name` is, else None."""
        suffix = "." + self.roles["qweight"]
        return name[: -len(suffix)] if name.endswith(suffix) else None


def read_scheme(folder: Path) -> Scheme | None:
    """The folder's quantization scheme (None: a float checkpoint); a clear error, naming the
    folder, for one kestrel cannot compute from."""
    try:
        return _scheme(folder)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{folder}: {e}") from e


def _scheme(folder: Path) -> Scheme | None:
    config = json.loads((folder / "config.json").read_text())
    modelopt = folder / "hf_quant_config.json"
    if "quantization" in config:  # mlx-lm writes it (and a copy as quantization_config)
        return _mlx(config["quantization"])
    if modelopt.exists():
        return _modelopt(json.loads(modelopt.read_text()).get("quantization", {}))
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in _METHODS:
        raise UnsupportedModelError(
            f"unknown quantization method {method!r} in config.json's quantization_config; "
            f"supported: {METHODS}"
        )
    return _METHODS[method](q)


def _mlx(q: dict) -> Scheme:
    if q.get("mode", "affine") != "affine":
        raise UnsupportedModelError(f"MLX quantization mode {q['mode']!r}: only 'affine' is served")
    fmt = _mlx_format(q, "quantization")
    overrides = {
        k: (_mlx_format(v, k) if v else None) for k, v in q.items() if isinstance(v, (dict, bool))
    }
    roles = {"qweight": "weight", "scales": "scales", "biases": "biases"}
    return Scheme(fmt, roles, overrides=overrides)


def _mlx_format(q: dict, where: str) -> MLXFormat:
    bits, group = q.get("bits"), q.get("group_size")
    if bits not in (2, 3, 4, 5, 6, 8) or not isinstance(group, int) or group <= 0:
        raise UnsupportedModelError(
            f"MLX quantization {where}: bits {bits!r}, group_size {group!r}; "
            "supported bits 2, 3, 4, 5, 6, 8 and a positive group_size"
        )
    return MLXFormat(bits=bits, group=group)


def _fp8_blocks(q: dict) -> Scheme:
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedModelError("FP8 activation_scheme 'static': only 'dynamic' is served")
    block = tuple(q.get("weight_block_size") or (WHOLE, WHOLE))  # none: one per tensor
    return Scheme(FP8Format(block=block), {"qweight": "weight", "scale": "weight_scale_inv"})


def _compressed(q: dict) -> Scheme:
    weights = [g.get("weights") or {} for g in (q.get("config_groups") or {}).values()]
    w = weights[0] if weights else {}
    if q.get("format") in ("float-quantized", "naive-quantized") and w.get("type") == "float":
        block = {"tensor": (WHOLE, WHOLE), "channel": (1, WHOLE)}.get(w.get("strategy"))
        if w.get("strategy") == "block":
            block = tuple(w["block_structure"])
        if w.get("num_bits") == 8 and block is not None:
            roles = {"qweight": "weight", "scale": "weight_scale"}
            return Scheme(FP8Format(block=block), roles, unused=("input_scale",))
    if q.get("format") == "nvfp4-pack-quantized":
        roles = {
            "qweight": "weight_packed",
            "scale": "weight_scale",
            "scale_2": "weight_global_scale",
        }
        unused = ("input_global_scale",)
        return Scheme(NVFP4Format(group=16), roles, unused, inverse_scale_2=True)
    raise UnsupportedModelError(
        f"compressed-tensors format {q.get('format')!r} with weights {weights[:1]}: supported "
        "float-quantized FP8 (tensor, channel or block scales) and nvfp4-pack-quantized"
    )


def _modelopt(q: dict) -> Scheme:
    if q.get("quant_algo") == "FP8":  # one scale per tensor
        roles = {"qweight": "weight", "scale": "weight_scale"}
        return Scheme(FP8Format(block=(WHOLE, WHOLE)), roles, unused=("input_scale",))
    if q.get("quant_algo") != "NVFP4":
        raise UnsupportedModelError(
            f"ModelOpt quant_algo {q.get('quant_algo')!r}: supported FP8 and NVFP4"
        )
    roles = {"qweight": "weight", "scale": "weight_scale", "scale_2": "weight_scale_2"}
    return Scheme(NVFP4Format(group=q.get("group_size", 16)), roles, unused=("input_scale",))


def quantized_modules(scheme: Scheme, headers: dict[str, dict]) -> dict[str, QuantFormat]:
    """module -> format of every module whose packed values the checkpoint stores in the format's
    storage dtype (`headers`: tensor name -> safetensors header entry). Weights stored in float
    (the `ignore` / `modules_to_not_convert` lists) stay float."""
    found = {}
    for name, entry in headers.items():
        module = scheme.module_of(name)
        if module is None or entry["dtype"] != scheme.fmt.storage:
            continue
        fmt = scheme.format_for(module)
        if fmt is None:
            raise ModelLoadError(
                f"tensor {name} is stored quantized ({entry['dtype']}) but the quantization "
                f"config leaves {module} unquantized"
            )
        found[module] = fmt
    return found


def check(fmt: QuantFormat, module: str, tensors: dict, names: dict, shape: tuple) -> None:
    """Fail naming the tensor when a role is missing or its shape does not fit a weight of
    `shape` (rows, cols) in `fmt`."""
    for role, name in names.items():
        if tensors.get(role) is None:
            raise ModelLoadError(
                f"{module}: missing tensor {name} (its {role}) for a {fmt.name} weight"
            )
    if not fmt.row_fits(shape[1]):
        group = fmt.column_group(shape[1])
        raise ModelLoadError(
            f"tensor {names['qweight']}: {shape[1]} inputs are not whole groups of {group}"
        )
    for role, expected in fmt.expected_shapes(*shape).items():
        got = tuple(tensors[role].shape)
        if _squeezed(got) != _squeezed(expected):  # a per-row scale may be (rows,) or (rows, 1)
            raise ModelLoadError(
                f"tensor {names[role]} has shape {got}; a {fmt.name} weight of shape {shape} "
                f"needs {expected}{fmt.shape_note(role)}"
            )


def _squeezed(shape: tuple) -> tuple:
    return tuple(d for d in shape if d != 1)


def layer_tensors(scheme: Scheme, fmt: QuantFormat, tensors: dict, shape: tuple) -> dict:
    """The checkpoint's tensors as the quantized layer holds them (`QuantFormat.held`: FP8
    scales as a float32 2-D tile grid, NVFP4's second scale as a float32 multiplier)."""
    t = fmt.held(tensors, shape)
    if scheme.inverse_scale_2:  # compressed-tensors' NVFP4 stores the multiplier's reciprocal
        t["scale_2"] = 1 / t["scale_2"]
    return t


def is_unused(scheme: Scheme, name: str) -> bool:
    return any(name.endswith("." + s) for s in scheme.unused)


# config.json's quantization_config `quant_method` -> its scheme (mlx has its own key)
_METHODS = {"fp8": _fp8_blocks, "compressed-tensors": _compressed, "modelopt": _modelopt}

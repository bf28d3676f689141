"""A PEFT LoRA adapter read from its folder and checked against the model, on the host.

PEFT writes `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight` (r, in) and
`.lora_B.weight` (out, r) per adapted module. y = W x + scaling * B (A x), scaling =
lora_alpha / r (lora_alpha / sqrt(r) with use_rslora); the scaling is folded into B here.
Every problem is an `InvalidRequestError` naming it (the server answers 400 and goes on).
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kestrel.errors import InvalidRequestError

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
# PEFT options that change the math beyond y += scaling * B A x, which kestrel does not serve
UNSUPPORTED = {
    "use_dora": (False, None),
    "modules_to_save": (None, []),
    "bias": ("none", None),
}


@dataclass
class LoRAAdapter:
    """One adapter: per model module name (kestrel's), A (r, in) and B (out, r), scaling in B."""

    name: str
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, path: str, shapes: dict[str, tuple[int, int]], max_rank: int, rename):
    """The adapter at `path`. `shapes`: module name -> (in, out) of every projection that takes
    an adapter; `rename(peft module path)` -> the model's module name (None: not the model's)."""
    folder = Path(path)
    config = _config(folder)
    weights, rank = {}, 0
    for module, (a, b) in _pairs(folder).items():
        target = rename(module)
        if target not in shapes and ".experts" in module:
            raise InvalidRequestError(
                f"adapter {name!r} adapts the routed MoE experts ({module!r}); kestrel serves "
                "adapters on attention, dense and shared-expert projections only",
                param="lora_path",
            )
        leaves = {n.rsplit(".", 1)[-1] for n in shapes}
        if target not in shapes and module.rsplit(".", 1)[-1] in leaves:
            raise InvalidRequestError(
                f"adapter {name!r} does not fit this base model: it adapts {module!r}, which "
                "the model does not have",
                param="lora_path",
            )
        if target not in shapes:
            supported = ", ".join(sorted(leaves)) or "none"
            raise InvalidRequestError(
                f"adapter {name!r} adapts {module!r}, which kestrel cannot adapt in this model "
                f"(LoRA projections here: {supported})",
                param="lora_path",
            )
        _check_shapes(name, module, a, b, shapes[target], max_rank)
        scaling = _scaling(config, module, a.shape[0])
        weights[target] = (a.float(), b.float() * scaling)
        rank = max(rank, a.shape[0])
    if not weights:
        raise InvalidRequestError(f"adapter {name!r}: {WEIGHTS} holds no LoRA weights", "lora_path")
    return LoRAAdapter(name, str(folder), rank, weights)


def _config(folder: Path) -> dict:
    file = folder / CONFIG
    if not file.is_file():
        raise InvalidRequestError(f"no {CONFIG} in {str(folder)!r}", param="lora_path")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise InvalidRequestError(f"{file}: not readable JSON ({error})", "lora_path") from error
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidRequestError(
            f"{file}: peft_type {config['peft_type']!r} is not LORA", "lora_path"
        )
    for key, off in UNSUPPORTED.items():
        if config.get(key) not in off:
            raise InvalidRequestError(
                f"{file}: {key}={config[key]!r} is not supported", "lora_path"
            )
    return config


def _pairs(folder: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT module path -> (A, B), from the safetensors file."""
    file = folder / WEIGHTS
    if not file.is_file():
        raise InvalidRequestError(f"no {WEIGHTS} in {str(folder)!r}", param="lora_path")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            module, half = _split_key(key, file)
            halves.setdefault(module, {})[half] = f.get_tensor(key)
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise InvalidRequestError(f"{file}: {module!r} lacks lora_A or lora_B", "lora_path")
    return {module: (pair["A"], pair["B"]) for module, pair in halves.items()}


def _split_key(key: str, file: Path) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (module, "A")."""
    body = key.removeprefix(PREFIX)
    for half in ("A", "B"):
        suffix = f".lora_{half}.weight"
        if body.endswith(suffix):
            return body.removesuffix(suffix), half
    raise InvalidRequestError(
        f"{file}: tensor {key!r} is not a LoRA A/B weight (embedding adapters, DoRA and saved "
        "modules are not supported)",
        param="lora_path",
    )


def _check_shapes(name, module, a, b, shape: tuple[int, int], max_rank: int) -> None:
    in_features, out_features = shape
    r = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
        raise InvalidRequestError(
            f"adapter {name!r}: {module!r} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}, not (r, in) and (out, r)",
            param="lora_path",
        )
    if (a.shape[1], b.shape[0]) != (in_features, out_features):
        raise InvalidRequestError(
            f"adapter {name!r} does not fit this base model: {module!r} maps {a.shape[1]} -> "
            f"{b.shape[0]} features, the model's {in_features} -> {out_features}",
            param="lora_path",
        )
    if r > max_rank:
        raise InvalidRequestError(
            f"adapter {name!r} has rank {r} on {module!r}, over --max-lora-rank {max_rank}",
            param="lora_path",
        )


def _scaling(config: dict, module: str, r: int) -> float:
    """PEFT's scaling of a module of rank r (its own, when rank_pattern gave it one): its
    alpha_pattern entry's alpha, else lora_alpha; over r, or sqrt(r) with use_rslora."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):  # peft's own matching of pattern keys
            alpha = value
            break
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r

"""GGUF files: tensors read with the `gguf` package and dequantized to float at load."""

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from kestrel.errors import ModelLoadError, UnsupportedModelError

FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open and validate a GGUF file, turning the library's errors into one that names the file."""
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, IndexError, OSError, KeyError) as e:
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({e})") from e


def architecture(reader: gguf.GGUFReader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError("GGUF file has no general.architecture")
    return field.contents()


def check_quant_types(reader: gguf.GGUFReader, path: Path) -> None:
    """Fail before any work when a tensor's quantization type cannot be dequantized."""
    for t in reader.tensors:
        if t.tensor_type not in FLOAT_TYPES and t.tensor_type not in gguf.quants._type_traits:
            raise UnsupportedModelError(
                f"{path}: tensor {t.name} has unsupported quantization type {t.tensor_type.name}"
            )


def dequantize(t) -> torch.Tensor:
    """One GGUF tensor as float32, in PyTorch's (out, in) shape order."""
    shape = tuple(int(d) for d in reversed(t.shape))
    array = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))


def name_map(reader: gguf.GGUFReader, param_names: list[str]) -> dict[str, str]:
    """GGUF tensor name -> our (Hugging Face) parameter name, through gguf's own name table."""
    arch_name = architecture(reader)
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise UnsupportedModelError(f"GGUF architecture {arch_name!r} has no gguf name table")
    n_blocks = int(reader.fields[f"{arch_name}.block_count"].contents())
    table = gguf.get_tensor_name_map(arch, n_blocks)
    mapping = {}
    for name in param_names:
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            mapping[gguf_name] = name
    return mapping


def read_tensors(
    reader: gguf.GGUFReader, param_names: list[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter name, float32 tensor) for every GGUF tensor the model declares."""
    mapping = name_map(reader, param_names)
    for t in reader.tensors:
        name = mapping.get(t.name)
        if name is not None:
            yield name, dequantize(t)

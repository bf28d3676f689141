"""GGUF files: tensors read with the `gguf` package and dequantized to float at load."""

from collections.abc import Callable, Iterator
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


# llama.cpp architecture -> model_type of the family that builds its config from the file's metadata
# (`CausalLM.config_from_gguf`): transformers reads these archs' configs incompletely or not at all
FAMILY_CONFIGS = {"gemma4": "gemma4", "exaone-moe": "exaone_moe", "deci": "nemotron-nas"}
# vocabulary arrays: large, and the tokenizer loader reads them itself
_SKIPPED_KEYS = {
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
}


class GGUFMetadata:
    """A GGUF file's metadata and tensor shapes, for a family to rebuild its config from.
    `meta["block_count"]` reads `<arch>.block_count`; `meta.get("general.name")` a full key."""

    def __init__(self, reader: gguf.GGUFReader):
        self.reader = reader
        self.arch = architecture(reader)
        self.fields = {k: f.contents() for k, f in reader.fields.items() if k not in _SKIPPED_KEYS}
        # tensor name -> shape in PyTorch's (out, in) order
        self.shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}

    def get(self, key: str, default=None):
        return self.fields.get(f"{self.arch}.{key}", self.fields.get(key, default))

    def __getitem__(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF file ({self.arch}) has no metadata key {self.arch}.{key}")
        return value

    def per_layer(self, key: str, n_layers: int, default=None) -> list:
        """A value llama.cpp writes either once or once per layer, as a per-layer list."""
        value = self.get(key, default)
        return list(value) if isinstance(value, list) else [value] * n_layers

    def tensor(self, name: str) -> torch.Tensor | None:
        t = next((t for t in self.reader.tensors if t.name == name), None)
        return None if t is None else dequantize(t)


def name_map(
    reader: gguf.GGUFReader, names_for: Callable[[gguf.TensorNameMap], dict[str, str]]
) -> dict[str, str]:
    """GGUF tensor name -> our checkpoint name: `names_for` (the model's `gguf_names`) reads gguf's
    name table for the file's architecture."""
    arch_name = architecture(reader)
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise UnsupportedModelError(f"GGUF architecture {arch_name!r} has no gguf name table")
    n_blocks = int(reader.fields[f"{arch_name}.block_count"].contents())
    return names_for(gguf.get_tensor_name_map(arch, n_blocks))


def read_tensors(
    reader: gguf.GGUFReader, names_for: Callable[[gguf.TensorNameMap], dict[str, str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, float32 tensor) for every GGUF tensor the model declares."""
    mapping = name_map(reader, names_for)
    for t in reader.tensors:
        name = mapping.get(t.name)
        if name is not None:
            yield name, dequantize(t)

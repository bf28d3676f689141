"""GGUF files: tensors read with the `gguf` package. The loader keeps the quantized types of
`kernels.quant.BLOCKS` as their blocks on the CPU and dequantizes the rest to float at load."""

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from kestrel.errors import ModelLoadError, UnsupportedModelError

FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}


class _Reader(gguf.GGUFReader):
    """gguf's reader, with each tensor's record checked first so that a bad one (unknown type,
    a row that is not whole blocks, data past the end of the file) is named; gguf's own errors
    do not say which tensor."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            _check_record(field, start_offs, len(self.data))
        super()._build_tensors(start_offs, fields)


def _check_record(field, start: int, file_size: int) -> None:
    _, name, _, dims, raw_type, offset = field.parts
    name = bytes(name).decode("utf-8", "replace")
    try:
        qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
    except ValueError:
        raise UnsupportedModelError(
            f"tensor {name} has unknown quantization type id {int(raw_type[0])}"
        ) from None
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    row = int(dims[0]) if len(dims) else 1
    if row % block:
        raise ModelLoadError(
            f"tensor {name}: rows of {row} elements are not whole {qtype.name} blocks of {block}"
        )
    end = start + int(offset[0]) + int(np.prod(dims)) // block * size
    if end > file_size:
        raise ModelLoadError(
            f"truncated or corrupt GGUF file: tensor {name} ({qtype.name}) needs bytes up to "
            f"{end}, the file has {file_size}"
        )


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open and validate a GGUF file, turning the library's errors into one that names the file."""
    try:
        return _Reader(str(path))
    except ModelLoadError as e:
        raise type(e)(f"{path}: {e}") from e
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


def torch_shape(t) -> tuple[int, ...]:
    """A GGUF tensor's shape in PyTorch's (out, in) order (GGUF lists the row length first)."""
    return tuple(int(d) for d in reversed(t.shape))


def dequantize(t) -> torch.Tensor:
    """One GGUF tensor as float32, in PyTorch's (out, in) shape order."""
    array = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(array, dtype=np.float32).reshape(torch_shape(t)))


def read_blocks(f, t) -> torch.Tensor:
    """A tensor's bytes, (rows, bytes per row) uint8, read from the open file `f` rather than
    through the reader's memory map, whose pages would stay resident beside the copy."""
    shape = torch_shape(t)
    out = torch.empty(t.n_bytes, dtype=torch.uint8)
    f.seek(t.data_offset)
    if f.readinto(memoryview(out.numpy())) != t.n_bytes:
        raise ModelLoadError(f"truncated or corrupt GGUF file: tensor {t.name} ends early")
    return out.view(int(np.prod(shape[:-1], dtype=np.int64)), -1)


def dequantize_blocks(blocks: torch.Tensor, t) -> torch.Tensor:
    """`read_blocks`' bytes of tensor `t` as float32 in its PyTorch shape (gguf's dequantize)."""
    array = blocks.numpy().view(t.data.dtype).reshape(t.data.shape)
    array = gguf.quants.dequantize(array, t.tensor_type)
    return torch.from_numpy(np.array(array, dtype=np.float32).reshape(torch_shape(t)))


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
        self.shapes = {t.name: torch_shape(t) for t in reader.tensors}

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
) -> list[tuple[str, gguf.ReaderTensor]]:
    """(checkpoint name, gguf's tensor record) for every GGUF tensor the model declares."""
    mapping = name_map(reader, names_for)
    return [(mapping[t.name], t) for t in reader.tensors if t.name in mapping]

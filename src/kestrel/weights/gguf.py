"""GGUF files: the header read by our own walker (`GGUFFile`), the type tables and dequantization
from the `gguf` package. The loader keeps the quantized types of `kernels.quant.BLOCKS` as their
blocks on the CPU and dequantizes the rest to float at load."""

import math
import mmap
import re
import struct
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch

from kestrel.errors import ModelLoadError, UnsupportedModelError

# llama.cpp's split checkpoints (gguf-split, convert_hf_to_gguf --split-max-*): shards named
# <prefix>-00001-of-00003.gguf; the first holds all the metadata, every shard `split.no` (from 0),
# `split.count` and `split.tensors.count` (all shards' tensors) and its own tensors
SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")

FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}

# We walk the header ourselves: gguf-py's reader builds numpy views of every metadata element,
# the 50k-entry vocabulary included, which costs seconds per load.
V = gguf.GGUFValueType
_SCALARS = {
    V.UINT8: "B",
    V.INT8: "b",
    V.UINT16: "H",
    V.INT16: "h",
    V.UINT32: "I",
    V.INT32: "i",
    V.FLOAT32: "f",
    V.BOOL: "?",
    V.UINT64: "Q",
    V.INT64: "q",
    V.FLOAT64: "d",
}
# tensor types gguf-py shows as elements; the others as (rows, bytes per row) blocks
_ELEMENTS = {
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


class _Walker:
    """Reads values at byte offsets of a GGUF file's memory map, in the file's byte order."""

    def __init__(self, buf: mmap.mmap, order: str):
        self.buf, self.order = buf, order

    def unpack(self, fmt: str, at: int) -> tuple:
        return struct.unpack_from(self.order + fmt, self.buf, at)

    def string(self, at: int, keep: bool = True) -> tuple[str | None, int]:
        (n,) = self.unpack("Q", at)
        end = at + 8 + n
        if end > len(self.buf):
            raise ValueError(f"a string at byte {at} runs past the end of the file")
        return (str(self.buf[at + 8 : end], "utf-8") if keep else None), end

    def value(self, at: int, vtype: gguf.GGUFValueType, keep: bool = True) -> tuple[Any, int]:
        """The value of type `vtype` at `at` (None unless `keep`) and the offset past it."""
        if vtype == V.STRING:
            return self.string(at, keep)
        if vtype == V.ARRAY:
            item, count = self.unpack("IQ", at)
            return self.array(at + 12, V(item), count, keep)
        fmt = _SCALARS[vtype]
        return (self.unpack(fmt, at)[0] if keep else None), at + struct.calcsize(fmt)

    def array(self, at: int, item: gguf.GGUFValueType, count: int, keep: bool) -> tuple[Any, int]:
        if item in _SCALARS:
            fmt = f"{count}{_SCALARS[item]}"
            return (list(self.unpack(fmt, at)) if keep else None), at + struct.calcsize(fmt)
        if item == V.STRING and not keep:  # the vocabulary: only its lengths are read
            for _ in range(count):
                at += 8 + self.unpack("Q", at)[0]
            return None, at
        values = []
        for _ in range(count):
            value, at = self.value(at, item, keep)
            values.append(value)
        return (values if keep else None), at


class Field(NamedTuple):
    """One metadata value, read when asked for: `contents()` is a str, number, bool or list, as
    with gguf-py's `ReaderField`; the vocabulary arrays are only walked past."""

    type: gguf.GGUFValueType
    walker: _Walker
    offset: int

    def contents(self) -> Any:
        return self.walker.value(self.offset, self.type)[0]


class TensorRecord(NamedTuple):
    """One tensor as gguf-py's `ReaderTensor` describes it: `shape` in GGUF order (row length
    first), `data_offset` from the start of `file` (its shard, for a split checkpoint), `data` a
    view of its bytes in gguf-py's dtype."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray
    file: Path


class GGUFFile:
    """A GGUF file's metadata `fields` (key -> `Field`) and `tensors` (`TensorRecord`s), over one
    memory map; every tensor record is checked (see `_check_record`). `open_gguf` adds the other
    shards' tensors of a split checkpoint."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(buf, dtype=np.uint8)
        self.walker = _Walker(buf, _byte_order(buf))
        version, n_tensors, n_fields = self.walker.unpack("IQQ", 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        self.fields = {
            "GGUF.version": Field(V.UINT32, self.walker, 4),
            "GGUF.tensor_count": Field(V.UINT64, self.walker, 8),
            "GGUF.kv_count": Field(V.UINT64, self.walker, 16),
        }
        records, end = self._read_records(self._read_fields(24, n_fields), n_tensors)
        self.tensors = self._tensors(records, self._data_start(end))

    def _read_fields(self, at: int, count: int) -> int:
        for _ in range(count):
            key, at = self.walker.string(at)
            vtype = V(self.walker.unpack("I", at)[0])
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key}")
            self.fields[key] = Field(vtype, self.walker, at + 4)
            _, at = self.walker.value(at + 4, vtype, keep=False)
        return at

    def _read_records(self, at: int, count: int) -> tuple[list[tuple], int]:
        """(name, dims, type id, offset in the data section) of each tensor, and the end."""
        records = []
        for _ in range(count):
            name, at = self.walker.string(at)
            (n_dims,) = self.walker.unpack("I", at)
            *dims, type_id, offset = self.walker.unpack(f"{n_dims}QIQ", at + 4)
            records.append((name, tuple(dims), type_id, offset))
            at += 4 + 8 * n_dims + 12
        return records, at

    def _data_start(self, end: int) -> int:
        """The tensor data's start: the header's end rounded up to `general.alignment`."""
        field = self.fields.get("general.alignment")
        align = gguf.GGUF_DEFAULT_ALIGNMENT if field is None else field.contents()
        if field is not None and field.type != V.UINT32:
            raise ValueError(f"general.alignment is a {field.type.name}, not a UINT32")
        if align == 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align} is not a power of two")
        return -(-end // align) * align

    def _tensors(self, records: list[tuple], start: int) -> list[TensorRecord]:
        tensors, names = [], set()
        for name, dims, type_id, offset in records:
            if name in names:
                raise ValueError(f"tensor {name} is listed twice")
            names.add(name)
            tensors.append(self._tensor(name, dims, type_id, start + offset))
        return tensors

    def _tensor(self, name: str, dims: tuple, type_id: int, at: int) -> TensorRecord:
        qtype = _check_record(name, dims, type_id, at, len(self.data))
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n_elements = math.prod(dims)
        n_bytes = n_elements // block * size
        shape = tuple(reversed(dims))
        data = self.data[at : at + n_bytes]
        if qtype in _ELEMENTS:
            data = data.view(np.dtype(_ELEMENTS[qtype]).newbyteorder(self.walker.order))
        else:
            shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
        return TensorRecord(
            name, qtype, dims, n_elements, n_bytes, at, data.reshape(shape), self.path
        )


def _byte_order(buf: mmap.mmap) -> str:
    """'<' or '>': a GGUF file is written in its machine's byte order, which the version shows."""
    if buf[:4] != b"GGUF":
        raise ValueError("no GGUF magic number")
    (version,) = struct.unpack_from("<I", buf, 4)
    return ">" if version & 0xFFFF == 0 else "<"


def _check_record(
    name: str, dims: tuple, type_id: int, at: int, file_size: int
) -> gguf.GGMLQuantizationType:
    """The tensor's type, once its record is known good: gguf's own errors name no tensor."""
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise UnsupportedModelError(
            f"tensor {name} has unknown quantization type id {type_id}"
        ) from None
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    row = dims[0] if dims else 1
    if row % block:
        raise ModelLoadError(
            f"tensor {name}: rows of {row} elements are not whole {qtype.name} blocks of {block}"
        )
    end = at + math.prod(dims) // block * size
    if end > file_size:
        raise ModelLoadError(
            f"truncated or corrupt GGUF file: tensor {name} ({qtype.name}) needs bytes up to "
            f"{end}, the file has {file_size}"
        )
    return qtype


def open_gguf(path: Path) -> GGUFFile:
    """Open and validate a GGUF file, turning read errors into one that names the file; the first
    shard of a split checkpoint reads as the whole model: its metadata, every shard's tensors."""
    reader = _open_one(path)
    count = _split_key(reader, "split.count", 1)
    if count > 1:
        _add_shards(reader, count)
    return reader


def _open_one(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except ModelLoadError as e:
        raise type(e)(f"{path}: {e}") from e
    except (ValueError, IndexError, OSError, KeyError, struct.error) as e:
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({e})") from e


def shard_name(prefix: str, no: int, count: int) -> str:
    """llama.cpp's file name of shard `no` (from 1) of `count` (its llama_split_path)."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def first_shard(path: Path) -> Path:
    """The shard holding a split checkpoint's metadata, for any of its shards; `path` when its
    name is no shard's."""
    m = SPLIT_NAME.fullmatch(path.name)
    return path if m is None else path.with_name(shard_name(m["prefix"], 1, int(m["count"])))


def _split_key(reader: GGUFFile, key: str, default: int) -> int:
    field = reader.fields.get(key)
    return default if field is None else int(field.contents())


def _add_shards(reader: GGUFFile, count: int) -> None:
    """The other shards' tensors join the first's (each record reads from its own file), found by
    llama.cpp's naming and checked against the split keys as llama.cpp checks them."""
    path = reader.path
    m = SPLIT_NAME.fullmatch(path.name)
    if m is None or _split_key(reader, "split.no", 0) != 0:
        raise ModelLoadError(
            f"{path}: a split GGUF checkpoint ({count} shards) loads from its first shard, "
            f"named <prefix>-00001-of-{count:05d}.gguf"
        )
    names = {t.name for t in reader.tensors}
    for no in range(1, count):
        shard = path.with_name(shard_name(m["prefix"], no + 1, count))
        if not shard.exists():
            raise ModelLoadError(f"{path}: shard {no + 1} of {count} is missing: {shard}")
        part = _open_one(shard)
        if _split_key(part, "split.no", -1) != no or _split_key(part, "split.count", 0) != count:
            raise ModelLoadError(f"{shard}: its split.no/split.count do not make it shard {no + 1}")
        if names & {t.name for t in part.tensors}:
            raise ModelLoadError(f"{shard}: holds tensors another shard holds")
        names |= {t.name for t in part.tensors}
        reader.tensors += part.tensors
    expected = _split_key(reader, "split.tensors.count", len(reader.tensors))
    if len(reader.tensors) != expected:
        raise ModelLoadError(
            f"{path}: the {count} shards hold {len(reader.tensors)} tensors; "
            f"split.tensors.count says {expected}"
        )


class ShardFiles(ExitStack):
    """The open files of a checkpoint's shards, opened as their tensors are read (`read_blocks`)
    and closed together."""

    def __init__(self):
        super().__init__()
        self.files: dict[Path, Any] = {}

    def __getitem__(self, path: Path):
        if path not in self.files:
            self.files[path] = self.enter_context(open(path, "rb"))
        return self.files[path]


def architecture(reader: GGUFFile) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelLoadError("GGUF file has no general.architecture")
    return field.contents()


def check_quant_types(reader: GGUFFile, path: Path) -> None:
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


def read_blocks(files: ShardFiles, t) -> torch.Tensor:
    """A tensor's bytes, (rows, bytes per row) uint8, read from its open file in `files` rather
    than through the reader's memory map, whose pages would stay resident beside the copy."""
    shape = torch_shape(t)
    out = torch.empty(t.n_bytes, dtype=torch.uint8)
    f = files[t.file]
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
FAMILY_CONFIGS = {
    "gemma4": "gemma4",
    "exaone-moe": "exaone_moe",
    "deci": "nemotron-nas",
    "nemotron_h": "nemotron_h",
    "nemotron_h_moe": "nemotron_h",
    "deepseek2": "glm4_moe_lite",
}
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

    def __init__(self, reader: GGUFFile):
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

    def vocabulary_fields(self) -> dict:
        """The config fields every family reads alike: vocabulary, tied head, BOS and EOS."""
        return dict(
            vocab_size=self.shapes["token_embd.weight"][0],
            tie_word_embeddings="output.weight" not in self.shapes,
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.get("tokenizer.ggml.eos_token_id"),
        )

    def tensor(self, name: str) -> torch.Tensor | None:
        t = next((t for t in self.reader.tensors if t.name == name), None)
        return None if t is None else dequantize(t)


def name_map(
    reader: GGUFFile, names_for: Callable[[gguf.TensorNameMap], dict[str, str]]
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
    reader: GGUFFile, names_for: Callable[[gguf.TensorNameMap], dict[str, str]]
) -> list[tuple[str, TensorRecord]]:
    """(checkpoint name, tensor record) for every GGUF tensor the model declares."""
    mapping = name_map(reader, names_for)
    return [(mapping[t.name], t) for t in reader.tensors if t.name in mapping]

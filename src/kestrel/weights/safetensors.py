"""Hugging Face checkpoint folders: `*.safetensors`, sharded or not."""

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kestrel.errors import ModelLoadError


def shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [f for f in files if not f.exists()]
    if missing or not files:
        raise ModelLoadError(
            f"{folder}: missing safetensors files {[str(m) for m in missing] or '*.safetensors'}"
        )
    return files


def read_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f in shard_files(folder):
        try:
            with safe_open(str(f), "pt") as shard:
                for name in shard.keys():
                    yield name, shard.get_tensor(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{f}: truncated or corrupt safetensors file ({e})") from e


def tensor_bytes(folder: Path) -> int:
    """Bytes of tensor data in the folder's shards: each file less its 8-byte length and header."""
    total = 0
    for f in shard_files(folder):
        with open(f, "rb") as shard:
            header = int.from_bytes(shard.read(8), "little")
        total += f.stat().st_size - 8 - header
    return total

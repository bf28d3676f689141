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


def read_tensors(folder: Path, wanted=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor, in file order; `wanted(name)` False: not read at all."""
    for f in shard_files(folder):
        try:
            with safe_open(str(f), "pt") as shard:
                for name in shard.keys():
                    if wanted is None or wanted(name):
                        yield name, shard.get_tensor(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{f}: truncated or corrupt safetensors file ({e})") from e


def _header(f: Path) -> tuple[int, dict]:
    """A shard's header: its length in bytes and its JSON (tensor name -> dtype, shape, offsets)."""
    with open(f, "rb") as shard:
        n = int.from_bytes(shard.read(8), "little")
        try:
            return n, json.loads(shard.read(n))
        except ValueError as e:
            raise ModelLoadError(f"{f}: truncated or corrupt safetensors file ({e})") from e


def tensor_bytes(folder: Path) -> int:
    """Bytes of tensor data in the folder's shards: each file less its 8-byte length and header."""
    return sum(f.stat().st_size - 8 - _header(f)[0] for f in shard_files(folder))


def tensor_dtypes(folder: Path) -> dict[str, int]:
    """How many tensors of each dtype (F32, BF16, ...) the shards hold."""
    counts: dict[str, int] = {}
    for f in shard_files(folder):
        for name, entry in _header(f)[1].items():
            if name != "__metadata__":
                counts[entry["dtype"]] = counts.get(entry["dtype"], 0) + 1
    return counts


def headers(folder: Path) -> dict[str, dict]:
    """Every tensor's header entry (dtype, shape, offsets) across the shards, in shard order."""
    entries: dict[str, dict] = {}
    for f in shard_files(folder):
        entries.update({k: v for k, v in _header(f)[1].items() if k != "__metadata__"})
    return entries


class Shards:
    """Random access to a folder's tensors by name, each shard opened once (memory-mapped), for
    formats whose one weight spans several tensors (packed values and their scales)."""

    def __init__(self, folder: Path):
        self.where: dict[str, Path] = {}
        self.headers: dict[str, dict] = {}  # name -> header entry (dtype, shape, offsets)
        for f in shard_files(folder):
            entries = {k: v for k, v in _header(f)[1].items() if k != "__metadata__"}
            self.where.update(dict.fromkeys(entries, f))
            self.headers.update(entries)
        self.open: dict[Path, object] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.open.clear()

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor | None:
        f = self.where.get(name)
        if f is None:
            return None
        try:
            if f not in self.open:
                self.open[f] = safe_open(str(f), "pt")
            return self.open[f].get_tensor(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{f}: truncated or corrupt safetensors file ({e})") from e

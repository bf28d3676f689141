"""kestrel's native CPU kernels (kernels/cpu/*.cpp), as `torch.ops.kestrel_cpu`: matmuls straight
from GGUF blocks, paged attention, and the fused norm / activation / RoPE ops. Compiled once per
machine with the system's C++ compiler against the installed torch (about 15 s), cached by a
hash of the sources, the torch version and the flags (in `KESTREL_KERNEL_CACHE`, by default
~/.cache/kestrel-kernels), and loaded at first use.

Why hand-written C++ rather than a library: PyTorch's packed int4/int8 CPU matmuls take one
scale per row or groups of 4-bit values only, so they cannot hold GGUF's 5-, 6- and 8-bit types
(gemma3-270m's q/k/gate/up are Q5_0, its head Q8_0) without requantizing, which changes the
model; and Inductor needs the same compiler, for kernels we could not shape. Where no compiler
works `available()` is False (with one log line saying why) and callers keep their PyTorch
paths. `KESTREL_NATIVE=0` turns them off (A/B runs). Imports nothing from kestrel.
"""

import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent / "cpu"
SOURCES = sorted(KERNELS.glob("*.cpp"))
HEADERS = sorted(KERNELS.glob("*.h"))
# the GGUF block types the kernels decode, by their code in gguf.cpp's TYPES
QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def available() -> bool:
    """Whether the kernels are loaded (compiling them first if this machine has not yet)."""
    return _load() is not None


def serves(qtype: str) -> bool:
    return qtype in QTYPES and available()


def gguf_mm(x: torch.Tensor, blocks: torch.Tensor, qtype: str, cols: int, int8=None):
    """(M, cols) activations @ W.T, W as GGUF `blocks` (rows, row bytes) -> (M, rows); decode's
    rows quantized to int8 where `int8` (by default `int8_activations()`)."""
    int8 = int8_activations() if int8 is None else int8
    return _ops().gguf_mm(x, blocks, QTYPES.index(qtype), cols, int8)


@functools.cache
def int8_activations() -> bool:
    """Whether decode multiplies GGUF blocks by activations quantized to int8 per 32 values
    (cpu/gguf_int8.h), as llama.cpp does: by default where this CPU has the int8 dot-product
    instruction (AVX-512 VNNI or AVX-VNNI), which makes it 2-4x faster than the float path;
    KESTREL_CPU_INT8=0 keeps the float path (exact to the file's weights), =1 forces int8."""
    choice = os.environ.get("KESTREL_CPU_INT8", "auto")
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"KESTREL_CPU_INT8 must be auto, 0 or 1, not {choice!r}")
    return choice == "1" or (choice == "auto" and _ops().fast_int8_dot())


def gguf_dequantize(blocks: torch.Tensor, qtype: str, cols: int) -> torch.Tensor:
    """(rows, row bytes) GGUF blocks -> (rows, cols) float32."""
    return _ops().gguf_dequantize(blocks.contiguous(), QTYPES.index(qtype), cols)


def paged_attention(q, store, meta, scale, window=None, value_dim=None):
    """cache/paged.py's paged_attention_torch (its reference) without gathering keys: q (T, Hq, D)
    -> (T, Hq, Dv) over `meta`, a PagedAttention, and `store`, a plain (not FP8) KVStore; its `v`
    None: values are the keys' first `value_dim` dims."""
    if store.k_scale is not None:
        raise ValueError("the CPU's native attention reads plain KV stores, not FP8 ones")
    return _ops().paged_attention(
        q, store.k, store.v, value_dim or 0, meta.positions, meta.tile_seq, meta.tile_start,
        meta.tile_len, meta.block_tables, meta.num_blocks, meta.n_sink, meta.main_start,
        meta.live_start, meta.keep, scale, window or 0,
    )  # fmt: skip


def rms_norm(x, weight, eps: float, unit_offset: bool) -> torch.Tensor:
    """(rows, H) with contiguous rows -> (rows, H), kernels/fused.py's rms_norm_torch."""
    return _ops().rms_norm(x, weight, eps, unit_offset)


def act_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """(T, 2I) [gate | up] -> (T, I) silu(gate) * up, or gelu-tanh(gate) * up."""
    return _ops().act_mul(gate_up, gelu)


def rope_store(qkv, cos, sin, hq, hkv, d, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """kernels/fused.py's rope_store: q rotated, k rotated and v written to their cache slots."""
    return _ops().rope_store(qkv, cos, sin, hq, hkv, d, k_cache, v_cache, slot_mapping)


def _ops():
    if _load() is None:
        raise RuntimeError("kestrel's CPU kernels are not available on this machine")
    return torch.ops.kestrel_cpu


@functools.cache
def _load() -> Path | None:
    if os.environ.get("KESTREL_NATIVE", "1") == "0":
        return None
    try:
        library = _build()
        torch.ops.load_library(str(library))
        return library
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        errors = [line for line in detail.splitlines() if "error" in line] or [detail[-400:]]
        log.warning("CPU kernels unavailable (PyTorch fallback, slower): %s", errors[0])
        return None


def _flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")  # AVX2 / AVX-512 where this machine has them
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths())]
    for lib in library_paths():
        flags += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    return [*flags, "-lc10", "-ltorch_cpu"]


def _build() -> Path:
    """The compiled library for this machine, from the cache or built now (atomically, so
    processes starting together do not read a half-written file)."""
    flags = _flags()
    digest = hashlib.sha256(" ".join([torch.__version__, sys.version, *flags]).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    # not under KESTREL_CACHE_DIR: a test's fresh cache of converted models needs no new compile
    cache = Path(os.environ.get("KESTREL_KERNEL_CACHE", Path.home() / ".cache" / "kestrel-kernels"))
    library = cache / f"kestrel_cpu-{digest.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    log.warning("compiling kestrel's CPU kernels (once per machine, about 15 s)")
    compiler = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        built = Path(tmp) / library.name
        cmd = [compiler, *map(str, SOURCES), "-o", str(built), *flags]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(built, library)
    return library

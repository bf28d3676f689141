"""kernels/gemv.py's one-row bf16 GEMV against `F.linear` (cuBLAS) on the decode projections of
the seed families and Llama-3.1-8B, on the GPU: microseconds per call in a CUDA graph and the
rate each reads its weights. `--sweep` also times rows per program, chunks per step and warps
(to choose gemv.py's defaults and MAX_BYTES).

    python benchmarks/bf16_gemv.py [--sweep] > results.jsonl
"""

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F
from benchmarks.quantized_gemv import timed

from kestrel.kernels import gemv

# (name, out, in): each family's single-row projections (fused where the runner fuses them)
SHAPES = [
    ("minicpm3-4b q_a+kv_a", 1056, 2560),
    ("minicpm3-4b q_b", 3840, 768),
    ("minicpm3-4b o", 2560, 2560),
    ("minicpm3-4b gate/up", 12800, 2560),
    ("minicpm3-4b down", 2560, 6400),
    ("glm-4.7-flash q_a+kv_a", 1344, 2048),
    ("glm-4.7-flash q_b", 5120, 768),
    ("glm-4.7-flash o", 2048, 5120),
    ("glm-4.7-flash shared gate/up", 3072, 2048),
    ("glm-4.7-flash shared down", 2048, 1536),
    ("glm-4.7-flash router", 64, 2048),
    ("qwen3-vl-30b-a3b qkv", 5120, 2048),
    ("qwen3-vl-30b-a3b o", 2048, 4096),
    ("qwen3-vl-30b-a3b router", 128, 2048),
    ("gemma4-26b-a4b qkv", 8192, 2816),
    ("gemma4-26b-a4b o", 2816, 4096),
    ("gemma4-26b-a4b gate/up", 4224, 2816),
    ("gemma4-26b-a4b down", 2816, 2112),
    ("llama3-8b o", 4096, 4096),
    ("llama3-8b qkv", 6144, 4096),
    ("llama3-8b down", 4096, 14336),
]
CONFIGS = list(itertools.product((1, 2, 4, 8), (8, 16, 32, 64), (1, 2, 4, 8)))


def measure(name: str, out: int, cols: int, sweep: bool) -> dict:
    w = torch.randn(out, cols, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
    gemv_us, cublas_us = timed(lambda: gemv.gemv(x, w)), timed(lambda: F.linear(x, w))
    row = dict(shape=name, out=out, cols=cols, mb=round(w.numel() * 2 / 2**20, 1))
    row |= dict(cublas_us=round(cublas_us, 2), gemv_us=round(gemv_us, 2))
    row["cublas_tb_s"] = round(w.numel() * 2 / cublas_us / 1e6, 2)
    row["gemv_tb_s"] = round(w.numel() * 2 / gemv_us / 1e6, 2)
    row["served"] = gemv.serves(x, w)
    if sweep:
        times = sorted((timed(lambda c=c: gemv.gemv(x, w, config=c)), c) for c in CONFIGS)
        row["best"] = [(round(t, 2), c) for t, c in times[:5]]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    for name, out, cols in SHAPES:
        row = measure(name, out, cols, args.sweep)
        row["commit"] = os.environ.get("KESTREL_COMMIT")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

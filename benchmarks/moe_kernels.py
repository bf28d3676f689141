"""One MoE layer's routed experts on the GPU: the fused Triton kernels against the PyTorch experts
(gathered bmm for few pairs, grouped GEMM for many), on the seed MoE shapes, bf16, random weights
and uniform random routing. Prints one JSON line per (shape, tokens): microseconds per layer for
both and, for the fused kernels, the rate at which they read the chosen experts' weights.

    python benchmarks/moe_kernels.py [--tokens 1 8 64 512 4096] [--sweep]

`--sweep` also times a few tile settings per size (to choose `kernels.moe.tiles`)."""

import argparse
import json
import os

import torch

from kestrel.kernels import moe
from kestrel.models.layers.moe import Experts, route_topk

# (experts, top-k, hidden, expert width, activation, gated) from weights/shapes.py
SHAPES = {
    "qwen3-vl-30b-a3b": (128, 8, 2048, 768, "silu", True),
    "glm-4.7-flash": (64, 4, 2048, 1536, "silu", True),
    "gemma4-26b-a4b": (128, 8, 2816, 704, "gelu_pytorch_tanh", True),
}
SWEEP = [
    dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
    for n in (32, 64, 128)
    for k in (64, 128, 256)
    for w in (4,)
    for s in (3, 4)
]
SWEEP_SORTED = [
    dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
    for m in (64, 128)
    for n in (64, 128)
    for k in (64,)
    for w in (4, 8)
    for s in (3, 4)
]


def timed(fn, iters: int = 50) -> float:
    """Microseconds per call, replayed from a CUDA graph (as decode runs)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def measure(shape: str, tokens: int, sweep: bool) -> dict:
    E, k, H, inter, act, gated = SHAPES[shape]
    experts = Experts(E, H, inter, act, gated).to("cuda", torch.bfloat16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    weights, ids = route_topk(torch.randn(tokens, E, device="cuda"), k)
    read = ids.unique().numel() * sum(p[0].numel() * 2 for p in experts.parameters())
    fused_us = timed(lambda: experts(x, weights, ids))
    row = dict(shape=shape, tokens=tokens, pairs=tokens * k, fused_us=round(fused_us, 1))
    row["pytorch_us"] = round(timed(lambda: experts.reference(x, weights, ids)), 1)
    row["fused_weights_tb_s"] = round(read / fused_us / 1e6, 2)
    if sweep:
        row["sweep"] = sweep_tiles(experts, x, weights, ids, tokens * k <= E)
    return row


def sweep_tiles(experts, x, weights, ids, one_pair: bool) -> list:
    default, results = moe.tiles, []
    for tile in SWEEP if one_pair else SWEEP_SORTED:
        moe.tiles = lambda *_, tile=tile: tile
        try:
            results.append((round(timed(lambda: experts(x, weights, ids), 20), 1), tile))
        except Exception as e:  # a tile that does not fit shared memory
            results.append((None, dict(tile, error=type(e).__name__)))
        finally:
            moe.tiles = default
    return sorted(results, key=lambda r: float("inf") if r[0] is None else r[0])[:5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512, 4096])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    for shape in args.shapes:
        for tokens in args.tokens:
            row = measure(shape, tokens, args.sweep)
            row.update(device=torch.cuda.get_device_name(), commit=os.environ.get("KESTREL_COMMIT"))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

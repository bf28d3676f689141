"""One MoE layer's routed experts on the GPU: the fused Triton kernels against the PyTorch experts
(gathered bmm for few pairs, grouped GEMM for many), on the seed MoE shapes, bf16 or FP8
(`--fp8`: the experts quantized per row in groups of 128 columns, read by the kernels as FP8),
random weights and uniform random routing. Prints one JSON line per (shape, tokens):
microseconds per layer for both (PyTorch in bf16 only) and, for the fused kernels, the rate at
which they read the chosen experts' weights.

    python benchmarks/moe_kernels.py [--tokens 1 8 64 512 4096] [--fp8] [--sweep]

`--sweep` also times a few launch settings per size (to choose `kernels.moe.tiles`, or, where
decode's pair GEMVs serve, `kernels.moe_gemv`'s launch constants: those of one row set at a
time and those of a token's rows read together, each forced for the size, so `--tokens 1 2 4
--sweep` also says up to how many tokens reading together pays: `TOGETHER_TOKENS`)."""

import argparse
import json
import os

import torch

from kestrel.kernels import fp8_activations, moe, moe_gemv
from kestrel.models.layers.moe import Experts, route_topk

# (experts, top-k, hidden, expert width, activation, gated) from weights/shapes.py
SHAPES = {
    "qwen3-vl-30b-a3b": (128, 8, 2048, 768, "silu", True),
    "glm-4.7-flash": (64, 4, 2048, 1536, "silu", True),
    "gemma4-26b-a4b": (128, 8, 2816, 704, "gelu_pytorch_tanh", True),
}
GEMV_KNOBS = ("BLOCK_N", "CHUNKS", "WARPS", "MIN_PROGRAMS")  # one row set at a time
SWEEP_GEMV = [
    dict(zip(GEMV_KNOBS, (n, c, w, p), strict=True))
    for n in (1, 2, 4, 8)
    for c in (16, 32, 64)
    for w in (1, 2, 4)
    for p in (512, 2048)
]
TOGETHER_KNOBS = ("ROWS", "LOADS", "WARPS", "MIN_PROGRAMS")  # a token's rows read together
SWEEP_TOGETHER = [
    dict(zip(TOGETHER_KNOBS, (n, c, w, p), strict=True))
    for n in (4, 8, 16)
    for c in (64, 128, 256)
    for w in (1, 2, 4)
    for p in (512, 2048)
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


def fp8_stack(w: torch.Tensor) -> moe.QuantStack:
    """w (E, N, K) as FP8 with a float32 scale per row per 128 columns: each expert row
    quantized as the FP8 GEMM quantizes an activation row (kernels/fp8_activations.py)."""
    (E, N, K), group = w.shape, fp8_activations.GROUP
    if K % group:
        raise ValueError(f"--fp8 takes whole {group}-column groups; an expert stack is {K} wide")
    values, scales = fp8_activations.quantize(w.reshape(E * N, K))  # rows padded to 4
    values, scales = values[: E * N].view(E, N, K), scales[: E * N].contiguous()
    return moe.QuantStack(values, scales.view(E, N, K // group), None, 0, group)


def measure(shape: str, tokens: int, fp8: bool, sweep: bool) -> dict:
    E, k, H, inter, act, gated = SHAPES[shape]
    experts = Experts(E, H, inter, act, gated).to("cuda", torch.bfloat16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    weights, ids = route_topk(torch.randn(tokens, E, device="cuda"), k)
    stacks = [fp8_stack(w) if fp8 else w for w in experts.stacks]
    read = ids.unique().numel() * sum(p[0].numel() * (1 if fp8 else 2) for p in experts.stacks)

    def fused():
        return moe.fused_experts(x, *stacks, weights, ids, act, gated)

    fused_us = timed(fused)
    row = dict(shape=shape, tokens=tokens, pairs=tokens * k, fp8=fp8, fused_us=round(fused_us, 1))
    if not fp8:
        row["pytorch_us"] = round(timed(lambda: experts.reference(x, weights, ids)), 1)
    row["fused_weights_tb_s"] = round(read / fused_us / 1e6, 2)
    if sweep:
        row["sweep"] = sweep_gemv(fused, tokens) if tokens * k <= E else sweep_tiles(fused)
    return row


def sweep_gemv(fused, tokens: int) -> list:
    """The five fastest settings of the pair GEMVs, read one row set at a time
    (TOGETHER_TOKENS 0) or together (TOGETHER_TOKENS = tokens)."""
    knobs = ("TOGETHER_TOKENS", *GEMV_KNOBS, *TOGETHER_KNOBS)
    default, results = {knob: getattr(moe_gemv, knob) for knob in knobs}, []
    configs = [dict(c, TOGETHER_TOKENS=0) for c in SWEEP_GEMV]
    configs += [dict(c, TOGETHER_TOKENS=tokens) for c in SWEEP_TOGETHER]
    for config in configs:
        vars(moe_gemv).update(config)
        results.append((round(timed(fused, 20), 1), config))
    vars(moe_gemv).update(default)
    return sorted(results, key=lambda r: r[0])[:5]


def sweep_tiles(fused) -> list:
    default, results = moe.tiles, []
    for tile in SWEEP_SORTED:
        moe.tiles = lambda *_, tile=tile: tile
        try:
            results.append((round(timed(fused, 20), 1), tile))
        except Exception as e:  # a tile that does not fit shared memory
            results.append((None, dict(tile, error=type(e).__name__)))
        finally:
            moe.tiles = default
    return sorted(results, key=lambda r: float("inf") if r[0] is None else r[0])[:5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512, 4096])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--fp8", action="store_true", help="FP8 experts (128-column groups)")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    for shape in args.shapes:
        for tokens in args.tokens:
            row = measure(shape, tokens, args.fp8, args.sweep)
            row.update(device=torch.cuda.get_device_name(), commit=os.environ.get("KESTREL_COMMIT"))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

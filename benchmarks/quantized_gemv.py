"""The quantized GEMVs (kernels/gguf_gemv.py, kernels/gguf_dp4a.py, kernels/fp8_gemv.py) against
bf16 `F.linear` on Llama-3.1-8B's projection shapes, one row of x (single-stream decode), on the
GPU. Prints one JSON line per (type, shape): microseconds for both, and the rate at which the
GEMV reads its weights. Types: the GGUF block types and FP8 (e4m3 in 128 x 128 scale tiles); each
runs through `QuantLinear`, so the kernel is the one a decode step uses (for the k-quants, the
int8 kernels; `--float` adds the float kernels' figures for them).

    python benchmarks/quantized_gemv.py [--sweep] [--types Q4_K FP8 ...] > results.jsonl
    python benchmarks/quantized_gemv.py --plot results.svg --from results.jsonl  # matplotlib

`--sweep` also times rows per program, tiles per step and warps on the gate/up and down shapes
(to choose the CONFIGS of kernels/gguf_dp4a.py for the k-quants, of kernels/gguf_gemv.py for the
rest).
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F

from kestrel.kernels import gguf_dp4a, gguf_gemv
from kestrel.kernels.formats import FP8Format
from kestrel.kernels.quant import LAYOUTS
from kestrel.models.layers.quant import QuantLinear

# (out, in) of Llama-3.1-8B's q, k/v, o, gate/up and down projections
SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]


def timed(fn, iters: int = 200) -> float:
    """Microseconds per call, from a CUDA graph of `iters` calls (launch cost as in decode)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def quantized(qtype: str, out: int, cols: int, kernel=None):
    """(weights, the GEMV on x) of random bytes in `qtype`: the `QuantLinear` a model holds, or
    `kernel(x, blocks, qtype, cols)` on its blocks."""
    if qtype == "FP8":
        w = torch.randn(out, cols, device="cuda").to(torch.float8_e4m3fn)
        scale = torch.rand(out // 128, cols // 128, device="cuda")
        return w, QuantLinear(w, FP8Format(block=(128, 128)), cols, scale=scale)
    elements, size = LAYOUTS[qtype]
    blocks = torch.randint(0, 256, (out, cols // elements * size), dtype=torch.uint8).cuda()
    if kernel is not None:
        return blocks, lambda x: kernel(x, blocks, qtype, cols)
    return blocks, QuantLinear(blocks, qtype, cols)


def measure(qtype: str, out: int, cols: int, kernel=None) -> dict:
    blocks, product = quantized(qtype, out, cols, kernel)
    x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(out, cols, device="cuda", dtype=torch.bfloat16)
    packed_us = timed(lambda: product(x))
    row = dict(qtype=qtype, out=out, cols=cols, gemv_us=round(packed_us, 2))
    if kernel is not None:
        row["kernel"] = kernel.__module__.rsplit(".", 1)[-1]
    row["bf16_us"] = round(timed(lambda: F.linear(x, w)), 2)
    row["gemv_tb_s"] = round(blocks.numel() / packed_us / 1e6, 2)
    row["speedup"] = round(row["bf16_us"] / row["gemv_us"], 2)
    return row


def sweep(qtype: str, out: int, cols: int) -> list:
    """The five fastest (microseconds, (rows per program, tiles per step, warps))."""
    elements, size = LAYOUTS[qtype]
    blocks = torch.randint(0, 256, (out, cols // elements * size), dtype=torch.uint8).cuda()
    x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
    gemv = (gguf_dp4a if qtype in gguf_dp4a.TYPES else gguf_gemv).gemv
    configs = [(b, s, w) for b in (1, 2, 4, 8, 16) for s in (1, 2, 4, 8) for w in (1, 2, 4)]
    times = [(round(timed(lambda c=c: gemv(x, blocks, qtype, cols, c), 50), 2), c) for c in configs]
    return sorted(times)[:5]


def plot(records: list[dict], path: str) -> None:
    """Each GEMV's speed-up over bf16 `F.linear` on the same shape, a panel per projection
    shape; the dashed line is parity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if "gemv_us" in r]
    shapes = list(dict.fromkeys((r["out"], r["cols"]) for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.6), sharey=True)
    for ax, (out, cols) in zip(axes, shapes, strict=True):
        mine = [r for r in rows if (r["out"], r["cols"]) == (out, cols)]
        drawn = ax.bar([r["qtype"] for r in mine], [r["speedup"] for r in mine])
        ax.bar_label(drawn, [f"{r['speedup']:.2f}" for r in mine], fontsize=7)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_title(f"{out} x {cols}, one row of x", fontsize=9)
        ax.tick_params(axis="x", labelrotation=60, labelsize=8)
    axes[0].set_ylabel("speed-up over bf16 F.linear")
    fig.suptitle(f"Quantized GEMVs on the {rows[0]['device']} (commit {rows[0]['commit']})")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--float", action="store_true", help="the k-quants' float kernels too")
    types = [*sorted(gguf_gemv.TYPES), "FP8"]
    parser.add_argument("--types", nargs="+", default=types, choices=types)
    parser.add_argument("--plot", help="draw the results of --from into this SVG")
    parser.add_argument("--from", dest="source", help="JSON lines of an earlier run")
    args = parser.parse_args()
    if args.plot:
        plot([json.loads(line) for line in open(args.source)], args.plot)
        return
    for qtype in args.types:
        for out, cols in SHAPES:
            kernels = [None]
            if args.float and qtype in gguf_dp4a.TYPES:
                kernels.append(gguf_gemv.gemv)
            for kernel in kernels:
                row = measure(qtype, out, cols, kernel)
                row.update(
                    device=torch.cuda.get_device_name(), commit=os.environ.get("KESTREL_COMMIT")
                )
                print(json.dumps(row), flush=True)
        if args.sweep and qtype in gguf_gemv.TYPES:
            for out, cols in SHAPES[2:]:
                best = sweep(qtype, out, cols)
                print(json.dumps(dict(qtype=qtype, out=out, cols=cols, sweep=best)), flush=True)


if __name__ == "__main__":
    main()

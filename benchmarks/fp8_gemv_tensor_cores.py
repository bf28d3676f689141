"""An FP8 decode GEMV on the tensor cores, tried against kestrel's CUDA-core GEMV
(kernels/fp8_gemv.py) and bf16 `F.linear` on Llama-3.1-8B's projection shapes; not used by
kestrel. x is quantized to FP8 per 1 x 128 group as the prefill GEMM does (`inline`: inside each
program; `pre`: by kernels/fp8_activations.py first), then one wgmma (64 x 16 x 32, x's row padded
to 16) per 128 columns, K split across programs where rows are few (the last program of a row
block sums the parts). Each kernel's best of the CONFIGS (rows per program, K splits, stages,
warps), and its error against x @ dequantized W. One JSON line per (shape, rows of x):

    python benchmarks/fp8_gemv_tensor_cores.py 1 4 > results.jsonl

Measured (docs/performance/h200.md): one row of x, it is slower than the CUDA-core GEMV (the x
quantization and the padded accumulator cost more than the instructions it saves) and 15x less
exact (FP8 x); at 4 rows it is 2-3.5x faster, since the CUDA-core GEMV reads W once per row."""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks.quantized_gemv import timed  # noqa: E402

from kestrel.kernels import fp8_activations, fp8_gemv  # noqa: E402
from kestrel.kernels.quant import fp8_groups  # noqa: E402

INV = tl.constexpr(1 / 448)
SMALLEST = tl.constexpr(1e-12)


@triton.jit
def _finish(acc, Y, PART, COUNT, block, split, M, N, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    xm = tl.arange(0, 16)
    out_rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (out_rows[:, None] < N) & (xm[None, :] < M)
    y_at = xm[None, :] * N + out_rows[:, None]
    if SPLIT == 1:
        tl.store(Y + y_at, acc.to(Y.dtype.element_ty), mask=ok)
    else:
        tl.store(PART + split * M * N + y_at, acc, mask=ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(COUNT + block, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            total = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
            for s in range(SPLIT):
                total += tl.load(PART + s * M * N + y_at, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(Y + y_at, total.to(Y.dtype.element_ty), mask=ok)
            tl.atomic_xchg(COUNT + block, 0)


@triton.jit
def _program(
    W, S, N, K, w_stride, tile_rows, scale_stride, groups_per_split, BLOCK_N: tl.constexpr
):
    """This program's (row block, K split, first and end group of 128 columns, its weights'
    first tile, its rows' scale pointers)."""
    block = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.minimum(block * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    first = split * groups_per_split
    last = tl.minimum(first + groups_per_split, K // 128)
    w_at = W + rows[:, None] * w_stride + (first * 128 + tl.arange(0, 128))[None, :]
    return block, split, first, last, w_at, S + (rows // tile_rows) * scale_stride


@triton.jit
def _inline(
    X, W, S, Y, PART, COUNT, M, N, K, x_stride, w_stride, tile_rows, tile_shift, scale_stride,
    groups_per_split, BLOCK_N: tl.constexpr, ONE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    block, split, first, last, w_at, s_at = _program(
        W, S, N, K, w_stride, tile_rows, scale_stride, groups_per_split, BLOCK_N
    )
    xm = tl.arange(0, 16)
    cols = tl.arange(0, 128)
    x_at = X + xm[:, None] * x_stride + (first * 128 + cols)[None, :]
    x_in = xm[:, None] < M
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for g in range(first, last):
        w = tl.load(w_at)
        sw = tl.load(s_at + ((g * 128) >> tile_shift))
        if ONE:
            x1 = tl.load(X + g * 128 + cols).to(tl.float32)
            s1 = tl.maximum(tl.max(tl.abs(x1), 0) * INV, SMALLEST)
            q1 = (x1 * (1.0 / s1)).to(tl.float8e4nv)
            part = tl.dot(w, tl.trans(tl.broadcast_to(q1[None, :], (16, 128))))
            acc += part * (sw * s1)[:, None]
        else:
            x = tl.load(x_at, mask=x_in, other=0.0).to(tl.float32)
            sx = tl.maximum(tl.max(tl.abs(x), 1) * INV, SMALLEST)
            xq = (x * (1.0 / sx)[:, None]).to(tl.float8e4nv)
            part = tl.dot(w, tl.trans(xq))
            acc += part * sw[:, None] * sx[None, :]
        w_at += 128
        x_at += 128
    _finish(acc, Y, PART, COUNT, block, split, M, N, BLOCK_N, SPLIT)


@triton.jit
def _pre(
    XQ, XS, W, S, Y, PART, COUNT, M, M4, N, K, w_stride, tile_rows, tile_shift, scale_stride,
    groups_per_split, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    block, split, first, last, w_at, s_at = _program(
        W, S, N, K, w_stride, tile_rows, scale_stride, groups_per_split, BLOCK_N
    )
    xm = tl.arange(0, 16)
    cols = tl.arange(0, 128)
    x_at = XQ + tl.minimum(xm, M4 - 1)[:, None] * K + (first * 128 + cols)[None, :]
    xs_at = XS + first * M4 + tl.minimum(xm, M4 - 1)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for g in range(first, last):
        w = tl.load(w_at)
        xq = tl.load(x_at)
        sx = tl.load(xs_at)
        sw = tl.load(s_at + ((g * 128) >> tile_shift))
        part = tl.dot(w, tl.trans(xq))
        acc += part * sw[:, None] * sx[None, :]
        w_at += 128
        x_at += 128
        xs_at += M4
    _finish(acc, Y, PART, COUNT, block, split, M, N, BLOCK_N, SPLIT)


COUNT = None


def launch(kind, x, w, scale, block_n, split, stages, warps):
    global COUNT
    if COUNT is None:
        COUNT = torch.zeros(4096, dtype=torch.int32, device="cuda")
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    groups = K // 128
    gps = triton.cdiv(groups, split)
    split = triton.cdiv(groups, gps)
    part = torch.empty(split, M, N, device=x.device, dtype=torch.float32) if split > 1 else y
    grid = (triton.cdiv(N, block_n), split)
    common = dict(BLOCK_N=block_n, SPLIT=split, num_warps=warps, num_stages=stages)
    tiles = (min(128, N), 7, scale.stride(0))
    if kind == "inline":
        _inline[grid](
            x,
            w,
            scale,
            y,
            part,
            COUNT,
            M,
            N,
            K,
            x.stride(0),
            w.stride(0),
            *tiles,
            gps,
            ONE=M == 1,
            **common,
        )
    else:
        xq, xs = fp8_activations.quantize(x)
        _pre[grid](
            xq,
            xs,
            w,
            scale,
            y,
            part,
            COUNT,
            M,
            xq.shape[0],
            N,
            K,
            w.stride(0),
            *tiles,
            gps,
            **common,
        )
    return y


SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096)]
CONFIGS = [
    (bn, sp, st, wa)
    for bn, wa in ((64, 4), (128, 4), (128, 8))
    for sp in (1, 2, 4, 8)
    for st in (4,)
]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return round(((got.float() - want).norm() / want.norm()).item(), 5)


def best_configs(kind, x, w, scale, quantized_x_ref) -> list:
    """The four fastest CONFIGS: (microseconds, config, error against quantized x @ W,
    whether two calls give the same bytes)."""
    found = []
    for cfg in CONFIGS:
        try:
            y = launch(kind, x, w, scale, *cfg)
            same = torch.equal(y, launch(kind, x, w, scale, *cfg))
            us = timed(lambda cfg=cfg: launch(kind, x, w, scale, *cfg))
            found.append((round(us, 2), cfg, relative_error(y, quantized_x_ref), same))
        except Exception as e:  # noqa: BLE001 (a config that does not compile)
            found.append((1e9, cfg, repr(e)[:200], False))
    return sorted(found, key=lambda b: b[0])[:4]


def measure(out: int, cols: int, M: int) -> dict:
    w = torch.randn(out, cols, device="cuda").to(torch.float8_e4m3fn)
    scale = torch.rand(out // 128, cols // 128, device="cuda") / 100
    wb = torch.randn(out, cols, device="cuda", dtype=torch.bfloat16)
    deq = w.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    x = torch.randn(M, cols, device="cuda", dtype=torch.bfloat16)
    xq, xs = fp8_groups(x)
    x_rounded = (xq.float()[:M].view(M, -1, 128) * xs[:M, :, None]).view(M, cols)
    exact = x.float() @ deq.T
    row = dict(out=out, cols=cols, M=M, gb=w.numel() / 1e9)
    row["bf16_us"] = round(timed(lambda: F.linear(x, wb)), 2)
    row["cuda_cores_us"] = round(timed(lambda: fp8_gemv.gemv(x, w, scale, (128, 128))), 2)
    row["cuda_cores_exact_err"] = relative_error(fp8_gemv.gemv(x, w, scale, (128, 128)), exact)
    row["quantize_us"] = round(timed(lambda: fp8_activations.quantize(x)), 2)
    for kind in ("inline", "pre"):
        row[kind] = best_configs(kind, x, w, scale, x_rounded @ deq.T)
        row[kind + "_exact_err"] = relative_error(
            launch(kind, x, w, scale, *row[kind][0][1]), exact
        )
    return row


def main():
    torch.manual_seed(0)
    for out, cols in SHAPES:
        for M in [int(a) for a in sys.argv[1:]] or [1]:
            print(json.dumps(measure(out, cols, M)), flush=True)


if __name__ == "__main__":
    main()

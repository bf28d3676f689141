"""Fused mixture-of-experts: every routed (token, expert) pair in two Triton kernels.

In the grouped GEMMs, the first multiplies each pair's token by its expert's gate and up rows
and applies the activation in registers (act(gate) * up, or act(up) for ungated experts),
writing one (P, I) intermediate; the second multiplies that by the expert's down rows and scales
each pair by its routing weight, so a step of an MoE layer is two kernels plus the sum over each
token's k pairs. Expert weights are read where they lie (no gathered copy), so decode reads each
chosen expert once; FP8 and MLX 4- and 8-bit stacks (`QuantStack`) are read quantized, each tile
dequantized in registers. Both kernel families take a stack as a `KernelStack`.

With few pairs (decode: no more pairs than experts, so they rarely share one) each pair is a GEMV
of its own (kernels/moe_gemv.py), no sorting at all, and the second kernel also sums each
token's pairs. With many (prefill, large batches) pairs reach an expert in blocks of BLOCK_M
rows: they are sorted by expert and each expert's run is padded to whole blocks, with the block
count bounded by the number of pairs so the grid is static (CUDA graphs) and nothing is read
back to the host.

The PyTorch path in models/layers/moe.py is the CPU path and these kernels' oracle in the GPU tests.
This module imports nothing from kestrel outside kestrel.kernels: kernels are the bottom of the
import graph.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kestrel.kernels import fused, moe_gemv
from kestrel.kernels.backend import on_triton
from kestrel.kernels.fused import ACTIVATION_IDS

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path serves
    triton = None


def available(x: torch.Tensor, act: str | None = None) -> bool:
    """Whether the kernels serve these inputs: CUDA and Triton, and for `fused_experts` an
    activation they compute (`act`; None asks for `route`)."""
    return on_triton(x) and (act is None or act in ACTIVATION_IDS)


@dataclass(frozen=True)
class QuantStack:
    """An expert stack (E, N, K) the kernels dequantize tile by tile as they read it. FP8
    (`bits` 0): float8_e4m3fn values (E, N, K) times float32 `scales` (E, N, K / group); MLX
    affine: `bits` 4 or 8 values packed little end first in int32 words (E, N, K * bits / 32),
    times `scales` plus `biases` (E, N, K / group). A group may span a row (group >= K); a
    shorter one is a power of two of at least 16 (`tiles_groups`)."""

    values: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor | None
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int, int]:
        E, N, width = self.values.shape
        return E, N, width * 32 // self.bits if self.bits else width

    @property
    def tiles_groups(self) -> bool:
        """Whether the kernels tile its scale groups: a group spans the row or is a power of
        two of at least 16."""
        group = self.group
        return group >= self.shape[2] or (group >= 16 and group & (group - 1) == 0)


class KernelStack(NamedTuple):
    """An expert stack as the kernels take it: the values W (E, N, K, or K's MLX words), the
    scales and biases (W itself where the format has none: pointers never read), scale groups
    per row, and the flags: QUANT (0 float, 1 FP8, 2 MLX), BITS (MLX's) and GROUP (columns a
    scale covers)."""

    w: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    groups: int
    QUANT: int = 0
    BITS: int = 0
    GROUP: int = 1

    def pointers(self) -> tuple:
        """The kernels' weight arguments: W, scales, biases, groups per row."""
        return self.w, self.scales, self.biases, self.groups

    def flags(self) -> dict:
        return dict(QUANT=self.QUANT, BITS=self.BITS, GROUP=self.GROUP)


def kernel_stack(w: torch.Tensor | QuantStack) -> KernelStack:
    """A float stack (E, N, K) or a `QuantStack` as the kernels take it."""
    if not isinstance(w, QuantStack):
        return KernelStack(w, w, w, 1)
    biases = w.scales if w.biases is None else w.biases  # FP8: a pointer never read
    quant, group = 2 if w.bits else 1, min(w.group, w.shape[2])
    return KernelStack(w.values, w.scales, biases, w.scales.shape[-1], quant, w.bits, group)


def fused_experts(
    x: torch.Tensor,
    w_in: torch.Tensor | QuantStack,
    w_down: torch.Tensor | QuantStack,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: str,
    gated: bool,
) -> torch.Tensor:
    """x (T, H), w_in (E, 2I or I, H), w_down (E, H, I), weights/ids (T, k) -> (T, H): the sum
    over k of weight * down(act(gate) * up) (or down(act(up)) when not gated). Either stack may
    be a `QuantStack`, read quantized."""
    T, k = ids.shape
    E, H, inter = w_down.shape
    w_in, w_down = kernel_stack(w_in), kernel_stack(w_down)
    args = (x, w_in, w_down, weights, ids, ACTIVATION_IDS[act], gated, H, inter)
    decode = ids.numel() <= E  # pairs rarely share an expert: each reads its own once
    if decode and moe_gemv.serves(w_in, H) and moe_gemv.serves(w_down, inter):
        return moe_gemv.pair_gemvs(*args)
    return _sorted_experts(*args, E).view(T, k, H).sum(1).to(x.dtype)


def _sorted_experts(x, w_in, w_down, weights, ids, act, gated, H, inter, E):
    """`fused_experts`' (P, H) float32 pair rows from the grouped GEMMs over pairs sorted by
    expert (the arguments as `moe_gemv.pair_gemvs` takes them, and the expert count)."""
    flat, k = ids.reshape(-1), ids.shape[1]
    P = flat.numel()
    per_expert = P / E
    pairs, block_expert = sort_pairs(flat, E, tiles(0, 0, per_expert)["BLOCK_M"])
    blocks, fp32 = block_expert.numel(), x.dtype == torch.float32
    h = x.new_empty(P, inter)
    tile = _within_groups(tiles(inter, blocks, per_expert), w_in, H)
    _experts_in[(blocks, triton.cdiv(inter, tile["BLOCK_N"]))](
        x, *w_in.pointers(), h, pairs, block_expert, P, k, E, H, inter,
        GATED=gated, ACT=act, IEEE=fp32, **w_in.flags(), **tile,
    )  # fmt: skip
    out = torch.empty(P, H, device=x.device, dtype=torch.float32)
    tile = _within_groups(tiles(H, blocks, per_expert), w_down, inter)
    _experts_down[(blocks, triton.cdiv(H, tile["BLOCK_N"]))](
        h, *w_down.pointers(), out, weights.reshape(-1).float(), pairs, block_expert, P, E, H,
        inter, IEEE=fp32, **w_down.flags(), **tile,
    )  # fmt: skip
    return out


def _within_groups(tile: dict, stack: KernelStack, K: int) -> dict:
    """`tile` with a BLOCK_K that divides the quantized stack's group (a power of two, see
    `QuantStack`), so each weight tile reads one scale per column."""
    if stack.QUANT and stack.GROUP < K:
        return {**tile, "BLOCK_K": min(tile["BLOCK_K"], stack.GROUP)}
    return tile


def tiles(n: int, blocks: int, pairs_per_expert: float) -> dict:
    """Tile sizes and launch settings for an output width n over `blocks` row blocks (measured
    on the H200 with benchmarks/moe_kernels.py --sweep)."""
    if pairs_per_expert >= 128:  # prefill-sized: compute-bound, big tiles
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


def route(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    correction_bias: torch.Tensor | None,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (weights (T, k) fp32, expert ids (T, k)) in one kernel: scores
    (softmax or sigmoid), the top k of scores + correction bias, renormalised, times scaling.
    Group-limited routing is not here (models/layers/moe.py route_topk does it)."""
    T, E = logits.shape
    weights = torch.empty(T, top_k, device=logits.device, dtype=torch.float32)
    ids = torch.empty(T, top_k, device=logits.device, dtype=torch.int64)
    bias = correction_bias if correction_bias is not None else logits
    _route[(T,)](
        logits, bias, weights, ids, E, scaling,
        TOP_K=top_k, SIGMOID=scoring == "sigmoid", BIAS=correction_bias is not None,
        NORMALIZE=normalize, BLOCK_E=triton.next_power_of_2(E),
        BLOCK_K=triton.next_power_of_2(top_k),
    )  # fmt: skip
    return weights, ids


def sort_pairs(flat: torch.Tensor, num_experts: int, block_m: int):
    """Expert ids of P pairs -> (pair index per row (B*block_m,) with P for padding rows, the
    expert of each block (B,) with num_experts past the last one), B = ceil(P/block_m) + min(E, P):
    each expert's pairs in one run padded to whole blocks, all on the device, no host sync."""
    P = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    experts, order = flat.sort(stable=True)
    rank = torch.arange(P, device=flat.device) - (counts.cumsum(0) - counts)[experts]
    blocks = triton.cdiv(P, block_m) + min(num_experts, P)
    pairs = torch.full((blocks * block_m,), P, dtype=torch.int32, device=flat.device)
    pairs[(padded_end - padded)[experts] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=flat.device) * block_m
    return pairs, torch.searchsorted(padded_end, starts, right=True)


if triton is not None:

    @triton.jit
    def _block_rows(pairs, block_expert, pid, BLOCK_M: tl.constexpr):
        # this block's expert and pair rows (P marks a padding row)
        rows = tl.load(pairs + pid * BLOCK_M + tl.arange(0, BLOCK_M))
        return tl.load(block_expert + pid).to(tl.int64), rows.to(tl.int64)

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        if IEEE:  # fp32 models: exact products, as the PyTorch path computes them
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _quant_tile(
        w, s, z, groups, rows, k0, kk, mk, mn, K,
        QUANT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, dt: tl.constexpr,
    ):  # fmt: skip
        """W's (BLOCK_K, BLOCK_N) tile at rows `rows` (of the whole stack: expert * N + n) and
        inputs k0 + kk of a `QuantStack`, dequantized in fp32 and rounded to `dt`, as
        kernels/formats.py's dequantize_rows and the cast after it compute it. The tile lies in
        one group (`fused_experts` keeps BLOCK_K a divisor of GROUP): one scale per column."""
        at = rows * groups + k0 // GROUP
        scale = tl.load(s + at, mask=mn, other=0.0).to(tl.float32)[None, :]
        mask = mk[:, None] & mn[None, :]
        # one branch compiles (constexpr): the MLX one divides by BITS, 0 for FP8
        if QUANT == 1:  # FP8, loaded without `other` (no fp32 -> fp8 cast), masked after
            v = tl.load(w + rows[None, :] * K + (k0 + kk)[:, None], mask=mask)
            tile = tl.where(mask, v.to(tl.float32) * scale, 0.0)
        else:
            per = 32 // BITS
            at_words = rows[None, :] * (K // per) + ((k0 + kk) // per)[:, None]
            words = tl.load(w + at_words, mask=mask, other=0)
            q = (words >> (((k0 + kk) % per) * BITS)[:, None]) & ((1 << BITS) - 1)
            bias = tl.load(z + at, mask=mn, other=0.0).to(tl.float32)[None, :]
            tile = q.to(tl.float32) * scale + bias
        return tile.to(dt)

    @triton.jit
    def _experts_in(
        x,  # (T, H)
        w,  # (E, 2I or I, H): gate rows then up rows when gated
        s, z, groups,  # a QuantStack's scales, biases, groups per row (QUANT > 0)
        h,  # (P, I) out
        pairs,  # (B * BLOCK_M,) pair per row
        block_expert,  # (B,)
        P, k, E, H, inter,
        GATED: tl.constexpr, ACT: tl.constexpr, IEEE: tl.constexpr,
        QUANT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        expert, rows = _block_rows(pairs, block_expert, tl.program_id(0), BLOCK_M)
        if expert >= E:
            return
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        live, mn = rows < P, n < inter
        a_at = x + (rows // k)[:, None] * H + kk[None, :]
        w_at = w + expert * (2 * inter if GATED else inter) * H + n[None, :] * H + kk[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_rows = expert * (2 * inter if GATED else inter) + n  # QUANT: rows of the whole stack
        for k0 in range(0, H, BLOCK_K):
            mk = kk + k0 < H
            a = tl.load(a_at + k0, mask=live[:, None] & mk[None, :], other=0.0)
            mb = mk[:, None] & mn[None, :]
            if QUANT == 0:
                b = tl.load(w_at + k0, mask=mb, other=0.0)
            else:
                b = _quant_tile(
                    w, s, z, groups, w_rows, k0, kk, mk, mn, H, QUANT, BITS, GROUP, a.dtype
                )
            acc = _dot(a, b, acc, IEEE)
            if GATED:
                if QUANT == 0:
                    b = tl.load(w_at + inter * H + k0, mask=mb, other=0.0)
                else:
                    b = _quant_tile(
                        w, s, z, groups, w_rows + inter, k0, kk, mk, mn, H,
                        QUANT, BITS, GROUP, a.dtype,
                    )  # fmt: skip
                up = _dot(a, b, up, IEEE)
        acc = fused.activate(acc, ACT)
        if GATED:
            acc = acc * up
        out = h + rows[:, None] * inter + n[None, :]
        tl.store(out, acc.to(h.dtype.element_ty), mask=live[:, None] & mn[None, :])

    @triton.jit
    def _experts_down(
        h,  # (P, I)
        w,  # (E, H, I)
        s, z, groups,  # a QuantStack's scales, biases, groups per row (QUANT > 0)
        out,  # (P, H) fp32
        weights,  # (P,) fp32 routing weights
        pairs, block_expert, P, E, H, inter,
        IEEE: tl.constexpr,
        QUANT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        expert, rows = _block_rows(pairs, block_expert, tl.program_id(0), BLOCK_M)
        if expert >= E:
            return
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        live, mn = rows < P, n < H
        a_at = h + rows[:, None] * inter + kk[None, :]
        w_at = w + expert * H * inter + n[None, :] * inter + kk[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            mk = kk + k0 < inter
            a = tl.load(a_at + k0, mask=live[:, None] & mk[None, :], other=0.0)
            mb = mk[:, None] & mn[None, :]
            if QUANT == 0:
                b = tl.load(w_at + k0, mask=mb, other=0.0)
            else:
                w_rows = expert * H + n
                b = _quant_tile(
                    w, s, z, groups, w_rows, k0, kk, mk, mn, inter, QUANT, BITS, GROUP, a.dtype
                )
            acc = _dot(a, b, acc, IEEE)
        acc = acc * tl.load(weights + rows, mask=live, other=0.0)[:, None]
        tl.store(out + rows[:, None] * H + n[None, :], acc, mask=live[:, None] & mn[None, :])

    @triton.jit
    def _route(
        logits, bias, weights, ids, E, scaling,
        TOP_K: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr,
        NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        me = e < E
        x = tl.load(logits + t * E + e, mask=me, other=-float("inf")).to(tl.float32)
        if SIGMOID:
            scores = tl.sigmoid(x)
        else:
            scores = tl.exp(x - tl.max(x, 0))
            scores = scores / tl.sum(scores, 0)
        choice = scores
        if BIAS:
            choice = scores + tl.load(bias + e, mask=me, other=0.0).to(tl.float32)
        # NaN scores (a diverged model) must still pick valid experts: never a masked lane
        choice = tl.where(me & (choice == choice), choice, -float("inf"))
        # k rounds of arg-max, best first as torch.topk orders them
        kk = tl.arange(0, BLOCK_K)
        picked = tl.zeros((BLOCK_K,), dtype=tl.int64)
        picked_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for i in tl.static_range(TOP_K):
            best = tl.argmax(choice, 0)
            picked = tl.where(kk == i, best.to(tl.int64), picked)
            picked_w = tl.where(kk == i, tl.sum(tl.where(e == best, scores, 0.0), 0), picked_w)
            choice = tl.where(e == best, -float("inf"), choice)
        if NORMALIZE:
            picked_w = picked_w / (tl.sum(picked_w, 0) + 1e-20)
        mk = kk < TOP_K
        tl.store(weights + t * TOP_K + kk, picked_w * scaling, mask=mk)
        tl.store(ids + t * TOP_K + kk, picked, mask=mk)

"""Mixture-of-experts feed-forward shared by every MoE family.

Routing follows transformers' routers: softmax (Mixtral, Qwen-MoE, Jamba) or sigmoid (DeepSeek-V3,
EXAONE-MoE, GLM-4.5) scores, an optional score-correction bias that only steers the choice,
group-limited top-k (pick `topk_group` of `n_group` expert groups first), renormalised top-k
weights and a routed scaling factor; then shared experts that every token passes through.

Expert weights are stacked as transformers >= 5 keeps them, `experts.gate_up_proj` (E, 2I, H) and
`experts.down_proj` (E, H, I); checkpoints that store one tensor per expert load through
`expert_slot`; a quantized checkpoint's stacks stay quantized (`PackedStack`). The expert
computation is batched: a decode-sized batch gathers the chosen experts' weights and runs one
bmm; a larger one sorts (token, expert) pairs by expert and runs one grouped GEMM per projection
over every expert's contiguous slice (`grouped_matmul`). Neither loops over tokens in Python,
and neither reads a count back to the host. On CUDA with Triton the routing and
both projections run as fused kernels (kernels/moe.py), for which this PyTorch path is the oracle.
"""

import re

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels import gemv
from kestrel.kernels import moe as moe_kernels
from kestrel.kernels.fused import ACTIVATIONS, act_mul
from kestrel.models.base import Slot
from kestrel.models.layers.linear import Linear
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.quant import Quantized


def route_topk(
    logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = "top2",
    normalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (weights (T, k) fp32, expert ids (T, k)).

    The correction bias is added only to choose experts; weights come from the unbiased scores.
    With n_group > 1, groups are ranked by the sum of their two best scores ("top2", DeepSeek-V3)
    or their best one ("max", DeepSeek-V2) and only the best `topk_group` groups stay eligible.
    """
    grouped = n_group > 1 and topk_group < n_group
    if not grouped and scoring in ("softmax", "sigmoid") and moe_kernels.available(logits):
        return moe_kernels.route(logits, top_k, scoring, correction_bias, normalize, scaling)
    logits = logits.float()
    if scoring == "softmax":
        scores = logits.softmax(-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"unsupported MoE scoring {scoring!r}; supported: softmax, sigmoid")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if grouped:
        choice = _limit_groups(choice, n_group, topk_group, group_score)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def _limit_groups(choice: torch.Tensor, n_group: int, topk_group: int, group_score: str):
    # (T, G, E/G): rank groups, then hide every expert of a group not kept
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)
    if group_score == "top2":
        ranks = grouped.topk(2, dim=-1).values.sum(-1)  # (T, G)
    else:
        ranks = grouped.max(-1).values
    kept = ranks.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(ranks, dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~group_mask[..., None], float("-inf")).view(T, E)


class PackedStack(Quantized):
    """A stacked expert projection kept in its checkpoint's quantized format: each role's tensor
    (`qweight`, the packed values, and the format's scales) as (E, rows, ...), one entry per row
    (`QuantFormat.by_row`), so a quantized MoE checkpoint takes its own size in memory. Decode
    multiplies the stored bits where the format reads (token, expert) pairs (GGUF k-quant blocks
    on CUDA: `Experts._pair_gemvs`), the fused kernels read FP8 and MLX stacks
    (`kernel_stack`); elsewhere only the experts a batch chooses are dequantized, while they
    compute. Indexing gives experts dense, as a stacked weight does."""

    def __init__(self, tensors: dict[str, torch.Tensor], fmt, cols: int, dtype: torch.dtype):
        super().__init__(tensors, fmt, cols)
        self.dtype = dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.qweight.shape[:2], self.cols)

    def __getitem__(self, experts) -> torch.Tensor:
        """The experts `experts` (ids, an id or a slice) dequantized: (..., rows, cols)."""
        chosen = {role: _take(t, experts) for role, t in self.tensors().items()}
        lead = chosen["qweight"].shape[:-1]  # (..., rows)
        rows = {role: t.reshape(-1, *t.shape[len(lead) :]) for role, t in chosen.items()}
        dense = self.fmt.dequantize_rows(rows, slice(None), self.cols)
        return dense.to(self.dtype).view(*lead, self.cols)

    def matmul(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x (M, cols) times expert `expert`'s weight transposed: from its stored bits where the
        format has a kernel for x (GGUF blocks on the CPU), else dequantized."""
        weight = {role: _take(t, expert) for role, t in self.tensors().items()}
        out = self.fmt.expert_linear(weight, x, self.cols)
        return x @ self[expert].t() if out is None else out

    def kernel_stack(self) -> moe_kernels.QuantStack | None:
        """The stack as the fused MoE kernels read it quantized (FP8, MLX 4- and 8-bit); None
        for formats or groups they do not decode (GGUF, NVFP4, other MLX widths: dequantized
        instead)."""
        stack = self.fmt.kernel_stack(self.tensors())
        return stack if stack is not None and stack.tiles_groups else None

    def extra_repr(self) -> str:
        return f"{tuple(self.shape)}, qtype={self.qtype}"


def _take(t: torch.Tensor, experts) -> torch.Tensor:
    """t[experts], FP8 through its bytes (index kernels do not take every float8 type)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)[experts].view(t.dtype)
    return t[experts]


class Experts(nn.Module):
    """E gated experts, stacked: gate_up_proj (E, 2I, H) with gate rows first, down_proj (E, H, I).
    With `gated=False` (Nemotron-H) each expert is down(act(up(x))): up_proj (E, I, H) instead."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        act: str = "silu",
        gated: bool = True,
    ):
        super().__init__()
        self.num_experts, self.intermediate, self.gated = num_experts, intermediate, gated
        self.act_name = act
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        else:
            self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = ACTIVATIONS[act]

    @property
    def in_proj(self) -> nn.Parameter:
        return self.gate_up_proj if self.gated else self.up_proj

    @property
    def stacks(self) -> tuple:
        return self.in_proj, self.down_proj

    @property
    def packed(self) -> bool:
        return any(isinstance(w, PackedStack) for w in self.stacks)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (T, H), weights/ids (T, k) -> (T, H): sum over k of weight * expert_id(x)."""
        if self._reads_blocks(x, ids):
            return self._pair_gemvs(x, weights, ids)
        if moe_kernels.available(x, self.act_name):
            in_proj, down_proj, ids = self._kernel_stacks(ids)
            return moe_kernels.fused_experts(
                x.contiguous(), in_proj, down_proj, weights, ids, self.act_name, self.gated
            )
        return self.reference(x, weights, ids)

    def _reads_blocks(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        """Decode (fewer pairs than experts) from packed stacks whose format reads pairs (GGUF
        k-quants on CUDA): the GEMVs read the chosen experts' bits instead of dequantizing them."""
        return ids.numel() <= self.num_experts and all(
            isinstance(s, PackedStack) and s.fmt.serves_pairs(x, self.num_experts)
            for s in self.stacks
        )

    def _pair_gemvs(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """Each (token, expert) pair through its expert, from the blocks: the in projection,
        the activation, then the down projection scaled by the pair's routing weight."""
        flat = ids.reshape(-1)
        w_in, w_down = self.in_proj, self.down_proj
        h = w_in.fmt.pairs_linear(w_in.tensors(), x, w_in.cols, flat)  # (P, 2I or I)
        h = act_mul(h, self.act_name) if self.gated else self.act(h)
        scale = weights.reshape(-1).float()
        out = w_down.fmt.pairs_linear(w_down.tensors(), h, w_down.cols, flat, scale)
        return out.view(*ids.shape, -1).sum(1).to(x.dtype)

    def _kernel_stacks(self, ids: torch.Tensor):
        """The stacks the fused kernels read and `ids` into them: dense stacks as they are, FP8
        and MLX stacks quantized (`PackedStack.kernel_stack`); other packed stacks give the
        chosen experts, one per (token, expert) pair, where there are fewer pairs than experts
        (decode), and every expert otherwise, dequantized for this call."""
        if not self.packed:
            return self.in_proj, self.down_proj, ids
        stacks = [w.kernel_stack() if isinstance(w, PackedStack) else None for w in self.stacks]
        if None not in stacks:
            return *stacks, ids
        flat = ids.reshape(-1)
        if flat.numel() > self.num_experts:
            return self.in_proj[:], self.down_proj[:], ids
        pairs = torch.arange(flat.numel(), device=ids.device).view(ids.shape)
        return self.in_proj[flat], self.down_proj[flat], pairs

    def reference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The PyTorch experts: the CPU path, and the fused kernels' oracle on the GPU. Packed
        stacks multiply from their blocks, one expert at a time (`grouped_matmul`)."""
        T, k = ids.shape
        flat = ids.reshape(-1)  # (P,) one (token, expert) pair per row, P = T * k
        if flat.numel() <= self.num_experts and not self.packed:
            out = self._gathered(x.repeat_interleave(k, 0), flat)
        else:
            out = self._grouped(x, flat, k)
        out = out.view(T, k, -1).float() * weights.float()[..., None]
        return out.sum(1).to(x.dtype)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.act(h)
        gate, up = h.split(self.intermediate, dim=-1)
        return self.act(gate) * up

    def _gathered(self, xs: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        # few pairs (decode): fetch each pair's expert weights, one bmm each way; (P, H)
        h = torch.bmm(self.in_proj[flat], xs[:, :, None])[..., 0]  # (P, 2I), (P, I) ungated
        return torch.bmm(self.down_proj[flat], self._mlp(h)[:, :, None])[..., 0]

    def _grouped(self, x: torch.Tensor, flat: torch.Tensor, k: int) -> torch.Tensor:
        # many pairs (prefill, large decode batches): sort pairs by expert so each expert
        # multiplies one contiguous slice, all experts in one grouped GEMM per projection
        experts, order = flat.sort(stable=True)
        xs = x[order // k]  # (P, H) in expert order
        # where each expert's slice ends; searchsorted, unlike bincount, never syncs the host
        every = torch.arange(self.num_experts, device=flat.device)
        ends = torch.searchsorted(experts, every, right=True)
        h = self._mlp(grouped_matmul(xs, self.in_proj, ends))
        out_sorted = grouped_matmul(h, self.down_proj, ends)
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted
        return out


def grouped_matmul(xs: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows [ends[e-1], ends[e]) of xs (P, K) times weights[e] (N, K) transposed -> (P, N).

    PyTorch's grouped GEMM takes every expert in one kernel with no host sync (so CUDA graphs can
    capture it); where it does not apply (CUDA without bf16 on Hopper-class GPUs, shapes its
    kernel cannot tile) one matmul per expert over its slice does the same, and while a CUDA
    graph is captured (no host sync allowed) every row meets every expert and keeps its own."""
    if _grouped_mm_applies(xs, weights):
        return torch._grouped_mm(xs, weights.transpose(1, 2), offs=ends.to(torch.int32))
    if xs.is_cuda and torch.cuda.is_current_stream_capturing():
        rows = torch.arange(xs.shape[0], device=xs.device)
        expert = torch.searchsorted(ends, rows, right=True)
        return torch.einsum("pk,enk->pen", xs, weights[:])[rows, expert]
    packed = isinstance(weights, PackedStack)
    out = xs.new_empty(xs.shape[0], weights.shape[1])
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            part = xs[start:end]
            out[start:end] = weights.matmul(part, expert) if packed else part @ weights[expert].t()
        start = end
    return out


def _grouped_mm_applies(xs: torch.Tensor, weights: torch.Tensor | PackedStack) -> bool:
    if not hasattr(torch, "_grouped_mm") or isinstance(weights, PackedStack):
        return False
    if not xs.is_cuda:
        return True
    hopper = torch.cuda.get_device_capability(xs.device)[0] >= 9
    aligned = all(d % 8 == 0 for d in weights.shape[1:])  # 16-byte rows of bf16
    return hopper and xs.dtype == torch.bfloat16 and aligned


class Router(nn.Module):
    """Linear router (`weight` (E, H), fp32 logits) with an optional `e_score_correction_bias`."""

    def __init__(
        self, hidden: int, num_experts: int, correction_bias: bool = False, bias: bool = False
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        # a Parameter (not a buffer) so the loader fills it from the checkpoint
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts)) if correction_bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gemv.serves(x, self.weight):  # decode on CUDA: one kernel, summed in fp32
            return gemv.gemv(x, self.weight, self.bias, out_dtype=torch.float32)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias)  # (T, E)


class SparseMoE(nn.Module):
    """Routed experts plus optional shared experts; parameter names follow transformers.

    hidden, intermediate: model width and each routed expert's width; num_experts, top_k: E and k.
    act: expert activation (key of ACTIVATIONS). scoring: "softmax" or "sigmoid".
    normalize: renormalise the k weights to sum to 1; routed_scaling: multiplies them afterwards.
    n_group, topk_group, group_score: group-limited routing (see `route_topk`).
    correction_bias: the router has `e_score_correction_bias` (choice only); router_bias: a linear bias.
    shared_intermediate: width of the shared experts MLP (`shared_experts`, 0 for none);
    shared_gate: scale the shared output by sigmoid(`shared_expert_gate`(x)) (Qwen2-MoE).
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        *,
        act: str = "silu",
        scoring: str = "softmax",
        normalize: bool = True,
        routed_scaling: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        group_score: str = "top2",
        correction_bias: bool = False,
        router_bias: bool = False,
        shared_intermediate: int = 0,
        shared_gate: bool = False,
    ):
        super().__init__()
        if num_experts % n_group:
            raise ValueError(f"{num_experts} experts do not split into {n_group} groups")
        self.top_k, self.scoring, self.normalize, self.scaling = (
            top_k,
            scoring,
            normalize,
            routed_scaling,
        )
        self.n_group, self.topk_group, self.group_score = n_group, topk_group, group_score
        self.gate = Router(hidden, num_experts, correction_bias, router_bias)
        self.experts = Experts(num_experts, hidden, intermediate, act)
        self.shared_experts = (
            GatedMLP(hidden, shared_intermediate, act) if shared_intermediate else None
        )
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared_gate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> weights (T, k), expert ids (T, k)."""
        return route_topk(
            self.gate(x),
            self.top_k,
            self.scoring,
            self.gate.e_score_correction_bias,
            self.n_group,
            self.topk_group,
            self.group_score,
            self.normalize,
            self.scaling,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.route(x))
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
# mlx-lm's SwitchGLU / SwitchMLP: every expert's projection in one (E, out, in) tensor
_STACKED_TENSOR = re.compile(r"^(?P<prefix>.*)\.switch_mlp\.(?P<proj>\w+)\.weight$")


def expert_slot(
    name: str,
    intermediate: int,
    gate: str | None = "gate_proj",
    up: str = "up_proj",
    down: str = "down_proj",
) -> Slot | None:
    """`<prefix>.experts.<i>.<proj>.weight` (one tensor per expert) -> the part of the stacked
    weight it fills; None for any other name. Mixtral names its projections w1/w3/w2.
    `gate=None`: experts without a gate (Experts(gated=False)), `up` fills `up_proj`.
    mlx-lm's `<prefix>.switch_mlp.<proj>.weight` (gate_proj, up_proj, down_proj; fc1 and fc2
    without a gate) fills the projection for every expert at once."""
    part = _expert_part(name, gate, up, down)
    if part is None:
        return None
    prefix, expert, proj = part
    if gate is None and proj == up:
        return Slot(f"{prefix}.up_proj", (expert,))
    if proj == gate:
        return Slot(f"{prefix}.gate_up_proj", (expert, slice(0, intermediate)))
    if proj == up:
        return Slot(f"{prefix}.gate_up_proj", (expert, slice(intermediate, 2 * intermediate)))
    if proj == down:
        return Slot(f"{prefix}.down_proj", (expert,))
    return None


def _expert_part(name: str, gate: str | None, up: str, down: str) -> tuple | None:
    """An expert tensor's (stacks' prefix, expert id or slice(None) for all, projection name as
    `expert_slot` names it); None for any other name."""
    if (match := _EXPERT_TENSOR.match(name)) is not None:
        return match["prefix"], int(match["expert"]), match["proj"]
    if (match := _STACKED_TENSOR.match(name)) is not None:
        mlx = {"gate_proj": gate, "up_proj": up, "down_proj": down, "fc1": up, "fc2": down}
        proj = mlx.get(match["proj"])
        return None if proj is None else (f"{match['prefix']}.experts", slice(None), proj)
    return None

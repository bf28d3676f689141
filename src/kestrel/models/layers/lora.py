"""Slot buffers of every LoRA'd projection, and how they join the model's forward.

Each projection that may take an adapter gets A (S, P * R, K) and B (S, N, R) (S = max_loras +
1 slots, slot 0 all zeros: the base model; R = --max-lora-rank, a smaller rank zero-padded).
Projections that a fused layer concatenates (q/k/v, gate/up, MLA's two down-projections) share
one pair with a part each, so the fused matmul's output takes one kernel pair; unfused, each
Linear's forward hook adds its own part. Loading an adapter copies into a slot in place, so CUDA
graphs captured once serve every adapter.
"""

from collections.abc import Callable

import torch
from torch import nn

from kestrel.kernels.lora import INTERPRETED, add_lora, part_blocks, serves
from kestrel.models.layers.quant import QuantLinear

# the projections an adapter may adapt (attention, MLA, dense and shared-expert MLPs)
TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
)  # fmt: skip
# Linears of one module that its fused path concatenates (models/layers/linear.py)
GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
)


class TokenSlots:
    """Each token's slot for the step being run: `column` (T,) int32 on the device (the kernels
    and CUDA graphs read it); on the CPU, the adapted tokens grouped by slot instead."""

    def __init__(self, max_tokens: int, device: torch.device):
        self.column = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.kernels = device.type == "cuda" or INTERPRETED
        self.groups: list = []
        self.active = False

    def set(self, slots: list[int]) -> None:
        """The step's per-token slots, in the packed batch's row order (padding rows: 0)."""
        self.active = any(slots)
        if self.kernels:
            host = torch.tensor(slots, dtype=torch.int32)
            self.column[: len(slots)].copy_(host, non_blocking=True)
            return
        self.groups = []
        for slot in sorted(set(slots) - {0}):
            rows = None if all(s == slot for s in slots) else _rows(slots, slot)
            self.groups.append((slot, rows))

    def apply(self, site: "LoRAProjection", x: torch.Tensor, y: torch.Tensor, part=None) -> None:
        """y += the adapters' deltas of x, for the whole projection or one of its parts."""
        # CUDA: the kernels always run (a block of base-model tokens costs them a branch), so
        # the graphs' warm-up compiles them and the graphs serve any later mix of adapters
        if not (self.active or self.kernels):
            return
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        a, b, parts, part_of = site.views(part)
        groups = None if self.kernels else self.groups
        add_lora(y2, x2, a, b, self.column[: x2.shape[0]], parts, groups, part_of)


def _rows(slots: list[int], slot: int) -> torch.Tensor:
    return torch.tensor([i for i, s in enumerate(slots) if s == slot])


class LoRAProjection:
    """The slot buffers of one projection (or a group that fuses): parts side by side."""

    def __init__(self, names: list[str], linears: list, tokens: TokenSlots, slots: int, rank: int,
                 dtype: torch.dtype):  # fmt: skip
        first, device = linears[0], tokens.column.device
        self.names, self.tokens, self.rank = names, tokens, rank
        self.parts = [linear.out_features for linear in linears]
        self.a = torch.zeros(
            slots, len(linears) * rank, first.in_features, dtype=dtype, device=device
        )
        self.b = torch.zeros(slots, sum(self.parts), rank, dtype=dtype, device=device)
        self.offsets = [sum(self.parts[:p]) for p in range(len(self.parts))]
        kernels = tokens.kernels and serves(self.b[0], self.parts)
        self.part_of = part_blocks(self.parts).to(device) if kernels else None
        self.part_of_one = [
            part_blocks([w]).to(device) if kernels and serves(self.b[0], [w]) else None
            for w in self.parts
        ]

    def views(self, part: int | None):
        """(A, B, part widths, block map) of the whole projection or of one part."""
        if part is None:
            return self.a, self.b, self.parts, self.part_of
        r, start, width = self.rank, self.offsets[part], self.parts[part]
        a = self.a[:, part * r : (part + 1) * r]
        return a, self.b[:, start : start + width], [width], self.part_of_one[part]

    def write(self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot` of part `part` holds A (r, K), B (N, r) (None: zeros), zero-padded to R."""
        a_view, b_view, *_ = self.views(part)
        a_view[slot].zero_()
        b_view[slot].zero_()
        if a is not None:
            a_view[slot, : a.shape[0]].copy_(a)
            b_view[slot, :, : b.shape[1]].copy_(b)

    def wrap(self, fused: Callable) -> Callable:
        """The fused projection x -> y with the adapters' deltas added."""

        def forward(x):
            y = fused(x)
            self.tokens.apply(self, x, y)
            return y

        return forward

    def hook(self, part: int) -> Callable:
        """A forward hook adding part `part`'s delta to its Linear's output."""

        def add(module, args, out):
            self.tokens.apply(self, args[0], out, part)
            return out

        return add


def is_projection(module) -> bool:
    return isinstance(module, (nn.Linear, QuantLinear))


def attach(modules, tokens: TokenSlots, slots: int, rank: int, dtype) -> dict:
    """Slot buffers (of the model's `dtype`) for every TARGETS projection among the children of
    `modules` ((name, module) pairs), forward hooks on their Linears; returns module name ->
    (LoRAProjection, part)."""
    table: dict[str, tuple[LoRAProjection, int]] = {}
    for name, module in modules:
        children = {n: c for n, c in module.named_children() if n in TARGETS and is_projection(c)}
        for group in _groups(children):
            names = [f"{name}.{n}" for n in group]
            site = LoRAProjection(names, [children[n] for n in group], tokens, slots, rank, dtype)
            for part, n in enumerate(group):
                linear = children[n]
                linear.lora = (site, part)
                linear.lora_hook = linear.register_forward_hook(site.hook(part))
                table[names[part]] = (site, part)
    return table


def _groups(children: dict) -> list[tuple[str, ...]]:
    """The children cut into fusing groups (in their fused order) and single projections."""
    groups = [g for g in GROUPS if all(n in children for n in g)]
    grouped = {n for g in groups for n in g}
    return groups + [(n,) for n in children if n not in grouped]


def fused_with_lora(linears: list, fused: Callable) -> Callable:
    """`fused` (x -> the Linears' outputs side by side) with their adapters' deltas: the
    Linears' own hooks come off and their group's projection adds to the fused output. Linears
    that take no adapter (or are not one whole group) keep `fused` as it is."""
    sites = [getattr(linear, "lora", None) for linear in linears]
    if sites[0] is None:
        return fused
    site = sites[0][0]
    if any(s is None or s[0] is not site for s in sites) or len(linears) != len(site.parts):
        return fused  # hooks stay on: each part adds its own
    for linear in linears:
        linear.lora_hook.remove()
    return site.wrap(fused)

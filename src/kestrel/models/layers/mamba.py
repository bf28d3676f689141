"""Mamba (selective scan, Gu & Dao 2023) and Mamba2 (SSD, Dao & Gu 2024) mixers in plain PyTorch.

Follows transformers' MambaMixer/JambaMambaMixer and Mamba2/NemotronHMamba2Mixer (their torch
paths, which are the test oracles). Tensors are packed across sequences, (T, ...). Each sequence's
conv window and SSM state live in its SequenceCache (cache/recurrent.py) and are carried across
prefill chunks and decode steps: a prefill chunk is scanned in chunks (no Python loop over
tokens), and every single-token chunk of the batch is decoded in one batched recurrent step.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import kestrel.cache.recurrent  # noqa: F401  (registers the "recurrent" and "none" cache kinds)
from kestrel.cache.sequence import StateShape
from kestrel.kernels import mamba as kernels
from kestrel.kernels.fused import ACTIVATIONS
from kestrel.models.layers.linear import Linear
from kestrel.models.layers.norm import RMSNorm


def conv_weight(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A depthwise `conv1d.weight` as nn.Conv1d holds it, (channels, 1, kernel): mlx-lm saves it
    channels-last, (channels, kernel, 1), as MLX's conv takes it (its sanitize moves the axis)."""
    if name.endswith("conv1d.weight") and tensor.dim() == 3 and tensor.shape[1] > 1:
        return tensor.transpose(1, 2) if tensor.shape[2] == 1 else tensor
    return tensor


# rows (b, m) of the packed batch and the states of those b sequences (cache/recurrent.py's
# CacheStates, or the paged runner's PoolStates: `read(layer_idx, attr, zeros)` -> (b, ...),
# `write(layer_idx, attr, new)`): `ForwardBatch.state_groups`
Group = tuple[torch.Tensor, object]


def scan_sequences(groups, layer_idx: int, attr: str, zeros, fn, *inputs, step=None):
    """For each group: out[rows], new = fn(*(t[rows] for t in inputs), state) with the stacked
    `attr` state (b, ...) of its sequences (`zeros()` for a new one); store each new state. A
    group of one-token sequences whose states a kernel updates in place (the paged runner on
    CUDA) runs `step(store, slots, *rows' inputs)` instead."""
    out = None
    for rows, states in groups:
        xs = [t[rows] for t in inputs]
        store = states.in_place(layer_idx, attr) if step and rows.shape[1] == 1 else None
        if store is not None:
            y = step(store, states.slots, *(t[:, 0] for t in xs))[:, None]
        else:
            y, new = fn(*xs, states.read(layer_idx, attr, zeros))
            states.write(layer_idx, attr, new)
        if out is None:
            out = y.new_empty(inputs[0].shape[0], *y.shape[2:])
        out[rows] = y
    return out


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias, window: torch.Tensor):
    """Depthwise causal conv continuing from `window`. x: (b, m, C), weight: (C, 1, K),
    window: (b, K-1, C) -> (b, m, C), new window (b, K-1, C)."""
    full = torch.cat([window.to(x.dtype), x], dim=1)  # (b, K-1+m, C)
    y = F.conv1d(full.transpose(1, 2), weight, bias, groups=weight.shape[0]).transpose(1, 2)
    return y, full[:, -(weight.shape[-1] - 1) :].clone()  # a copy: a view would keep `full` alive


def conv_pass(x: torch.Tensor, conv: nn.Conv1d, layer_idx: int, groups) -> torch.Tensor:
    """The causal conv of every sequence, carrying its conv window. x: (T, C) -> (T, C)."""
    zeros = lambda: x.new_zeros(conv.kernel_size[0] - 1, x.shape[-1])  # noqa: E731
    return scan_sequences(
        groups,
        layer_idx,
        "conv",
        zeros,
        lambda xs, window: causal_conv(xs, conv.weight, conv.bias, window),
        x,
        step=lambda window, slots, xs: kernels.conv_update(
            window, slots, xs, conv.weight, conv.bias
        ),
    )


# --- Mamba2: scalar decay per head, the SSD chunked scan -------------------------------------


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """(..., L) -> (..., L, L): out[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the diagonal.
    Masked cumsum rather than a difference of cumsums, which loses precision."""
    L = a.shape[-1]
    a = a[..., None].expand(*a.shape, L)  # a[..., i, j] = a[i]
    strict = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=-1)
    out = torch.cumsum(a.masked_fill(~strict, 0), dim=-2)
    lower = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device))
    return out.masked_fill(~lower, float("-inf"))


def _pad_time(t: torch.Tensor, pad: int) -> torch.Tensor:
    return F.pad(t, [0, 0] * (t.dim() - 2) + [0, pad]) if pad else t


def ssd_chunked(x, dt, A, B, C, state, chunk_size: int):
    """Mamba2 scan of m tokens in chunks. x: (b, m, H, P), dt: (b, m, H), A: (H,), B/C: (b, m, H, N),
    state: (b, H, P, N) -> y (b, m, H, P), final state. Within a chunk the scan is a masked
    matmul; chunk states are passed on by one small recurrence over chunks."""
    b, m, H, P = x.shape
    chunk = min(chunk_size, m)
    pad = (-m) % chunk  # padded steps have dt = 0: no decay and no input, the state is unchanged
    x, a, B, C = (_pad_time(t, pad) for t in (x * dt[..., None], dt * A, B, C))
    x, a, B, C = (t.reshape(b, -1, chunk, *t.shape[2:]) for t in (x, a, B, C))  # (b, c, l, ...)
    a = a.permute(0, 3, 1, 2)  # (b, H, c, l)
    a_cum = torch.cumsum(a, dim=-1)
    # within chunks: y[l] = sum_{s<=l} C[l].B[s] exp(a[s+1..l]) x[s]
    decay = torch.exp(segment_sum(a))  # (b, H, c, l, s)
    y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, decay, x)
    # each chunk's own end state, then the states entering every chunk
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # (b, H, c, l)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_end, x)
    states = torch.cat([state[:, None].to(states.dtype), states], dim=1)  # (b, c+1, H, P, N)
    across = torch.exp(segment_sum(F.pad(a_cum[..., -1], (1, 0))))  # (b, H, c+1, c+1)
    states = torch.einsum("bhzc,bchpn->bzhpn", across, states)
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states[:, :-1], torch.exp(a_cum))
    return y.reshape(b, -1, H, P)[:, :m], states[:, -1].clone()


def ssd_step(x, dt, A, B, C, state):
    """One token per sequence, same shapes as `ssd_chunked` with m = 1."""
    x, dt, B, C = x[:, 0], dt[:, 0], B[:, 0], C[:, 0]  # (b, H, P), (b, H), (b, H, N)
    decay = torch.exp(dt * A)[..., None, None]  # (b, H, 1, 1)
    state = state * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]  # (b, H, P, N)
    return torch.einsum("bhpn,bhn->bhp", state, C)[:, None], state


class GatedRMSNorm(nn.Module):
    """RMSNorm of x * silu(gate) over groups of `group_size` channels (Mamba2's gated norm)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() * F.silu(gate.float())
        g = x.view(*x.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(x.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    """in_proj -> (gate, xBC, dt); causal conv + act on xBC; SSD scan with D skip; gated norm;
    out_proj. Parameter names follow transformers (in_proj, conv1d, dt_bias, A_log, D, norm)."""

    def __init__(
        self,
        layer_idx: int,
        hidden: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int,
        conv_kernel: int,
        chunk_size: int,
        eps: float,
        act: str = "silu",
        conv_bias: bool = True,
        bias: bool = False,
        dt_limit=(0.0, float("inf")),
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim, self.state_size = num_heads, head_dim, state_size
        self.n_groups, self.chunk_size, self.dt_limit = n_groups, chunk_size, tuple(dt_limit)
        self.inner = num_heads * head_dim
        conv_dim = self.inner + 2 * n_groups * state_size
        self.in_proj = Linear(hidden, self.inner + conv_dim + num_heads, bias=bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=conv_bias)
        self.act = ACTIVATIONS[act]
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // n_groups, eps)
        self.out_proj = Linear(self.inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor, groups: list[Group]) -> torch.Tensor:
        if self._decodes_in_place(x, groups):
            return self._fused_decode(x, *groups[0])
        T, H, P, N, G = x.shape[0], self.num_heads, self.head_dim, self.state_size, self.n_groups
        gate, xbc, dt = self.in_proj(x).split([self.inner, self.inner + 2 * G * N, H], dim=-1)
        xbc = self.act(conv_pass(xbc, self.conv1d, self.layer_idx, groups))
        xs, B, C = xbc.split([self.inner, G * N, G * N], dim=-1)
        xs = xs.reshape(T, H, P).float()
        # B/C are shared by the H/G heads of a group: (T, H, N)
        B, C = (t.reshape(T, G, N).float().repeat_interleave(H // G, dim=1) for t in (B, C))
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)  # (T, H)
        zeros = lambda: x.new_zeros(H, P, N, dtype=torch.float32)  # noqa: E731
        A = -torch.exp(self.A_log.float())
        scan, step = partial(self._scan, A), partial(kernels.ssd_update, A=A)
        y = scan_sequences(groups, self.layer_idx, "ssm", zeros, scan, xs, dt, B, C, step=step)
        y = y + xs * self.D.float()[:, None]
        return self.out_proj(self.norm(y.reshape(T, -1), gate).to(x.dtype))

    def _decodes_in_place(self, x: torch.Tensor, groups: list[Group]) -> bool:
        """Whether the step is one token of every sequence and kernels update their states in
        place (the paged runner on CUDA): `_fused_decode` then runs it. Tensor parallel's norm
        across ranks (its own module) keeps the PyTorch path."""
        if len(groups) != 1 or groups[0][0].shape != (x.shape[0], 1):
            return False
        fusable = self.act is ACTIVATIONS["silu"] and type(self.norm) is GatedRMSNorm
        return fusable and groups[0][1].in_place(self.layer_idx, "ssm") is not None

    def _fused_decode(self, x: torch.Tensor, rows: torch.Tensor, states) -> torch.Tensor:
        """The decode step in three kernels between the projections, where PyTorch runs about
        thirty: conv + SiLU, the SSD step (dt, A and the D skip inside), the gated norm."""
        rows, slots, layer = rows[:, 0], states.slots, self.layer_idx
        conv = self.conv1d
        gate, xbc, dt = self.in_proj(x).split([self.inner, conv.in_channels, self.num_heads], -1)
        window, ssm = states.in_place(layer, "conv"), states.in_place(layer, "ssm")
        xbc = kernels.conv_update(window, slots, xbc, conv.weight, conv.bias, rows, silu=True)
        args = (self.dt_bias, self.A_log, self.D, self.n_groups, self.dt_limit)
        y = kernels.ssd_decode(ssm, slots, rows, xbc, dt, *args)
        norm = self.norm
        y = kernels.gated_rms_norm(y, gate, norm.weight, norm.group_size, norm.eps, x.dtype)
        return self.out_proj(y)

    def state_shape(self) -> StateShape:
        conv = (self.conv1d.kernel_size[0] - 1, self.conv1d.in_channels)
        return StateShape(conv, (self.num_heads, self.head_dim, self.state_size))

    def _scan(self, A, x, dt, B, C, state):
        if x.shape[1] == 1:
            return ssd_step(x, dt, A, B, C, state)
        return ssd_chunked(x, dt, A, B, C, state, self.chunk_size)


# --- Mamba (v1): a decay per channel and state, a chunked associative scan -------------------


def linear_scan(a: torch.Tensor, u: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """All states of h[t] = a[t] * h[t-1] + u[t] from h0. a/u: (b, L, ...), h0: (b, ...) -> (b, L, ...).

    Hillis-Steele scan: log2(L) steps of whole-tensor ops; only decays <= 1 are multiplied, so it
    stays stable where exp(-cumsum) tricks overflow."""
    u = torch.cat([u[:, :1] + a[:, :1] * h0[:, None], u[:, 1:]], dim=1)
    step = 1
    while step < u.shape[1]:
        u = torch.cat([u[:, :step], u[:, step:] + a[:, step:] * u[:, :-step]], dim=1)
        a = torch.cat([a[:, :step], a[:, step:] * a[:, :-step]], dim=1)
        step *= 2
    return u


def selective_scan(x, dt, A, B, C, state, chunk_size: int = 64):
    """Mamba scan. x/dt: (b, m, D), A: (D, N), B/C: (b, m, N), state: (b, D, N) -> y (b, m, D), state.

    Chunks bound the (b, l, D, N) intermediates; the loop is over chunks, not tokens."""
    ys = []
    for s in range(0, x.shape[1], chunk_size):
        xc, dtc, Bc, Cc = (t[:, s : s + chunk_size] for t in (x, dt, B, C))
        decay = torch.exp(dtc[..., None] * A)  # (b, l, D, N)
        inputs = (dtc * xc)[..., None] * Bc[:, :, None, :]  # (b, l, D, N)
        states = linear_scan(decay, inputs, state)
        ys.append(torch.einsum("bldn,bln->bld", states, Cc))
        state = states[:, -1]
    return torch.cat(ys, dim=1), state.clone()


class MambaMixer(nn.Module):
    """in_proj -> (x, z); causal conv + act on x; x_proj -> (dt, B, C), optionally RMS-normed
    (Jamba); dt_proj + softplus; selective scan with D skip; * silu(z); out_proj."""

    def __init__(
        self,
        layer_idx: int,
        hidden: int,
        inner: int,
        state_size: int,
        conv_kernel: int,
        dt_rank: int,
        act: str = "silu",
        conv_bias: bool = True,
        bias: bool = False,
        norm_eps: float | None = None,
    ):
        super().__init__()
        self.layer_idx, self.inner = layer_idx, inner
        self.state_size, self.dt_rank = state_size, dt_rank
        self.in_proj = Linear(hidden, 2 * inner, bias=bias)
        self.conv1d = nn.Conv1d(inner, inner, conv_kernel, groups=inner, bias=conv_bias)
        self.act = ACTIVATIONS[act]
        self.x_proj = Linear(inner, dt_rank + 2 * state_size, bias=False)
        self.dt_proj = Linear(dt_rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(inner, state_size))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = Linear(inner, hidden, bias=bias)
        if norm_eps is not None:
            self.dt_layernorm = RMSNorm(dt_rank, norm_eps)
            self.b_layernorm = RMSNorm(state_size, norm_eps)
            self.c_layernorm = RMSNorm(state_size, norm_eps)
        self.normed = norm_eps is not None

    def forward(self, x: torch.Tensor, groups: list[Group]) -> torch.Tensor:
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        xs = self.act(conv_pass(xs, self.conv1d, self.layer_idx, groups))
        dt, B, C = self.x_proj(xs).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        if self.normed:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        # the bias joins in fp32, as in transformers' scan
        dt = F.softplus(F.linear(dt, self.dt_proj.weight).float() + self.dt_proj.bias.float())
        xs = xs.float()
        zeros = lambda: x.new_zeros(self.inner, self.state_size, dtype=torch.float32)  # noqa: E731
        A = -torch.exp(self.A_log.float())
        step = partial(kernels.selective_update, A=A)
        y = scan_sequences(
            groups,
            self.layer_idx,
            "ssm",
            zeros,
            partial(self._scan, A),
            xs,
            dt,
            B.float(),
            C.float(),
            step=step,
        )  # (T, D)
        y = (y + xs * self.D.float()) * F.silu(z.float())
        return self.out_proj(y.to(x.dtype))

    def state_shape(self) -> StateShape:
        conv = (self.conv1d.kernel_size[0] - 1, self.inner)
        return StateShape(conv, (self.inner, self.state_size))

    def _scan(self, A, x, dt, B, C, state):
        return selective_scan(x, dt, A, B, C, state)

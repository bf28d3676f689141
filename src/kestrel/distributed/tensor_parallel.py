"""Tensor parallel (Megatron-style): each rank holds a slice of every large weight, and one
all-reduce per attention block and per MLP joins the partial sums.

- Attention: q/k/v split by heads (column parallel), o_proj by the same heads' input columns
  (row parallel, then all-reduce). With fewer KV heads than ranks, each KV head is kept by the
  ranks whose query heads read it (replicated). gemma4's layers that read another layer's cache
  split their queries alike, and the pool holds each layer's heads as its module has them.
- Multi-head latent attention (MLA): the queries (`q_proj`, or `q_b_proj` after the replicated
  low-rank `q_a_proj`) and `kv_b_proj` split by heads, `o_proj` by the same heads' values (row
  parallel). The latent and the RoPE key (`kv_a_proj_with_mqa`) are per token, not per head:
  every rank computes and caches them whole, so the latent KV cache does not shrink.
- Gated MLP: gate/up split along the intermediate width, down_proj along its input.
- Routed experts: every expert split the same way along its width (the router is replicated, so
  each rank routes every token alike); one all-reduce joins the experts' partial sums, and the
  shared experts are a gated MLP as above. With expert parallel (`--enable-expert-parallel`)
  each rank holds E / N whole experts instead and runs every token's choices of them (the
  others weigh 0); the same all-reduce joins the ranks' experts.
- Embedding and head split along the vocabulary (padded to equal shards): a token's row comes
  from the rank that holds it (all-reduce), the logits from every rank side by side (all-gather).
- nemotron_nas's linear blocks (one hidden x hidden matrix in place of attention or an MLP) are
  kept whole on every rank: they read and write the whole hidden state.
- Mamba2 (Nemotron-H) split by heads and state groups (one group: kept whole, its gated norm's
  mean square all-reduced); Mamba (Jamba) by channels, x_proj row parallel so that every rank
  has dt, B and C whole. Each rank's recurrent state holds its heads or channels.

Quantized layers (GGUF blocks, FP8, MLX, NVFP4) are cut the same way and stay quantized
(distributed/quantized.py).

`shard_model` cuts a loaded model's layers in place into these sharded layers, so model files
keep one definition. A model with a Linear that no rule here covers is refused, naming it.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kestrel.distributed import quantized
from kestrel.distributed.group import TPGroup
from kestrel.distributed.pipeline import decoder_stack
from kestrel.models.base import head_dim
from kestrel.models.gemma4 import Gemma4Attention, Gemma4Block, Gemma4Model, Gemma4Router
from kestrel.models.layers.attention import Attention
from kestrel.models.layers.linear import Linear
from kestrel.models.layers.mamba import GatedRMSNorm, Mamba2Mixer, MambaMixer
from kestrel.models.layers.mla import MultiHeadLatentAttention
from kestrel.models.layers.mlp import GatedMLP
from kestrel.models.layers.moe import Experts, PackedStack
from kestrel.models.layers.quant import QuantEmbedding, QuantLinear
from kestrel.models.nemotron_h import NemotronHMLP, NemotronHMoE
from kestrel.models.nemotron_nas import LinearAttention, LinearMLP


def _copy(t: torch.Tensor) -> nn.Parameter:
    """A frozen parameter holding a copy of `t` (a slice of a whole weight, which can then go)."""
    return nn.Parameter(t.clone(), requires_grad=False)


def _rank_share(total: int, tp: TPGroup, refusal: str) -> slice:
    """This rank's equal share of `total` items; `refusal` (the error) when they do not split."""
    if total % tp.size:
        raise ValueError(f"{refusal} over {tp.size} ranks")
    part = total // tp.size
    return slice(tp.rank * part, (tp.rank + 1) * part)


def column_parallel(linear: nn.Linear | QuantLinear, rows: slice) -> nn.Linear | QuantLinear:
    """Output rows `rows` of a Linear: x (..., in) -> this rank's slice of the outputs. A plain
    Linear (or a quantized one of the same format), so the fused layers still concatenate q/k/v
    and gate/up into one matmul."""
    if isinstance(linear, QuantLinear):
        return quantized.rows_of(linear, rows)
    part = _linear(_copy(linear.weight.data[rows]))
    if linear.bias is not None:
        part.bias = _copy(linear.bias.data[rows])
    return part


def _linear(weight: nn.Parameter) -> Linear:
    """A bias-free Linear over `weight` (out, in)."""
    part = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    part.weight = weight
    return part


class RowParallelLinear(nn.Module):
    """Input columns `cols` of a Linear: this rank's slice of the inputs -> the full outputs,
    summed over ranks; the bias is added once, after the sum."""

    def __init__(self, linear: nn.Linear | QuantLinear, cols: slice, tp: TPGroup):
        super().__init__()
        if isinstance(linear, QuantLinear):  # its columns, still quantized
            self.part = quantized.columns_of(linear, cols)
        else:
            self.part = _linear(_copy(linear.weight.data[:, cols]))
        self.bias = linear.bias
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.part(x))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the vocabulary (zero-padded to n): each rank embeds the ids it
    holds and zeros elsewhere, and the all-reduce gives every rank the full rows."""

    def __init__(self, table: nn.Embedding | QuantEmbedding, tp: TPGroup):
        super().__init__()
        if isinstance(table, QuantEmbedding):  # its rows, still quantized
            self.rows = quantized_vocab_shard(table, tp)
        else:
            self.rows = nn.Embedding.from_pretrained(vocab_shard(table.weight, tp))
        self.held = self.rows.num_embeddings
        self.start, self.tp = tp.rank * self.held, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        held = (local >= 0) & (local < self.held)
        rows = self.rows(local.clamp(0, self.held - 1))
        return self.tp.all_reduce(rows * held[..., None].to(rows.dtype))


class VocabParallelHead(nn.Module):
    """The output head's rows for this rank's vocabulary shard; logits gathered to (..., V)."""

    def __init__(self, shard: nn.Linear | QuantLinear, vocab: int, tp: TPGroup):
        super().__init__()
        self.part = shard  # vocab_shard's rows, or the tied embedding's own shard
        self.vocab, self.tp = vocab, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.part(x))[..., : self.vocab]


class ParallelExperts(nn.Module):
    """An Experts stack holding this rank's slice of each expert's width: its output is a
    partial sum over the width, joined by one all-reduce."""

    def __init__(self, experts: Experts, tp: TPGroup):
        super().__init__()
        width = experts.intermediate
        cols = _rank_share(width, tp, f"expert width {width} does not split")
        w = _stack(experts.in_proj)  # (E, 2I, H) gate rows then up rows, or (E, I, H) ungated
        rows = torch.cat([w[:, cols], w[:, width:][:, cols]], 1) if experts.gated else w[:, cols]
        _keep_experts(experts, rows, _stack(experts.down_proj)[:, :, cols])
        experts.intermediate = cols.stop - cols.start
        self.experts, self.tp = experts, tp

    def forward(self, x, weights, ids) -> torch.Tensor:
        return self.tp.all_reduce(self.experts(x, weights, ids))


class ExpertParallel(nn.Module):
    """An Experts stack holding this rank's E / N whole experts: a token's choices of other
    ranks' experts weigh 0 here, and one all-reduce sums every rank's experts."""

    def __init__(self, experts: Experts, tp: TPGroup):
        super().__init__()
        total = experts.num_experts
        own = _rank_share(total, tp, f"{total} experts do not split")
        self.first, self.end = own.start, own.stop
        _keep_experts(experts, _stack(experts.in_proj)[own], _stack(experts.down_proj)[own])
        experts.num_experts = own.stop - own.start
        self.experts, self.tp = experts, tp

    def forward(self, x, weights, ids) -> torch.Tensor:
        mine = (ids >= self.first) & (ids < self.end)
        local = torch.where(mine, ids - self.first, 0)
        return self.tp.all_reduce(self.experts(x, torch.where(mine, weights, 0), local))


def _stack(weight: nn.Parameter | PackedStack) -> torch.Tensor:
    """An expert stack's values; a GGUF file's packed stack is dequantized (its rank's part of
    the width would cut its blocks)."""
    return weight[:] if isinstance(weight, PackedStack) else weight.data


def _keep_experts(experts: Experts, in_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
    """The stack holds copies of these parts of its weights (the whole ones are let go)."""
    name = "gate_up_proj" if experts.gated else "up_proj"
    setattr(experts, name, _copy(in_proj))
    experts.down_proj = _copy(down_proj)


def vocab_shard(weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's rows of a (V, H) table, V padded with zero rows to a multiple of the ranks."""
    rows, n = _vocab_rows(weight.shape[0], tp)
    shard = weight.data[rows]
    if shard.shape[0] == n:
        return shard.clone()
    return torch.cat([shard, shard.new_zeros(n - shard.shape[0], shard.shape[1])])  # a new tensor


def quantized_vocab_shard(table: QuantEmbedding | QuantLinear, tp: TPGroup):
    """`vocab_shard` of a quantized table or head: its rows, still quantized, zero-padded."""
    rows, n = _vocab_rows(table.qweight.shape[0], tp)
    return quantized.padded(quantized.rows_of(table, rows), n)


def _vocab_rows(vocab: int, tp: TPGroup) -> tuple[slice, int]:
    """(this rank's rows of a `vocab`-row table, the rows every shard holds once padded)."""
    n = -(-vocab // tp.size)
    return slice(tp.rank * n, min((tp.rank + 1) * n, vocab)), n


def shard_model(model: nn.Module, tp: TPGroup, expert_parallel: bool = False) -> nn.Module:
    """Rewire `model` (loaded whole) to hold this rank's slices (`expert_parallel`: its whole
    experts, not a slice of each); returns it."""
    check_covered(model)
    shard_modules(list(model.modules()), tp, expert_parallel)
    _shard_vocab(model, tp)
    return _finish(model, tp)


def load_sharded(
    config, device, tp: TPGroup, expert_parallel: bool, progress: bool = True, layers=None
):
    """(model, tokenizer, source) with this rank's shard, loaded one decoder layer at a time and
    each cut as soon as it is in (after the rest: embeddings, head, norms): a rank holds its
    shard and one whole group at most, never the whole model. `layers(model)`: the [first, end)
    range of decoder layers to load (a pipeline stage's); the others stay on the meta device.
    A quantized folder (FP8, MLX, NVFP4) loads whole first: its loader reads every tensor on
    each pass, so a pass per layer would read the checkpoint once per layer."""
    from kestrel.loading import load_in_groups, load_model

    def groups(model: nn.Module) -> list[tuple[set[str], nn.Module | None]]:
        check_covered(model)
        prefix, stack = decoder_stack(model)
        names = [
            {f"{prefix}.{i}.{n}" for n, _ in layer.named_parameters(remove_duplicate=False)}
            for i, layer in enumerate(stack)
        ]
        first, end = layers(model) if layers is not None else (0, len(stack))
        rest = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set().union(*names)
        return [(rest, None), *((names[i], stack[i]) for i in range(first, end))]

    def cut(model: nn.Module, layer: nn.Module | None) -> None:
        if layer is not None:
            shard_modules(list(layer.modules()), tp, expert_parallel)
            return
        inside = {id(m) for m in decoder_stack(model)[1].modules()}  # the rest of the model
        shard_modules([m for m in model.modules() if id(m) not in inside], tp, expert_parallel)
        _shard_vocab(model, tp)

    if _quantized_folder(config):
        planned: list[tuple[set[str], nn.Module | None]] = []

        def outside(model: nn.Module) -> set[str]:  # what no group loads (other stages' layers)
            planned.extend(groups(model))
            loaded = set().union(*(names for names, _ in planned))
            return {n for n, _ in model.named_parameters(remove_duplicate=False)} - loaded

        model, tokenizer, source = load_model(config, device, progress, outside)
        for _, key in planned:
            cut(model, key)
    else:
        model, tokenizer, source = load_in_groups(config, device, groups, cut, progress)
    return _finish(model, tp), tokenizer, source


def _quantized_folder(config) -> bool:
    from kestrel.weights.loader import resolve
    from kestrel.weights.quantized import read_scheme

    if config.model.shape:
        return False
    source = resolve(config.model.model)
    return not source.is_gguf and read_scheme(source.path) is not None


def use_stage_groups(model: nn.Module, rank: int, parallel) -> None:
    """With tensor parallel inside pipeline stages (`parallel`: the config's ParallelConfig),
    each stage's ranks get a process group of their own (every rank creates every stage's, in
    order, right after joining) and this rank's sharded layers collect over its stage's."""
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if tp_size == 1 or pp_size == 1:
        return
    groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
    mine = TPGroup(rank % tp_size, tp_size, groups[rank // tp_size])
    for module in model.modules():
        if isinstance(getattr(module, "tp", None), TPGroup):
            module.tp = mine


def check_covered(model: nn.Module) -> None:
    """ValueError naming the Linears tensor parallel has no rule for (the model may still be on
    the meta device)."""
    uncovered = _uncovered_linears(model)
    if uncovered:
        raise ValueError(
            f"tensor parallel does not cover {type(model).__name__}'s layers "
            f"{', '.join(uncovered[:4])}{' ...' if len(uncovered) > 4 else ''}; it covers "
            "GQA and latent attention, gated MLPs, routed experts, the embedding and the head "
            "(and keeps vision towers whole)"
        )


def shard_modules(modules: list[nn.Module], tp: TPGroup, expert_parallel: bool = False) -> None:
    """Cut each of `modules` that a rule covers (loaded whole) to this rank's slices."""
    for module in modules:
        if isinstance(module, (Attention, Gemma4Attention)):
            _shard_attention(module, tp)
        elif isinstance(module, MultiHeadLatentAttention):
            _shard_latent_attention(module, tp)
        elif isinstance(module, (GatedMLP, NemotronHMLP)):
            _shard_mlp(module, tp)
        elif isinstance(module, Mamba2Mixer):
            _shard_mamba2(module, tp)
        elif isinstance(module, MambaMixer):
            _shard_mamba(module, tp)
        elif isinstance(getattr(module, "experts", None), Experts):
            split = ExpertParallel if expert_parallel else ParallelExperts
            module.experts = split(module.experts, tp)


def _finish(model: nn.Module, tp: TPGroup) -> nn.Module:
    """The config of this rank's heads, once every layer is cut (the KV layout reads them from
    the attention modules)."""
    model.config = _sharded_config(model.config, tp)
    return model


def _sharded_config(config, tp: TPGroup):
    """A copy of the config with this rank's attention heads (the paged runner sizes its query
    tiles by the GQA group they make)."""
    config = copy.deepcopy(config)
    text = config.get_text_config()
    try:
        text.head_dim = head_dim(text)  # before the head count it may be derived from changes
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads * tp.size
    except RuntimeError:  # head sizes per layer (gemma4): its query tiles keep the whole count
        return config
    text.num_attention_heads //= tp.size
    text.num_key_value_heads = max(1, kv_heads // tp.size)
    return config


# the Linears each shared layer's rule covers (split, or kept whole on every rank)
SHARDED_LINEARS = {
    Attention: ("q_proj", "k_proj", "v_proj", "o_proj"),
    MultiHeadLatentAttention: (
        *("q_proj", "q_a_proj", "q_b_proj"),  # q_proj, or q_a_proj (whole) then q_b_proj
        *("kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
    ),
    GatedMLP: ("gate_proj", "up_proj", "down_proj"),
    Gemma4Attention: ("q_proj", "k_proj", "v_proj", "o_proj"),
    # kept whole on every rank, they read and write the whole hidden state: nemotron_nas's
    # linear blocks (hidden -> hidden), gemma4's per-layer input projections and its router
    LinearAttention: ("linear_attn",),
    LinearMLP: ("linear_mlp",),
    Gemma4Block: ("per_layer_input_gate", "per_layer_projection"),
    Gemma4Model: ("per_layer_model_projection",),
    Gemma4Router: ("proj",),
    Mamba2Mixer: ("in_proj", "out_proj"),
    MambaMixer: ("in_proj", "x_proj", "dt_proj", "out_proj"),
    NemotronHMLP: ("up_proj", "down_proj"),
    NemotronHMoE: ("fc1_latent_proj", "fc2_latent_proj"),  # hidden <-> latent: kept whole
}


def _uncovered_linears(model: nn.Module) -> list[str]:
    covered = {
        id(getattr(m, name, None))
        for m in model.modules()
        for kind, names in SHARDED_LINEARS.items()
        if isinstance(m, kind)
        for name in names
    }
    covered.add(id(getattr(model, "lm_head", None)))
    # a gate on the shared experts' output (hidden -> 1) is small: every rank keeps it whole
    gates = [m.shared_expert_gate for m in model.modules() if hasattr(m, "shared_expert_gate")]
    covered |= {id(g) for g in gates}
    covered |= {id(m) for name in model.replicated for m in model.get_submodule(name).modules()}
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, QuantLinear)) and id(m) not in covered
    ]


def _shard_attention(attn: Attention | Gemma4Attention, tp: TPGroup) -> None:
    """GQA by heads. gemma4's layers may have no k/v_proj (they read another layer's cache,
    split the same way) or no v_proj (values are the keys)."""
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if hq % tp.size or (hkv % tp.size and tp.size % hkv):
        raise ValueError(f"{hq} query and {hkv} KV heads do not split over {tp.size} ranks")
    q_heads = hq // tp.size
    first_q = tp.rank * q_heads
    kv_heads = max(1, hkv // tp.size)
    first_kv = first_q // (hq // hkv)  # the KV head this rank's first query head reads
    attn.q_proj = column_parallel(attn.q_proj, _heads(first_q, q_heads, d))
    for name in ("k_proj", "v_proj"):
        if getattr(attn, name, None) is not None:
            setattr(attn, name, column_parallel(getattr(attn, name), _heads(first_kv, kv_heads, d)))
    attn.o_proj = RowParallelLinear(attn.o_proj, _heads(first_q, q_heads, d), tp)
    attn.num_heads, attn.num_kv_heads = q_heads, kv_heads


def _shard_latent_attention(attn: MultiHeadLatentAttention, tp: TPGroup) -> None:
    # kv_b_proj's rows are per head [no-RoPE key, value]; the queries' [no-RoPE, RoPE]
    if attn.num_heads % tp.size:
        raise ValueError(
            f"{attn.num_heads} latent attention heads do not split over {tp.size} ranks"
        )
    heads = attn.num_heads // tp.size
    first = tp.rank * heads
    query = "q_proj" if hasattr(attn, "q_proj") else "q_b_proj"
    q_rows = _heads(first, heads, attn.nope_dim + attn.rope_dim)
    setattr(attn, query, column_parallel(getattr(attn, query), q_rows))
    kv_rows = _heads(first, heads, attn.nope_dim + attn.v_dim)
    attn.kv_b_proj = column_parallel(attn.kv_b_proj, kv_rows)
    attn.o_proj = RowParallelLinear(attn.o_proj, _heads(first, heads, attn.v_dim), tp)
    attn.num_heads = heads  # W_uk / W_uv are viewed from kv_b_proj per call, never cached


def _shard_mamba2(m: Mamba2Mixer, tp: TPGroup) -> None:
    """Mamba2 by heads: in_proj's gate, x and dt rows, the conv's x channels, dt_bias, A, D and
    the gated norm of this rank's heads; B and C of this rank's state groups (all of them, kept
    whole, when there is one group: its norm then sums its squares over the ranks); out_proj
    row parallel."""
    H, P, N, G = m.num_heads, m.head_dim, m.state_size, m.n_groups
    if H % tp.size or (G % tp.size and G != 1):
        raise ValueError(f"Mamba2's {H} heads and {G} groups do not split over {tp.size} ranks")
    h, g = H // tp.size, G // tp.size if G % tp.size == 0 else G
    first_g = tp.rank * g if G % tp.size == 0 else 0
    heads = torch.arange(tp.rank * h, (tp.rank + 1) * h)
    x = torch.arange(tp.rank * h * P, (tp.rank + 1) * h * P)  # the heads' channels
    bc = torch.arange(first_g * N, (first_g + g) * N)  # the groups' state channels
    inner = H * P
    m.in_proj = column_parallel(
        m.in_proj,
        torch.cat(
            [x, inner + x, 2 * inner + bc, 2 * inner + G * N + bc, 2 * inner + 2 * G * N + heads]
        ),
    )
    m.conv1d = _conv_channels(m.conv1d, torch.cat([x, inner + bc, inner + G * N + bc]))
    for name in ("dt_bias", "A_log", "D"):
        setattr(m, name, _copy(getattr(m, name).data[heads]))
    whole_group = G == 1 and tp.size > 1
    m.norm = GroupNormAcrossRanks(m.norm, x, tp) if whole_group else _norm_channels(m.norm, x)
    m.out_proj = RowParallelLinear(m.out_proj, x, tp)
    m.num_heads, m.n_groups, m.inner = h, g, h * P


def _shard_mamba(m: MambaMixer, tp: TPGroup) -> None:
    """Mamba (v1, Jamba) by channels: in_proj's x and z rows, the conv, dt_proj's rows, A and D
    of this rank's channels; x_proj reads them row parallel (its dt, B and C summed over the
    ranks, so every rank has them whole), and so does out_proj."""
    own = _rank_share(m.inner, tp, f"Mamba's {m.inner} channels do not split")
    x = torch.arange(own.start, own.stop)
    m.in_proj = column_parallel(m.in_proj, torch.cat([x, m.inner + x]))
    m.conv1d = _conv_channels(m.conv1d, x)
    m.x_proj = RowParallelLinear(m.x_proj, x, tp)
    m.dt_proj = column_parallel(m.dt_proj, x)
    for name in ("A_log", "D"):
        setattr(m, name, _copy(getattr(m, name).data[x]))
    m.out_proj = RowParallelLinear(m.out_proj, x, tp)
    m.inner = len(x)


def _conv_channels(conv: nn.Conv1d, channels: torch.Tensor) -> nn.Conv1d:
    """A depthwise Conv1d of these channels only."""
    n = len(channels)
    part = nn.Conv1d(n, n, conv.kernel_size[0], groups=n, bias=conv.bias is not None, device="meta")
    part.weight = _copy(conv.weight.data[channels])
    if conv.bias is not None:
        part.bias = _copy(conv.bias.data[channels])
    return part


def _norm_channels(norm: GatedRMSNorm, channels: torch.Tensor) -> GatedRMSNorm:
    norm.weight = _copy(norm.weight.data[channels])
    return norm


class GroupNormAcrossRanks(nn.Module):
    """Mamba2's gated RMSNorm when its one group spans every rank's channels: the mean square is
    summed over the ranks (one all-reduce of a column per token)."""

    def __init__(self, norm: GatedRMSNorm, channels: torch.Tensor, tp: TPGroup):
        super().__init__()
        self.weight = _copy(norm.weight.data[channels])
        self.eps, self.width, self.tp = norm.eps, norm.group_size, tp  # the whole group's width

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() * F.silu(gate.float())
        square = self.tp.all_reduce(x.pow(2).sum(-1, keepdim=True))
        return self.weight * (x * torch.rsqrt(square / self.width + self.eps)).to(dtype)


def _heads(first: int, count: int, dim: int) -> slice:
    return slice(first * dim, (first + count) * dim)


def _shard_mlp(mlp: GatedMLP | NemotronHMLP, tp: TPGroup) -> None:
    """Gated or not (Nemotron-H's): gate and up along the width, down_proj along its input."""
    width = mlp.up_proj.out_features
    cols = _rank_share(width, tp, f"MLP width {width} does not split")
    for name in ("gate_proj", "up_proj"):
        if hasattr(mlp, name):
            setattr(mlp, name, column_parallel(getattr(mlp, name), cols))
    mlp.down_proj = RowParallelLinear(mlp.down_proj, cols, tp)


def _shard_vocab(model: nn.Module, tp: TPGroup) -> None:
    backbone, name = _token_embedding(model)
    head = getattr(model, "lm_head", None)
    table = getattr(backbone, name)
    embedding = VocabParallelEmbedding(table, tp)
    setattr(backbone, name, embedding)
    if head is not None:
        model.lm_head = VocabParallelHead(
            _head_shard(head, table, embedding, tp), table.num_embeddings, tp
        )


def _token_embedding(model: nn.Module) -> tuple[nn.Module, str]:
    """(the module holding the decoder's token embedding, its attribute name): `embed_tokens`
    (`embeddings` in Nemotron-H) of the text decoder, wherever the family nests it."""
    for module in model.modules():
        for name in ("embed_tokens", "embeddings"):
            if isinstance(getattr(module, name, None), (nn.Embedding, QuantEmbedding)):
                return module, name
    raise ValueError(f"no token embedding in {type(model).__name__}")


def _head_shard(head, table, embedding: VocabParallelEmbedding, tp: TPGroup):
    """The head's rows for this rank: a tied head reads the embedding's own shard."""
    if isinstance(head, QuantLinear):
        if isinstance(table, QuantEmbedding) and head.qweight is table.qweight:
            return quantized.linear_of(embedding.rows)
        return quantized_vocab_shard(head, tp)
    if isinstance(table, nn.Embedding) and head.weight is table.weight:
        return _linear(embedding.rows.weight)
    return _linear(nn.Parameter(vocab_shard(head.weight, tp), requires_grad=False))

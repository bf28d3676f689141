"""Pipeline parallel: each rank (a stage) holds a range of the decoder's layers; the hidden states
cross from stage to stage with torch.distributed point-to-point, and the last stage's final-norm
hidden states go to every rank, which apply the (replicated) head themselves.

The model files keep one definition each: a stage is the whole model with the layers outside its
range replaced in the layer stack by pass-throughs (`RemoteLayer`), their weights never read
from the checkpoint (`other_stages_parameters` tells the loader which) and their KV pool entries
dropped (the embedding and the head stay on every rank). The decoder loop runs on every rank as
written; at the first layer past its range a stage sends the hidden states that layer would
have received (after whatever the loop adds between layers), and the next stage's first layer
(`ReceivingLayer`) takes them in place of its own input. Every rank runs the same engine in
lockstep (distributed/workers.py), so every forward's sends meet their receives, and since all
ranks apply the head to the same hidden states, they sample the same tokens.

This is the split meant for models larger than one device. A step of many tokens goes through
the stages as micro-batches (engine/paged_runner.py cuts it; `StageOutputs` takes them all): a
stage sends one micro-batch on and starts the next while the following stage works on the first,
and only then are the last stage's hidden states shared. A step's sampling waits for all of its
micro-batches, so every rank still plans and samples in lockstep (GPipe's schedule within a step,
not vLLM's batches in flight across steps).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Stage:
    """This rank's stage of `size`; `layers`: the [first, end) range of decoder layers it holds."""

    rank: int
    size: int
    layers: tuple[int, int]


def stage_ranges(
    num_layers: int, size: int, spec: str | None = None, sources: list[int] | None = None
) -> list[tuple[int, int]]:
    """[first, end) layer ranges per stage: `spec` as "0-15,16-31" (inclusive, contiguous, from
    layer 0 to the last), else as even as the layers allow (earlier stages one more), each
    boundary moved down so that no layer attends over the cache of a layer (`sources`, per
    layer: gemma4's KV-shared layers) in an earlier stage."""
    sources = sources or list(range(num_layers))
    ranges = _even(num_layers, size) if spec is None else _parse(spec, size, num_layers)
    bounds = [first for first, _ in ranges] + [num_layers]
    for k in range(len(bounds) - 2, 0, -1):
        crossing = [sources[i] for i in range(bounds[k], num_layers) if sources[i] < bounds[k]]
        if crossing and spec is not None:
            raise ValueError(
                f"--pp-layers {spec!r}: layer {bounds[k]}'s stage needs the cache of layer "
                f"{min(crossing)}: start the stage at or before it"
            )
        bounds[k] = min([bounds[k], *crossing])
    ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
    if any(end <= first for first, end in ranges):
        raise ValueError(f"{num_layers} layers do not split into {size} pipeline stages")
    return ranges


def _even(num_layers: int, size: int) -> list[tuple[int, int]]:
    base, extra = divmod(num_layers, size)
    bounds = [0]
    for stage in range(size):
        bounds.append(bounds[-1] + base + (stage < extra))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _parse(spec: str, size: int, num_layers: int) -> list[tuple[int, int]]:
    try:
        ranges = [tuple(int(x) for x in part.split("-")) for part in spec.split(",")]
        ranges = [(first, last + 1) for first, last in ranges]
    except ValueError:
        raise ValueError(f"--pp-layers {spec!r}: expected ranges like 0-15,16-31") from None
    starts = [0] + [end for _, end in ranges[:-1]]
    if (
        len(ranges) != size
        or [first for first, _ in ranges] != starts
        or ranges[-1][1] != num_layers
        or any(end <= first for first, end in ranges)
    ):
        raise ValueError(
            f"--pp-layers {spec!r}: {size} contiguous non-empty ranges covering layers "
            f"0-{num_layers - 1} are needed"
        )
    return ranges


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's layer stack: the ModuleList named `layers` of the text model."""
    return decoder_stack(model)[1]


def decoder_stack(model: nn.Module) -> tuple[str, nn.ModuleList]:
    text = model.config.get_text_config()
    stacks = [
        (name, m)
        for name, m in model.named_modules()
        if name.endswith("layers")
        and isinstance(m, nn.ModuleList)
        and len(m) == text.num_hidden_layers
    ]
    if len(stacks) != 1:
        raise ValueError(
            f"pipeline parallel: no single decoder layer stack in {type(model).__name__}"
        )
    return stacks[0]


def stage_of(model: nn.Module, rank: int, size: int, spec: str | None = None) -> Stage:
    """This rank's stage of `model`'s layers (its even split, or `spec`)."""
    layers = decoder_layers(model)
    sources = list(range(len(layers)))
    for module in model.modules():  # layers that attend over another layer's cache
        if hasattr(module, "kv_source"):
            sources[module.layer_idx] = module.kv_source
    return Stage(rank, size, stage_ranges(len(layers), size, spec, sources)[rank])


def other_stages_parameters(rank: int, size: int, spec: str | None = None):
    """For the loader (`select`): model -> the names of the parameters of the layers outside
    this rank's stage, which it then never reads."""

    def select(model: nn.Module) -> set[str]:
        prefix, layers = decoder_stack(model)
        first, end = stage_of(model, rank, size, spec).layers
        return {
            f"{prefix}.{i}.{name}"
            for i, layer in enumerate(layers)
            if not first <= i < end
            for name, _ in layer.named_parameters(remove_duplicate=False)
        }

    return select


def split_stages(
    model: nn.Module, rank: int, size: int, spec: str | None = None, tp: int = 1
) -> nn.Module:
    """Cut `model` to its stage of `size`, in place. With tensor parallel inside the stages
    (`tp` ranks each), global rank g is stage g // tp's tensor-parallel rank g % tp, and `rank`
    is that global rank: its hidden states go to the same tensor-parallel rank of the next
    stage (g + tp)."""
    layers = decoder_layers(model)
    stage = stage_of(model, rank // tp, size, spec)
    first, end = stage.layers
    for i, layer in enumerate(layers):
        if not first <= i < end:
            layers[i] = RemoteLayer(layer, send_to=rank + tp if i == end else None)
    if stage.rank > 0:
        layers[first] = ReceivingLayer(layers[first], rank - tp)
    # the paged KV pool holds only this stage's layers (recurrent state stays whole: its slots
    # are the scheduler's, which must plan alike on every rank)
    model.stage_layers = (first, end)
    model.pipeline = StageOutputs(model.decoder_hidden, size, (size - 1) * tp)
    return model


class StageLayer(nn.Module):
    """A decoder layer's stand-in in a stage's layer stack. It holds the layer's submodules,
    parameters and buffers under their own names, so checkpoint and adapter names stay and every
    walk over the model's modules (windows, KV sources, recurrent state shapes, fusing) sees the
    layer's; and its plain attributes (a layer type, flags) for the model's loop to read."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for name, child in layer.named_children():
            self.add_module(name, child)
        for name, p in layer.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in layer.named_buffers(recurse=False):
            self.register_buffer(name, b)
        self.__dict__.update({k: v for k, v in vars(layer).items() if not k.startswith("_")})


class RemoteLayer(StageLayer):
    """A layer another stage runs, its weights dropped: its input goes on as it is; the first
    one past this stage's range sends it to the next stage first (the input that layer would
    have received, after whatever the decoder loop adds between layers)."""

    def __init__(self, layer: nn.Module, send_to: int | None):
        _drop_weights(layer)
        super().__init__(layer)
        self.send_to = send_to

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.send_to is not None:
            dist.send(x.contiguous(), self.send_to)
        return x


class ReceivingLayer(StageLayer):
    """This stage's first layer (past stage 0), run on what the previous stage sent in place of
    its own input."""

    def __init__(self, layer: nn.Module, source: int):
        super().__init__(layer)
        self.source = source
        object.__setattr__(self, "layer", layer)  # held, not registered: its parts are ours

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        received = torch.empty_like(x)
        dist.recv(received, self.source)
        return self.layer(received, *args, **kwargs)


def _drop_weights(layer: nn.Module) -> None:
    """A layer another stage runs keeps its attributes (windows, head counts) but no weights."""
    for module in layer.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(p.to("meta"), requires_grad=False))


class StageOutputs:
    """A stage model's `pipeline` (which its `hidden` runs a whole batch through): micro-batches
    -> the last stage's final-norm hidden states of each (the head's input), on every rank."""

    def __init__(self, hidden, stages: int, last: int):
        self.hidden = hidden  # this stage's part of the forward, its sends and receives
        self.stages = stages
        self.last = last  # the last stage's first rank (its tensor-parallel ranks hold the same)

    def __call__(self, batches: list) -> list[torch.Tensor]:
        # every micro-batch through this stage before any waits on the last stage's outputs
        own = [self.hidden(batch) for batch in batches]
        h = torch.cat(own) if len(own) > 1 else own[0].contiguous()
        dist.broadcast(h, self.last)
        return list(h.split([x.shape[0] for x in own]))

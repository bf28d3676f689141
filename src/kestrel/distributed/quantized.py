"""Tensor-parallel slices of quantized layers (models/layers/quant.py's QuantLinear and
QuantEmbedding): a rank keeps its rows or columns of the checkpoint's own tensors, still
quantized, so `-tp N` holds about 1/N of a packed GGUF or a quantized folder per rank instead of
its dequantized copy.

Each format stores a row's values with scales per row, per group of columns or per FP8 tile:
- rows (column parallel, the vocabulary) cut anywhere. FP8 scale tiles taller than a row stay
  tiles when the cut starts on a tile boundary; otherwise each kept row gets its tile's scale
  (a scale per row, which is exact).
- columns (row parallel) cut at the format's group (`QuantFormat.column_group`): a GGUF block,
  an MLX or NVFP4 scale group, an FP8 tile's width (tiles as wide as the row cut anywhere). A
  cut inside a group is refused, naming the layer's format.
"""

import torch

from kestrel.kernels.formats import QuantFormat
from kestrel.models.layers.quant import QuantEmbedding, QuantLinear


def rows_of(layer: QuantLinear | QuantEmbedding, rows) -> QuantLinear | QuantEmbedding:
    """The layer's output rows (embedding: vocabulary rows) `rows`, a slice or ids."""
    n = layer.qweight.shape[0]
    ids = torch.arange(n)[rows]
    fmt, tensors = layer.fmt, {}
    for role, t in layer.tensors().items():
        if _of_the_tensor(role, t):
            tensors[role] = t
        elif t.shape[0] == n:
            tensors[role] = _rows(t, ids)
        else:  # scale tiles of fmt.row_tile rows (FP8)
            tensors[role], fmt = _tile_rows(t, ids, fmt)
    bias = getattr(layer, "bias", None)
    if bias is not None:
        bias = torch.nn.Parameter(bias.data[ids.to(bias.device)].clone(), requires_grad=False)
    return _like(layer, tensors, fmt, layer.cols, bias)


def padded(layer: QuantLinear | QuantEmbedding, rows: int) -> QuantLinear | QuantEmbedding:
    """The layer with zero rows appended up to `rows` (a vocabulary shard's padding): zero
    blocks, words and scales decode to zero weights in every format."""
    n = layer.qweight.shape[0]
    if n == rows:
        return layer
    fmt, tensors = layer.fmt, {}
    for role, t in layer.tensors().items():
        if _of_the_tensor(role, t):
            tensors[role] = t
            continue
        total = rows if t.shape[0] == n else -(-rows // fmt.row_tile)  # FP8 tiles
        tensors[role] = _as_stored(t, lambda v, k=total: _zero_rows(v, k))
    return _like(layer, tensors, fmt, layer.cols, None)


def _zero_rows(t: torch.Tensor, total: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(total - t.shape[0], *t.shape[1:])])


def columns_of(layer: QuantLinear, cols: slice | torch.Tensor) -> QuantLinear:
    """The Linear's input columns `cols`, a slice or a run of ids (a row-parallel slice; the
    bias left out)."""
    K, fmt = layer.in_features, layer.fmt
    group = fmt.column_group(K)
    start, stop = _bounds(cols)
    if start % group or (stop % group and stop != K):
        raise ValueError(
            f"a tensor-parallel cut at columns {start}-{stop} splits {fmt.name}'s groups of "
            f"{group} columns; use --quantized-weights dequantize, or fewer ranks"
        )
    tensors = {}
    for role, t in layer.tensors().items():
        stored = None if _of_the_tensor(role, t) else fmt.column_share(role, t, K)
        if stored is None:  # a tensor every column shares
            tensors[role] = t
            continue
        first, end = round(start * stored), round(stop * stored)
        tensors[role] = _columns(t, slice(first, end if stop != K else t.shape[1]))
    return _like(layer, tensors, fmt, stop - start, None)


def _bounds(cols: slice | torch.Tensor) -> tuple[int, int]:
    if isinstance(cols, slice):
        return cols.start, cols.stop
    start, stop = int(cols[0]), int(cols[-1]) + 1
    if not torch.equal(cols.cpu(), torch.arange(start, stop)):
        raise ValueError("a quantized layer's columns split only as one run")
    return start, stop


def _of_the_tensor(role: str, t: torch.Tensor) -> bool:
    """Whether t is one value for the whole weight (NVFP4's second scale): every cut keeps it."""
    return t.dim() == 0 or role == "scale_2"


def _tile_rows(scale: torch.Tensor, ids: torch.Tensor, fmt: QuantFormat):
    """(the scale rows of rows `ids`, their format): whole tiles when `ids` run on from a tile's
    first row, else one scale per row."""
    tall = fmt.row_tile
    starts_a_tile = ids[0] % tall == 0 and torch.equal(ids, torch.arange(ids[0], ids[-1] + 1))
    if starts_a_tile:
        return _rows(scale, torch.unique_consecutive(ids // tall)), fmt
    return _rows(scale, ids // tall), fmt.per_row()


def _rows(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return _as_stored(t, lambda v: v[ids.to(v.device)].clone())


def _columns(t: torch.Tensor, cols: slice) -> torch.Tensor:
    return _as_stored(t, lambda v: v[:, cols].clone(memory_format=torch.contiguous_format))


def _as_stored(t: torch.Tensor, cut) -> torch.Tensor:
    """`cut` applied to t (uint32 MLX words through an int32 view: few ops take uint32)."""
    if t.dtype == torch.uint32:
        return cut(t.view(torch.int32)).view(torch.uint32)
    return cut(t)


def linear_of(table: QuantEmbedding) -> QuantLinear:
    """A head over the embedding's own tensors (tied weights: one copy)."""
    tensors = dict(table.tensors())
    return QuantLinear(tensors.pop("qweight"), table.fmt, table.cols, **tensors)


def _like(layer, tensors: dict, fmt: QuantFormat, cols: int, bias):
    """A layer of `layer`'s kind over these tensors (a Linear with `bias`)."""
    qweight = tensors.pop("qweight")
    if isinstance(layer, QuantEmbedding):
        return QuantEmbedding(qweight, fmt, cols, layer.dtype, **tensors)
    return QuantLinear(qweight, fmt, cols, bias, **tensors)

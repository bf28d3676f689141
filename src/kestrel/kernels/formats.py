"""One class per quantization method: GGUF blocks, MLX affine, FP8 and NVFP4, as vLLM gives each
method a class (`QuantizeMethodBase`). Each says what a weight of its format stores (the tensors
by role: `qweight`, the packed values, and the format's scales, with their shapes), how rows of
the weight decode to float, which kernel computes a linear layer or an expert's matmul from the
stored bits on each device (else the caller dequantizes), and how its rows and columns may be
cut (MoE stacks, fused projections, tensor parallel).

A format is a frozen dataclass of its parameters, so two weights share a format when they
compare equal. `FORMATS`, from a method's name to its class, is the only place a name is looked
up; everything else calls the format's methods. The GGUF block decoders and the FP8 GEMMs are
kernels/quant.py's.
Imports nothing from kestrel outside kestrel.kernels.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kestrel.kernels import cpu_native, fp8_gemv, gguf_dp4a, gguf_gemv, quant
from kestrel.kernels.backend import on_cpu_native
from kestrel.kernels.moe import QuantStack

Tensors = dict[str, torch.Tensor]  # a weight's tensors by role

WHOLE = 1 << 30  # an FP8 scale tile that spans the whole weight along that axis


class QuantFormat:
    """How a weight of one method is stored and computed from. Subclasses are frozen dataclasses
    of the method's parameters; the defaults here are what a format with nothing to say does."""

    kind: ClassVar[str]  # the method's name in `FORMATS`
    storage: ClassVar[str] = ""  # safetensors header dtype of `qweight` (a folder's formats)

    @property
    def name(self) -> str:
        """The type `kestrel inspect` lists (and a quantized layer's `qtype`)."""
        raise NotImplementedError

    # --- what it stores ---------------------------------------------------------------------

    def expected_shapes(self, rows: int, cols: int) -> dict[str, tuple]:
        """Each role's shape for a weight of (rows, cols)."""
        raise NotImplementedError

    def shape_note(self, role: str) -> str:
        """Why role `role` has its shape, for a checkpoint's shape error (" (...)" or "")."""
        return ""

    def row_fits(self, cols: int) -> bool:
        """Whether a row of `cols` inputs is whole groups of this format's scales."""
        return True

    def held(self, tensors: Tensors, shape: tuple) -> Tensors:
        """A checkpoint's tensors for a weight of `shape` as the quantized layer holds them."""
        return dict(tensors)

    # --- how it dequantizes -----------------------------------------------------------------

    def dequantize_rows(self, t: Tensors, rows, cols: int) -> torch.Tensor:
        """Rows `rows` (a slice or a LongTensor of row ids) of the weight held by `t` -> (n, cols)
        float32."""
        raise NotImplementedError

    # --- which kernel computes from it ------------------------------------------------------

    def linear_buffers(self, t: Tensors, cols: int, rows: int) -> dict:
        """Tensors derived once from a (rows, cols) Linear's `t` that `linear` reads, by the
        name the layer keeps them as a (non-persistent) buffer."""
        return {}

    def linear(self, layer, x: torch.Tensor) -> torch.Tensor | None:
        """x (M, cols) @ W.T (M, rows) by a kernel that reads `layer`'s stored bits (a
        `QuantLinear`: its tensors by role, `cols`, `linear_buffers`), in x's dtype; None where
        none serves x, and the layer multiplies dequantized rows."""
        return None

    def expert_linear(self, t: Tensors, x: torch.Tensor, cols: int) -> torch.Tensor | None:
        """x (M, cols) times one expert's weight `t` (its rows of a stack) transposed, by a kernel
        that reads the stored bits; None: the caller multiplies the expert dequantized."""
        return None

    def serves_pairs(self, x: torch.Tensor, max_rows: int) -> bool:
        """Whether `pairs_linear` reads an expert stack's bits for x (T, cols), T <= max_rows."""
        return False

    def pairs_linear(self, t: Tensors, x, cols: int, experts, scale=None) -> torch.Tensor:
        """Each (token, expert) pair's x row times expert experts[p]'s weight of the stack `t`
        (E, rows, ...) transposed, (P, rows), times scale[p] in float32 where given (where
        `serves_pairs`)."""
        raise NotImplementedError

    def kernel_stack(self, t: Tensors) -> QuantStack | None:
        """An expert stack's tensors `t` (E, rows, ...) as the fused MoE kernels read them
        quantized; None where they do not decode the format (the stack is dequantized)."""
        return None

    # --- how it is cut and stacked ----------------------------------------------------------

    def by_row(self, t: Tensors, rows: int) -> tuple["QuantFormat", Tensors]:
        """(the format, the tensors) with one entry per row in each role, (rows, ...): what an
        expert stack holds, so that parts with scales of their own (gate and up, each expert)
        stack along the rows."""
        return self, t

    def stacks_rows(self, rows: list[int]) -> bool:
        """Whether weights of this format (equal, with these row counts) concatenate along their
        rows into one weight whose tensors are theirs concatenated (fused q/k/v, gate/up)."""
        return False

    def column_group(self, cols: int) -> int:
        """The columns of a row a cut (tensor parallel, row parallel) must keep together."""
        raise NotImplementedError

    def column_share(self, role: str, t: torch.Tensor, cols: int) -> float | None:
        """How many of `t`'s columns one of the weight's `cols` columns takes (a fraction for
        packed values and group scales); None for a tensor every column shares."""
        return t.shape[1] / cols

    @property
    def row_tile(self) -> int:
        """The weight rows one row of a scale tensor covers."""
        return 1

    def per_row(self) -> "QuantFormat":
        """The format with `row_tile` 1 (a scale tile's rows repeated down its rows)."""
        return self


@dataclass(frozen=True)
class GGUFFormat(QuantFormat):
    """llama.cpp's blocks: `qweight` (rows, row bytes) uint8, each row `cols / elements` blocks of
    type `qtype` (kernels/quant.py's `LAYOUTS`; on CUDA Q6_K's padded to 224 bytes). Linears read
    the blocks in the Triton GEMVs on CUDA decode (the k-quants on int8-quantized half x in
    kernels/gguf_dp4a.py, the rest in kernels/gguf_gemv.py) and in the native matmul on the CPU;
    experts too on the CPU, and on CUDA decode a k-quant stack's (token, expert) pairs in
    gguf_dp4a's expert GEMV (`pairs_linear`)."""

    qtype: str
    kind: ClassVar[str] = "gguf"

    @property
    def name(self) -> str:
        return self.qtype

    def expected_shapes(self, rows: int, cols: int) -> dict[str, tuple]:
        return {"qweight": (rows, quant.row_bytes(self.qtype, cols))}

    def dequantize_rows(self, t: Tensors, rows, cols: int) -> torch.Tensor:
        blocks = t["qweight"][rows]
        if on_cpu_native(blocks) and self.qtype in cpu_native.QTYPES:
            return cpu_native.gguf_dequantize(blocks, self.qtype, cols)
        return quant.dequantize(blocks, self.qtype, cols)

    def linear(self, layer, x: torch.Tensor) -> torch.Tensor | None:
        if gguf_dp4a.serves(x, self.qtype):  # half decode on CUDA
            return gguf_dp4a.gemv(x, layer.qweight, self.qtype, layer.cols)
        if gguf_gemv.serves(x, self.qtype):  # decode on CUDA
            return gguf_gemv.gemv(x, layer.qweight, self.qtype, layer.cols)
        return self._native_mm(x, layer.qweight, layer.cols)

    def expert_linear(self, t: Tensors, x: torch.Tensor, cols: int) -> torch.Tensor | None:
        return self._native_mm(x, t["qweight"], cols)

    def serves_pairs(self, x: torch.Tensor, max_rows: int) -> bool:
        return gguf_dp4a.serves(x, self.qtype, max_rows)  # k-quants on CUDA

    def pairs_linear(self, t: Tensors, x, cols: int, experts, scale=None) -> torch.Tensor:
        return gguf_dp4a.expert_gemv(x, t["qweight"], self.qtype, cols, experts, scale)

    def _native_mm(self, x: torch.Tensor, blocks: torch.Tensor, cols: int) -> torch.Tensor | None:
        """x @ W.T from the blocks in the CPU's native kernels, where they serve the type."""
        if on_cpu_native(x) and self.qtype in cpu_native.QTYPES:
            return cpu_native.gguf_mm(x, blocks, self.qtype, cols)
        return None

    def stacks_rows(self, rows: list[int]) -> bool:
        return True  # blocks are per row

    def column_group(self, cols: int) -> int:
        return quant.LAYOUTS[self.qtype][0]

    def column_share(self, role: str, t: torch.Tensor, cols: int) -> float | None:
        elements, size = quant.LAYOUTS[self.qtype]  # Q6_K_224's padding too
        return size / elements


@dataclass(frozen=True)
class MLXFormat(QuantFormat):
    """mlx-lm's affine quantization: `bits` per value packed little end first in uint32 words,
    `qweight` (rows, cols * bits / 32), times `scales` plus `biases` (rows, cols / group). The
    fused MoE kernels read 4- and 8-bit stacks; linears dequantize."""

    bits: int
    group: int
    kind: ClassVar[str] = "mlx"
    storage: ClassVar[str] = "U32"

    @property
    def name(self) -> str:
        return f"MLX_Q{self.bits}_G{self.group}"

    def expected_shapes(self, rows: int, cols: int) -> dict[str, tuple]:
        groups = (rows, cols // self.group)
        return {"qweight": (rows, cols * self.bits // 32), "scales": groups, "biases": groups}

    def shape_note(self, role: str) -> str:
        if role == "qweight":
            return f" (uint32 words of {self.bits}-bit values)"
        return f" (one per {self.group} inputs)"

    def row_fits(self, cols: int) -> bool:
        return cols % self.group == 0

    def dequantize_rows(self, t: Tensors, rows, cols: int) -> torch.Tensor:
        words = t["qweight"].view(torch.int32)[rows]  # CUDA cannot index uint32 tensors
        q = unpack_bits(words, self.bits, cols).float()
        scales, biases = t["scales"][rows].float(), t["biases"][rows].float()  # (n, cols / group)
        w = q.reshape(q.shape[0], -1, self.group) * scales.unsqueeze(-1) + biases.unsqueeze(-1)
        return w.reshape(q.shape[0], cols)

    def kernel_stack(self, t: Tensors) -> QuantStack | None:
        if self.bits not in (4, 8):
            return None
        return QuantStack(t["qweight"], t["scales"], t["biases"], self.bits, self.group)

    def column_group(self, cols: int) -> int:
        return self.group


def unpack_bits(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """(n, cols * bits / 32) uint32 -> (n, cols) int32: a little-endian bit stream, value i in
    bits [i * bits, (i + 1) * bits) of the row, as MLX packs it."""
    b = words.contiguous().view(torch.uint8).to(torch.int32)  # (n, 4 words) bytes, low first
    if 8 % bits == 0:  # 2, 4, 8: whole values per byte
        shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=b.device)
        return ((b.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(b.shape[0], cols)
    start = torch.arange(cols, device=b.device) * bits  # 3, 5, 6: values straddle bytes
    b = F.pad(b, (0, 1))
    pair = b[:, start // 8] | (b[:, start // 8 + 1] << 8)
    return (pair >> (start % 8).to(torch.int32)) & ((1 << bits) - 1)


@dataclass(frozen=True)
class FP8Format(QuantFormat):
    """float8_e4m3fn values, `qweight` (rows, cols), times a float32 `scale` per `block` = (rows,
    cols) tile, held as the tile grid (WHOLE: the tile spans that axis). On CUDA decode a Triton
    GEMV reads the bytes (kernels/fp8_gemv.py); larger bfloat16 batches multiply on the FP8
    tensor cores, activations quantized on the fly: per row for one scale per row or per tensor
    (`torch._scaled_mm`), per 1 x 128 group for 128 x 128 tiles (the block-scaled GEMM, where
    the GPU runs it). The fused MoE kernels read its stacks."""

    block: tuple[int, int] = (WHOLE, WHOLE)
    kind: ClassVar[str] = "fp8"
    storage: ClassVar[str] = "F8_E4M3"

    @property
    def name(self) -> str:
        tile = {(WHOLE, WHOLE): "TENSOR", (1, WHOLE): "CHANNEL"}.get(self.block)
        return f"FP8_E4M3_{tile or f'{self.block[0]}x{self.block[1]}'}"

    def expected_shapes(self, rows: int, cols: int) -> dict[str, tuple]:
        tiles = (math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))
        return {"qweight": (rows, cols), "scale": tiles}

    def shape_note(self, role: str) -> str:
        if role == "qweight":
            return ""
        tile = {(WHOLE, WHOLE): "tensor", (1, WHOLE): "row"}.get(self.block)
        return f" (one per {tile or f'{self.block[0]}x{self.block[1]} tile'})"

    def held(self, tensors: Tensors, shape: tuple) -> Tensors:
        tiles = self.expected_shapes(*shape)["scale"]
        return {**tensors, "scale": tensors["scale"].float().reshape(tiles)}  # the tile grid

    def dequantize_rows(self, t: Tensors, rows, cols: int) -> torch.Tensor:
        """fp8 * scale, the scale of tile (r // block rows, c // block cols)."""
        w = t["qweight"][rows].float()  # (n, cols)
        ids = _row_ids(rows, t["qweight"].shape[0], w.device)
        col_tiles = torch.arange(cols, device=w.device) // self.block[1]
        return w * t["scale"].float()[ids // self.block[0]][:, col_tiles]

    def linear_buffers(self, t: Tensors, cols: int, rows: int) -> dict:
        return {
            "fp8_scale": self._row_scale(t, cols, rows),
            "fp8_tiles": self._tiles(t, cols, rows),
        }

    def _row_scale(self, t: Tensors, cols: int, rows: int) -> torch.Tensor | None:
        """(1, rows) float32 when W has one scale per row or per tensor and the FP8 GEMM takes
        its shape (dims multiples of 16); None otherwise (tiles: `_tiles`)."""
        if self.block[1] < cols or (cols | rows) % 16:
            return None
        scale = t["scale"]
        ids = torch.arange(rows, device=scale.device) // self.block[0]
        return scale.float()[ids, 0].reshape(1, -1).contiguous()

    def _tiles(self, t: Tensors, cols: int, rows: int) -> torch.Tensor | None:
        """The block-scaled GEMM's scales when W is in 128 x 128 tiles that cover it whole and
        this GPU runs that GEMM (`fp8_block_gemm_works`); None otherwise (dequantize)."""
        tiled = self.block == (quant.FP8_TILE, quant.FP8_TILE)
        whole = (cols % quant.FP8_TILE, rows % quant.FP8_TILE) == (0, 0)
        if not (tiled and whole and quant.fp8_block_gemm_works(t["qweight"].device)):
            return None
        return quant.fp8_block_scales(t["scale"])

    def linear(self, layer, x: torch.Tensor) -> torch.Tensor | None:
        if fp8_gemv.serves(x, self.block):  # decode on CUDA
            return fp8_gemv.gemv(x, layer.qweight, layer.scale, self.block)
        if not (x.is_cuda and x.dtype == torch.bfloat16):
            return None
        if layer.fp8_scale is not None:  # on the FP8 tensor cores
            return quant.fp8_linear(x, layer.qweight, layer.fp8_scale)
        if layer.fp8_tiles is not None:
            return quant.fp8_block_linear(x, layer.qweight, layer.fp8_tiles)
        return None

    def kernel_stack(self, t: Tensors) -> QuantStack | None:
        return QuantStack(t["qweight"], t["scale"], None, 0, self.block[1])

    def by_row(self, t: Tensors, rows: int) -> tuple[QuantFormat, Tensors]:
        """Tile scales repeated down their tile's rows (4 bytes per row and tile: 3% of the
        weight's bytes for 128-wide tiles)."""
        tiles = torch.arange(rows, device=t["scale"].device) // self.block[0]
        return self.per_row(), {**t, "scale": t["scale"][tiles]}

    def stacks_rows(self, rows: list[int]) -> bool:
        # the scale grids stack when no tile straddles two weights: each but the last ends on a
        # whole tile; the last may end inside one (MLA's 576-row kv_a after q_a)
        return all(n % self.block[0] == 0 for n in rows[:-1])

    def column_group(self, cols: int) -> int:
        return 1 if self.block[1] >= cols else self.block[1]

    def column_share(self, role: str, t: torch.Tensor, cols: int) -> float | None:
        if role != "scale":
            return super().column_share(role, t, cols)
        return None if self.block[1] >= cols else 1 / self.block[1]

    @property
    def row_tile(self) -> int:
        return self.block[0]

    def per_row(self) -> QuantFormat:
        return FP8Format(block=(1, self.block[1]))


def _row_ids(rows, n: int, device) -> torch.Tensor:
    if isinstance(rows, torch.Tensor):
        return rows.reshape(-1)
    return torch.arange(n, device=device)[rows]


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the 3 magnitude bits of FP4 e2m1; bit 3 is sign


_TABLES: dict[torch.device, torch.Tensor] = {}


def _e2m1_table(device: torch.device) -> torch.Tensor:
    """The 16 e2m1 codes' values on `device`, made once (no host copy inside a CUDA graph)."""
    if device not in _TABLES:
        _TABLES[device] = torch.tensor(E2M1 + tuple(-v for v in E2M1), device=device)
    return _TABLES[device]


@dataclass(frozen=True)
class NVFP4Format(QuantFormat):
    """e2m1 nibbles, two a byte (the even element in the low nibble), `qweight` (rows, cols / 2)
    uint8, times an fp8 `scale` per `group` = 16 inputs (rows, cols / group) times one float32
    `scale_2` for the tensor (one per row in an expert stack). Linears and experts dequantize."""

    group: int = 16
    kind: ClassVar[str] = "nvfp4"
    storage: ClassVar[str] = "U8"

    @property
    def name(self) -> str:
        return "NVFP4"

    def expected_shapes(self, rows: int, cols: int) -> dict[str, tuple]:
        return {"qweight": (rows, cols // 2), "scale": (rows, cols // self.group), "scale_2": (1,)}

    def shape_note(self, role: str) -> str:
        return "" if role == "qweight" else f" (one per {self.group} inputs)"

    def row_fits(self, cols: int) -> bool:
        return cols % self.group == 0

    def held(self, tensors: Tensors, shape: tuple) -> Tensors:
        return {**tensors, "scale_2": tensors["scale_2"].float().reshape(())}  # a multiplier

    def dequantize_rows(self, t: Tensors, rows, cols: int) -> torch.Tensor:
        packed = t["qweight"][rows]  # (n, cols / 2) uint8
        nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], cols)
        values = _e2m1_table(packed.device)[nibbles.long()].reshape(packed.shape[0], -1, self.group)
        scale_2 = t["scale_2"].float()  # a scalar, or one per row (`by_row`)
        scale = t["scale"][rows].float() * (scale_2[rows, None] if scale_2.dim() else scale_2)
        return (values * scale.unsqueeze(-1)).reshape(packed.shape[0], cols)

    def by_row(self, t: Tensors, rows: int) -> tuple[QuantFormat, Tensors]:
        """The per-tensor scale_2 becomes one per row."""
        return self, {**t, "scale_2": t["scale_2"].reshape(1).expand(rows).contiguous()}

    def column_group(self, cols: int) -> int:
        return self.group


# a method's name -> its class: the one place a format's name is looked up
FORMATS: dict[str, type[QuantFormat]] = {
    cls.kind: cls for cls in (GGUFFormat, MLXFormat, FP8Format, NVFP4Format)
}

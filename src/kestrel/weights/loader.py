"""Resolve a model argument (alias, .gguf file, HF folder or repo) and build the model."""

import copy
import json
import logging
import os
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from kestrel.errors import ModelLoadError
from kestrel.kernels import cpu_native
from kestrel.kernels import quant as quant_kernels
from kestrel.kernels.formats import GGUFFormat
from kestrel.models.base import CausalLM, Slot
from kestrel.models.layers.moe import Experts, PackedStack
from kestrel.models.layers.quant import DENSE_LINEARS, quantized
from kestrel.models.registry import ARCHITECTURES, model_class
from kestrel.weights import gguf as gguf_weights
from kestrel.weights import hub
from kestrel.weights import quantized as st_quant
from kestrel.weights import safetensors as st_weights
from kestrel.weights.download import cache_dir
from kestrel.weights.embedded import EMBEDDED, embedded_path

log = logging.getLogger("kestrel.weights")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: `path` is a .gguf file (a split checkpoint's first shard) or a
    Hugging Face folder."""

    name: str
    path: Path

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"


def resolve(model: str) -> ModelSource:
    """An embedded alias, a .gguf path (a split checkpoint's shard: its first), a folder with
    config.json, or a Hugging Face repo `org/repo[:QUANT]` (weights/hub.py: from the local cache,
    downloaded when missing); a clear error otherwise."""
    local = embedded_path(model)
    if local is not None:
        return ModelSource(model, local)
    path = Path(model).expanduser()
    repo = None if path.exists() else hub.parse(model)
    if repo is not None:
        return ModelSource(model, hub.resolve_repo(*repo))
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} not found: not a file, a folder, a Hugging Face repo "
            f"(org/repo[:QUANT]) or an embedded alias ({', '.join(EMBEDDED)})"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"model file {path} is not a .gguf file")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelLoadError(f"model folder {path} has no config.json")
    first = gguf_weights.first_shard(path)
    if not first.exists():
        raise ModelLoadError(
            f"model file {path} is a split GGUF shard; its first, {first}, is missing"
        )
    # absolute, links kept: a Hugging Face cache's files link to blobs without their names
    path = Path(os.path.abspath(first))
    return ModelSource(path.name, path)


def load_config(source: ModelSource):
    """transformers' config; a GGUF file's metadata is converted once and cached on disk."""
    from transformers import AutoConfig

    try:
        if not source.is_gguf:
            _import_family(source.path)
            return AutoConfig.from_pretrained(source.path)
        cached = _gguf_cache(source, "configs")
        if (cached / "config.json").exists():
            _import_family(cached)
            return AutoConfig.from_pretrained(cached)
        reader = gguf_weights.open_gguf(source.path)  # validated before transformers reads it
        family = gguf_weights.FAMILY_CONFIGS.get(gguf_weights.architecture(reader))
        if family is not None:
            config = model_class(family).config_from_gguf(gguf_weights.GGUFMetadata(reader))
        else:
            config = AutoConfig.from_pretrained(source.path.parent, gguf_file=source.path.name)
            if config.model_type in ARCHITECTURES:
                family = model_class(config.model_type)
                config = family.complete_gguf_config(config, gguf_weights.GGUFMetadata(reader))
        _save(config, cached)
        return config
    except ModelLoadError:
        raise
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"{source.path}: cannot read the model config ({e})") from e


def _import_family(folder: Path) -> None:
    """Import the family serving the folder's model_type first: a family whose checkpoints ship
    remote code (e.g. nemotron-nas) registers its config class with AutoConfig on import."""
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return  # AutoConfig reports the unreadable file
    if model_type in ARCHITECTURES:
        model_class(model_type)


def takes_images(config) -> bool:
    """Whether the checkpoint's family serves its images too (`CausalLM.multimodal`)."""
    return config.model_type in ARCHITECTURES and model_class(config.model_type).multimodal


def text_config(config):
    """Multimodal checkpoints nest the decoder's config; the text families read that one, the
    families that serve the images too the whole config."""
    if takes_images(config):
        return config
    return getattr(config, "text_config", None) or config


def load_tokenizer(source: ModelSource):
    """transformers' AutoTokenizer; a GGUF vocabulary is converted once and cached on disk."""
    from transformers import AutoTokenizer

    if not source.is_gguf:
        return AutoTokenizer.from_pretrained(source.path)
    cached = _gguf_cache(source, "tokenizers")
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    reader = gguf_weights.open_gguf(source.path)
    # AutoTokenizer reads the file's config first, which transformers cannot for the archs whose
    # config a family builds; the vocabulary itself converts without it
    if gguf_weights.architecture(reader) in gguf_weights.FAMILY_CONFIGS:
        from transformers import PreTrainedTokenizerFast as AutoTokenizer  # noqa: N814
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    _save(tokenizer, cached)
    return tokenizer


# bumped when the conversion changes, so that a cached config converted before is not reused
GGUF_CACHE_FORMAT = "v2"


def _gguf_cache(source: ModelSource, kind: str) -> Path:
    """Where the converted config/tokenizer of one GGUF file (by name, size, mtime) is kept."""
    root = cache_dir()
    stat = source.path.stat()
    return (
        root / kind / f"{source.path.stem}-{stat.st_size}-{int(stat.st_mtime)}-{GGUF_CACHE_FORMAT}"
    )


def _save(obj, folder: Path) -> None:
    try:
        obj.save_pretrained(folder)
    except OSError:
        pass  # a read-only cache only costs the conversion next time


def keep_packed(device: torch.device, dense_bytes: int) -> bool:
    """The one place that decides (by default: `--quantized-weights auto`) whether GGUF blocks
    stay quantized in memory.

    On the CPU they do wherever kestrel's native kernels load (kernels/cpu_native.py): decode
    multiplies straight from the blocks, reading a quarter to an eighth of float32's bytes, and
    prefill dequantizes tiles for the BLAS GEMM. Without them (no compiler) the packed matmul
    dequantizes in torch per call, several times slower than float32, so blocks stay packed only
    when the model dequantized (`dense_bytes`) would take more than half of the memory.

    On CUDA decode reads the blocks in Triton GEMVs (kernels/gguf_gemv.py) but larger batches
    dequantize per call, so models that fit in half the GPU stay dense for throughput;
    `--quantized-weights keep` picks the blocks' bandwidth for single streams."""
    if device.type == "cuda":
        if not torch.cuda.is_available():  # `kestrel inspect --device cuda` on a CPU machine
            return False
        return dense_bytes > torch.cuda.get_device_properties(device).total_memory // 2
    return cpu_native.available() or dense_bytes > physical_memory() // 2


def physical_memory() -> int:
    """Bytes of RAM this machine has (0 where the OS does not say: then blocks stay packed)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def _dense_bytes(tensors, dtype: torch.dtype) -> int:
    """Bytes of a GGUF's tensors dequantized to `dtype`."""
    return sum(t.n_elements for _, t in tensors) * (torch.finfo(dtype).bits // 8)


def build_model(
    config, dtype: torch.dtype, device: torch.device, empty: bool = False, mtp: bool = False
) -> CausalLM:
    """The model of `config` with random weights on `device`; with `empty`, its parameters on the
    meta device (no memory, no initialization) for `load_weights` to materialize; with `mtp`,
    its multi-token-prediction layer too (as `model.mtp`; models/layers/mtp.py)."""
    cls = model_class(config.model_type)
    if mtp:
        config = copy.copy(config)  # the caller's config stays as it was
        config.with_mtp = True
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _parameters_on_meta() if empty else nullcontext():
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


@contextmanager
def _parameters_on_meta():
    """Every parameter registered meanwhile goes to the meta device, so its initialization costs
    nothing; buffers (RoPE tables, computed from the config) stay where the model is built."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def load_weights(
    model: CausalLM,
    source: ModelSource,
    progress: bool = True,
    device: torch.device | None = None,
    packed: bool | None = None,
    skip: frozenset[str] = frozenset(),
) -> None:
    """Fill every parameter from the checkpoint, tensor by tensor, each in its final form: a
    parameter still on the meta device is materialized on `device` at its first tensor, as
    packed GGUF blocks (`packed`; default `keep_packed`), a quantized folder's tensors (MLX, FP8,
    NVFP4: kept unless `packed` is False) or a dense tensor. The parameters named in `skip` are
    not read and stay on the meta device (a pipeline stage's other layers). Fails naming any
    other parameter left unset."""
    device = device or torch.device("cpu")
    scheme = None if source.is_gguf else st_quant.read_scheme(source.path)
    if scheme is not None:
        target = _Target(model, device, packed is not False, skip)  # these: packed by default
        with _progress(source, st_weights.tensor_bytes(source.path), progress) as bar:
            _load_quantized_folder(target, source, scheme, bar)
    else:
        target = _load_file(model, source, progress, device, packed, skip)
    target.log_dense()
    _check_all_loaded(model, target.params, target.loaded() | skip, source)


def _load_file(model, source: ModelSource, progress: bool, device, packed, skip) -> "_Target":
    """A GGUF file or a float Hugging Face folder, tensor by tensor (those `skip` covers never
    read)."""
    tensors, total = _checkpoint_tensors(model, source, skip)
    if packed is None:
        packed = source.is_gguf and keep_packed(
            device, _dense_bytes(tensors, next(model.parameters()).dtype)
        )
    target = _Target(model, device, packed, skip)
    with _progress(source, total, progress) as bar, _open(source) as files:
        for name, tensor in tensors:
            if source.is_gguf:
                _load_gguf(target, files, name, tensor, source)
                bar.update(tensor.n_bytes)
            else:
                _load_dense(target, name, model.checkpoint_tensor, tensor, source)
                bar.update(tensor.numel() * tensor.element_size())
    return target


def _progress(source: ModelSource, total: int, progress: bool):
    return tqdm(
        total=total,
        desc=f"loading {source.name}",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not progress,
        leave=False,
    )


def _open(source: ModelSource):
    return gguf_weights.ShardFiles() if source.is_gguf else nullcontext()


class _Target:
    """The model's parameters as the loader fills them: meta ones are materialized once, dense
    or packed, and a tied parameter (a head sharing its embedding) is materialized for all its
    names at once."""

    def __init__(self, model: CausalLM, device: torch.device, packed: bool, skip=frozenset()):
        self.model, self.device, self.packed, self.skip = model, device, packed, skip
        self.params = dict(model.named_parameters(remove_duplicate=False))
        by_id: dict[int, list[str]] = {}
        for name, p in self.params.items():
            by_id.setdefault(id(p), []).append(name)
        self.tied = {name: by_id[id(p)] for name, p in self.params.items()}
        self.filled: dict[str, int] = {}  # parameter -> elements copied (slots may fill one)
        self.dense_log: dict[tuple[str, str], list[str]] = {}  # (type, reason) -> tensors

    def slot(self, name: str) -> Slot | None:
        target = self.model.checkpoint_name(name)
        slot = Slot(target) if isinstance(target, str) else target
        ours = slot is not None and slot.name in self.params and slot.name not in self.skip
        return slot if ours else None

    def dense(self, name: str) -> torch.Tensor:
        """The parameter's tensor, materialized (empty) on first use."""
        p = self.params[name]
        if p.is_meta:
            p = nn.Parameter(torch.empty_like(p, device=self.device), requires_grad=False)
            for alias in self.tied[name]:
                module, attr = self._owner(alias)
                setattr(module, attr, p)
                self.params[alias] = p
        return p

    def copy(self, slot: Slot, tensor: torch.Tensor, name: str, source: ModelSource) -> None:
        if slot.transpose:
            tensor = tensor.transpose(-1, -2)
        dest = slot.of(self.dense(slot.name))
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ModelLoadError(
                f"{source.path}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)} for {slot.name}"
            )
        dest.copy_(tensor)
        self.filled[slot.name] = self.filled.get(slot.name, 0) + tensor.numel()

    def pack(self, name: str, blocks: torch.Tensor, qtype, **scales) -> None:
        """Replace the Linear / Embedding owning parameter `name` (and its tied twins) with the
        quantized layer over `blocks` (and the format's `scales`)."""
        dtype = self.params[name].dtype
        blocks = blocks.to(self.device)
        scales = {role: t.to(self.device) for role, t in scales.items()}
        for alias in self.tied[name]:
            module, _ = self._owner(alias)
            parent, _, child = alias.rpartition(".")[0].rpartition(".")
            owner = self.model.get_submodule(parent) if parent else self.model
            setattr(owner, child, quantized(module, blocks, qtype, dtype, **scales))
            self.filled[alias] = self.params[alias].numel()

    def layout(self, blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, str]:
        """GGUF blocks in the layout this device's kernels read, and its name: on CUDA, Q6_K's
        padded to 224 bytes (kernels/quant.py's `ALIGNED`); the CPU reads the file's."""
        if self.device.type != "cuda":
            return blocks, qtype
        return quant_kernels.align_blocks(blocks.to(self.device), qtype)

    def resident_bytes(self, qtype: str, n_bytes: int) -> int:
        """The bytes that `n_bytes` of a file's `qtype` blocks take packed on this device."""
        if self.device.type != "cuda":
            return n_bytes
        return quant_kernels.aligned_bytes(qtype, n_bytes)

    def why_dense(self, slot: Slot, qtype: str) -> str | None:
        """None when the tensor can stay packed; else why it is dequantized at load."""
        if not self.packed:
            return f"packed weights are off ({self.device.type}, or it fits dequantized; see keep_packed)"
        if qtype not in quant_kernels.BLOCKS:
            return f"no packed kernel for {qtype}"
        return None if self.expert_stack(slot) else self.why_dense_layer(slot)

    def expert_stack(self, slot: Slot) -> bool:
        """Whether the slot is (part of) an MoE layer's stacked projection, which GGUF blocks fill
        as a `PackedStack`."""
        module, attr = self._owner(slot.name)
        stacks = ("gate_up_proj", "up_proj", "down_proj")
        return isinstance(module, Experts) and attr in stacks and not slot.transpose

    def pack_experts(self, slot: Slot, fmt, tensors: dict[str, torch.Tensor]) -> bool:
        """Put one quantized part (its format, its tensors by role) in its place in an expert
        stack, packed from its first part on. False where the stack's parts differ in format
        (llama.cpp's mixes may keep gate and up apart, MLX may override one module): the stack is
        then dense, the parts packed so far dequantized into it, and this one is for the caller
        to load dense."""
        module, attr = self._owner(slot.name)
        stack, param = getattr(module, attr), self.params[slot.name]
        fmt, tensors = fmt.by_row(tensors, slot.of(param).shape[-2])
        # int32, not uint32: CUDA cannot index uint32 tensors (MLX words)
        tensors = {r: _indexable(t) for r, t in tensors.items()}
        if isinstance(stack, PackedStack) and stack.fmt != fmt:
            self.params[slot.name] = nn.Parameter(stack[:], requires_grad=False)
            setattr(module, attr, self.params[slot.name])
            return False
        if not isinstance(stack, PackedStack):
            if not stack.is_meta:
                return False  # dense since an earlier part
            stack = self._empty_stack(param, fmt, tensors)
            delattr(module, attr)  # the meta parameter: a module takes its name
            setattr(module, attr, stack)
        for role, t in tensors.items():
            dest = getattr(stack, role)[slot.index]
            dest.copy_(t.reshape(dest.shape))
        self.filled[slot.name] = self.filled.get(slot.name, 0) + slot.of(param).numel()
        return True

    def _empty_stack(self, param: torch.Tensor, fmt, part: dict) -> PackedStack:
        """A stack for `param` (E, rows, cols) in `fmt`, each role shaped as `part`'s per row."""
        E, N, K = param.shape
        empty = {
            r: torch.empty(E, N, *t.shape[1:], dtype=t.dtype, device=self.device)
            for r, t in part.items()
        }
        return PackedStack(empty, fmt, K, param.dtype)

    def why_dense_layer(self, slot: Slot) -> str | None:
        """None when the parameter is a whole Linear's or Embedding's weight (in every tied
        place), which a quantized layer can replace; else why it must be dense."""
        if slot.index or slot.transpose or not all(map(self._packable, self.tied[slot.name])):
            return "the model reads it whole (not a linear layer's or an embedding's weight)"
        return None

    def _packable(self, name: str) -> bool:
        module, attr = self._owner(name)
        layer = name.rpartition(".")[0].rpartition(".")[2]
        kinds = (nn.Linear, nn.Embedding)
        return attr == "weight" and isinstance(module, kinds) and layer not in DENSE_LINEARS

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        path, _, attr = name.rpartition(".")
        return (self.model.get_submodule(path) if path else self.model), attr

    def note_dense(self, qtype: str, reason: str, name: str) -> None:
        self.dense_log.setdefault((qtype, reason), []).append(name)

    def log_dense(self) -> None:
        for (qtype, reason), names in self.dense_log.items():
            log.info(
                "%d %s tensors dequantized at load: %s (e.g. %s)",
                len(names),
                qtype,
                reason,
                names[0],
            )

    def loaded(self) -> set[str]:
        return {n for n, count in self.filled.items() if count >= self.params[n].numel()}


def _load_dense(target: _Target, name: str, fix, tensor: torch.Tensor, source) -> None:
    slot = target.slot(name)
    if slot is not None:
        target.copy(slot, fix(slot.name, tensor), name, source)


def _load_gguf(target: _Target, files, name: str, t, source: ModelSource) -> None:
    """One GGUF tensor: kept as its blocks where it can be, else dequantized to float."""
    slot = target.slot(name)
    if slot is None:
        return
    qtype = t.tensor_type.name
    blocks = gguf_weights.read_blocks(files, t)
    reason = target.why_dense(slot, qtype)
    rows = None if reason else _packed_rows(target.model, slot.name, blocks)
    if rows is not None:
        shape = gguf_weights.torch_shape(t)
        expected = tuple(slot.of(target.params[slot.name]).shape)
        if shape != expected:
            raise ModelLoadError(
                f"{source.path}: tensor {name} has shape {shape}, expected {expected} for {slot.name}"
            )
        rows, layout = target.layout(rows, qtype)
        if not target.expert_stack(slot):
            target.pack(slot.name, rows, layout)
            return
        if target.pack_experts(slot, GGUFFormat(layout), {"qweight": rows}):
            return
        reason = "its expert stack's parts are of different types"
    if qtype not in ("F32", "F16", "BF16"):
        target.note_dense(qtype, reason or "its family's gguf_tensor changes its values", name)
    tensor = target.model.gguf_tensor(slot.name, gguf_weights.dequantize_blocks(blocks, t))
    target.copy(slot, tensor, name, source)


def _load_quantized_folder(target: _Target, source: ModelSource, scheme, bar) -> None:
    """A quantized Hugging Face folder in checkpoint order: float tensors as `_load_dense`, each
    quantized module's tensors together (at its packed values' name), unused ones skipped."""
    with st_weights.Shards(source.path) as shards:
        modules = st_quant.quantized_modules(scheme, shards.headers)
        parts = {n for m in modules for n in scheme.tensor_names(m).values()}
        for name in shards.names():
            module = scheme.module_of(name)
            if module in modules:
                _load_quantized(target, shards, scheme, module, modules[module], source, bar)
            elif name not in parts and not st_quant.is_unused(scheme, name):
                tensor = shards.get(name)
                _load_dense(target, name, target.model.checkpoint_tensor, tensor, source)
                bar.update(tensor.numel() * tensor.element_size())


def _load_quantized(target: _Target, shards, scheme, module: str, fmt, source, bar) -> None:
    """One quantized module: kept as its checkpoint's tensors in a quantized layer where the
    model can take one (and `target.packed`), else dequantized at load with a log line. A stack
    in one tensor (mlx-lm's `switch_mlp` experts, (E, rows, ...); MLA's per-head `embed_q`) loads
    part by part."""
    names = scheme.tensor_names(module)
    tensors = {role: shards.get(n) for role, n in names.items()}
    bar.update(sum(t.numel() * t.element_size() for t in tensors.values() if t is not None))
    slot = target.slot(f"{module}.weight")
    if slot is None:
        return
    stack = tensors["qweight"]
    if stack is None or stack.dim() != 3 or slot.index[:1] != (slice(None),):
        _load_quantized_part(target, scheme, module, slot, fmt, tensors, names, source)
        return
    count = len(slot.of(target.params[slot.name]))
    if len(stack) != count:
        raise ModelLoadError(
            f"{source.path}: tensor {names['qweight']} stacks {len(stack)} parts; "
            f"{slot.name} takes {count}"
        )
    for i, part in enumerate(slot.parts(count)):
        part_tensors = {r: _part(t, i, count) for r, t in tensors.items()}
        part_names = {r: f"{n}[{i}]" for r, n in names.items()}
        _load_quantized_part(target, scheme, module, part, fmt, part_tensors, part_names, source)


def _part(t: torch.Tensor | None, i: int, count: int) -> torch.Tensor | None:
    """Part `i` of a stacked role's tensor; a role the parts share (one scale) as it is."""
    return t[i] if t is not None and t.dim() and len(t) == count else t


def _load_quantized_part(target, scheme, module, slot, fmt, tensors, names, source) -> None:
    dest = slot.of(target.params[slot.name])  # meta or materialized: only its shape is read
    shape = (*dest.shape[:-2], dest.shape[-1], dest.shape[-2]) if slot.transpose else dest.shape
    if len(shape) != 2:
        raise ModelLoadError(
            f"{source.path}: tensor {names['qweight']} is quantized but fills {slot.name} of "
            f"shape {tuple(shape)}; quantized weights must be matrices"
        )
    try:
        st_quant.check(fmt, module, tensors, names, tuple(shape))
    except ModelLoadError as e:
        raise ModelLoadError(f"{source.path}: {e}") from e
    t = st_quant.layer_tensors(scheme, fmt, tensors, tuple(shape))
    reason = target.why_dense_layer(slot) if target.packed else "packed weights are off"
    if reason is None:
        target.pack(slot.name, t.pop("qweight"), fmt, **t)
        return
    if target.packed and target.expert_stack(slot):
        if target.pack_experts(slot, fmt, t):
            return
        reason = "its expert stack's parts are of different formats"
    target.note_dense(fmt.name, reason, names["qweight"])
    weight = fmt.dequantize_rows(t, slice(None), shape[1])
    target.copy(slot, target.model.checkpoint_tensor(slot.name, weight), names["qweight"], source)


def _packed_rows(model: CausalLM, name: str, blocks: torch.Tensor) -> torch.Tensor | None:
    """`blocks` in the row order `gguf_tensor` gives `name` (llama's Q/K unpermute), found by
    passing row ids through it; None when the hook changes values, which blocks cannot take."""
    ids = torch.arange(blocks.shape[0], dtype=torch.float64).unsqueeze(1)
    out = model.gguf_tensor(name, ids)
    if out.shape != ids.shape or not torch.equal(out.sort(dim=0).values, ids):
        return None
    return blocks if torch.equal(out, ids) else blocks[out[:, 0].long()]


def checkpoint_summary(model: CausalLM, source: ModelSource, device: torch.device, dtype) -> dict:
    """For `kestrel inspect`: the checkpoint's tensors by type, and the bytes its weights take once
    loaded on `device` in `dtype` (packed GGUF blocks as they are, the rest dense). `model` may be
    on the meta device."""
    dense = torch.finfo(dtype).bits // 8
    if not source.is_gguf:
        return _folder_summary(model, source, device, dense)
    tensors = _checkpoint_tensors(model, source)[0]
    target = _Target(model, device, keep_packed(device, _dense_bytes(tensors, dtype)))
    types: dict[str, int] = {}
    resident = 0
    for name, t in tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        slot = target.slot(name)
        if slot is not None:
            qtype = t.tensor_type.name
            packed = target.why_dense(slot, qtype) is None
            resident += target.resident_bytes(qtype, t.n_bytes) if packed else t.n_elements * dense
    return {"types": types, "resident": resident}


def _folder_summary(model: CausalLM, source: ModelSource, device, dense: int) -> dict:
    """A Hugging Face folder's tensors by type (a quantized module counts once, as its format)
    and resident bytes: quantized modules as stored, the rest dense."""
    unique = {id(p): p.numel() for p in model.parameters()}
    scheme = st_quant.read_scheme(source.path)
    if scheme is None:
        return {
            "types": st_weights.tensor_dtypes(source.path),
            "resident": sum(unique.values()) * dense,
        }
    headers = st_weights.headers(source.path)
    modules = st_quant.quantized_modules(scheme, headers)
    target, types, packed = _Target(model, device, True), {}, {}
    for module, fmt in modules.items():
        names = scheme.tensor_names(module)
        types[fmt.name] = types.get(fmt.name, 0) + 1
        slot = target.slot(f"{module}.weight")
        if slot is not None and (target.why_dense_layer(slot) is None or target.expert_stack(slot)):
            key = id(target.params[slot.name])  # an expert stack's parts add up
            stored = sum(_stored_bytes(headers.get(n)) for n in names.values())
            packed[key] = packed.get(key, 0) + stored
    parts = {n for m in modules for n in scheme.tensor_names(m).values()}
    for name, entry in headers.items():
        if name not in parts and not st_quant.is_unused(scheme, name):
            types[entry["dtype"]] = types.get(entry["dtype"], 0) + 1
    resident = sum(packed.get(i, n * dense) for i, n in unique.items())
    return {"types": types, "resident": resident}


def _indexable(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.uint32 else t


def _stored_bytes(entry: dict | None) -> int:
    """Bytes of one tensor as its header says (quantized layers hold them as stored)."""
    if entry is None:
        return 0
    return entry["data_offsets"][1] - entry["data_offsets"][0]


def _checkpoint_tensors(model, source: ModelSource, skip=frozenset()):
    """(checkpoint name, tensor) pairs and their bytes: gguf's records for a GGUF file (read by
    `_load_gguf`), tensors for safetensors (those of parameters in `skip` never read)."""
    if source.is_gguf:
        reader = gguf_weights.open_gguf(source.path)
        gguf_weights.check_quant_types(reader, source.path)
        tensors = gguf_weights.read_tensors(reader, model.gguf_names)
        return tensors, sum(t.n_bytes for _, t in tensors)
    wanted = None
    if skip:
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)} - skip

        def wanted(name: str) -> bool:
            slot = model.checkpoint_name(name)
            return (slot if isinstance(slot, str) else getattr(slot, "name", None)) in params

    return st_weights.read_tensors(source.path, wanted), st_weights.tensor_bytes(source.path)


def _check_all_loaded(model, params: dict, loaded: set, source: ModelSource) -> None:
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(params) - loaded - tied)
    missing += [
        n for n, p in model.named_parameters() if p.is_meta and n not in missing and n not in loaded
    ]
    if missing and all(name.startswith("mtp.") for name in missing):
        raise ModelLoadError(
            f"{source.path}: --speculative mtp: the checkpoint has no multi-token-prediction "
            f"layer (it lacks {len(missing)} tensors, e.g. {missing[:3]})"
        )
    if missing:
        raise ModelLoadError(
            f"{source.path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = True,
    packed: bool | None = None,
    select=None,
    mtp: bool = False,
):
    """The model with its weights; `packed` as `load_weights` (default: `keep_packed`);
    `select(model)`: the names of parameters to leave unloaded, from the model built empty;
    `mtp`: with its multi-token-prediction layer (`build_model`)."""
    if mtp and source.is_gguf:
        raise ValueError(
            "--speculative mtp: the multi-token-prediction layer loads from a safetensors "
            "checkpoint; not from a GGUF file"
        )
    config = text_config(load_config(source))
    model = build_model(config, dtype, device, empty=True, mtp=mtp)
    skip = frozenset(select(model)) if select is not None else frozenset()
    load_weights(model, source, progress, device, packed, skip)
    return model


QUANTIZED_WEIGHTS = {"auto": None, "keep": True, "dequantize": False}  # -> load_weights' packed


def load(
    model: str,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = True,
    quantized_weights: str = "auto",
    select=None,
    mtp: bool = False,
):
    """(model, tokenizer, source) for a model argument; `quantized_weights` as the flag;
    `select` and `mtp` as `load_model`."""
    if quantized_weights not in QUANTIZED_WEIGHTS:
        raise ValueError(
            f"quantized_weights {quantized_weights!r}; supported: {', '.join(QUANTIZED_WEIGHTS)}"
        )
    source = resolve(model)
    packed = QUANTIZED_WEIGHTS[quantized_weights]
    model = load_model(source, dtype, device, progress, packed, select, mtp)
    return model, load_tokenizer(source), source

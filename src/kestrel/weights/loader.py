"""Resolve a model argument (alias, .gguf file, HF folder) and build the model with its weights."""

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kestrel.errors import ModelLoadError
from kestrel.models.base import CausalLM, Slot
from kestrel.models.registry import ARCHITECTURES, model_class
from kestrel.weights import gguf as gguf_weights
from kestrel.weights import safetensors as st_weights
from kestrel.weights.embedded import EMBEDDED, embedded_path


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: `path` is a .gguf file or a Hugging Face folder."""

    name: str
    path: Path

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"


def resolve(model: str) -> ModelSource:
    """An embedded alias, a .gguf path or a folder with config.json; a clear error otherwise."""
    local = embedded_path(model)
    if local is not None:
        return ModelSource(model, local)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} not found: not a file, a folder or an embedded alias "
            f"({', '.join(EMBEDDED)})"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"model file {path} is not a .gguf file")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelLoadError(f"model folder {path} has no config.json")
    return ModelSource(path.name, path.resolve())


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


def _gguf_cache(source: ModelSource, kind: str) -> Path:
    """Where the converted config/tokenizer of one GGUF file (by name, size, mtime) is kept."""
    root = Path(os.environ.get("KESTREL_CACHE_DIR", Path.home() / ".cache" / "kestrel"))
    stat = source.path.stat()
    return root / kind / f"{source.path.stem}-{stat.st_size}-{int(stat.st_mtime)}"


def _save(obj, folder: Path) -> None:
    try:
        obj.save_pretrained(folder)
    except OSError:
        pass  # a read-only cache only costs the conversion next time


def build_model(config, dtype: torch.dtype, device: torch.device) -> CausalLM:
    cls = model_class(config.model_type)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def load_weights(model: CausalLM, source: ModelSource, progress: bool = True) -> None:
    """Copy every checkpoint tensor into its parameter; fail naming any parameter left unset."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tensors, total = _checkpoint_tensors(model, source, list(params))
    filled: dict[str, int] = {}  # parameter name -> elements copied (several slots may fill one)
    for name, tensor in tqdm(
        tensors,
        total=total,
        desc=f"loading {source.name}",
        unit="tensor",
        disable=not progress,
        leave=False,
    ):
        target = model.checkpoint_name(name)
        slot = Slot(target) if isinstance(target, str) else target
        if slot is None or slot.name not in params:
            continue
        if source.is_gguf:
            tensor = model.gguf_tensor(slot.name, tensor)
        else:
            tensor = model.checkpoint_tensor(slot.name, tensor)
        if slot.transpose:
            tensor = tensor.transpose(-1, -2)
        dest = params[slot.name][slot.index]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ModelLoadError(
                f"{source.path}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)} for {slot.name}"
            )
        dest.copy_(tensor)
        filled[slot.name] = filled.get(slot.name, 0) + tensor.numel()
    loaded = {n for n, count in filled.items() if count >= params[n].numel()}
    _check_all_loaded(model, params, loaded, source)


def _checkpoint_tensors(model, source: ModelSource, names: list[str]):
    if source.is_gguf:
        reader = gguf_weights.open_gguf(source.path)
        gguf_weights.check_quant_types(reader, source.path)
        return gguf_weights.read_tensors(reader, model.gguf_names), len(reader.tensors)
    return st_weights.read_tensors(source.path), st_weights.count_tensors(source.path)


def _check_all_loaded(model, params: dict, loaded: set, source: ModelSource) -> None:
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(params) - loaded - tied)
    if missing:
        raise ModelLoadError(
            f"{source.path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device, progress=True):
    config = text_config(load_config(source))
    model = build_model(config, dtype, device)
    load_weights(model, source, progress)
    return model


def load(model: str, dtype: torch.dtype, device: torch.device, progress: bool = True):
    """(model, tokenizer, source) for a model argument."""
    source = resolve(model)
    return load_model(source, dtype, device, progress), load_tokenizer(source), source

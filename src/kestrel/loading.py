"""The device, dtype and model a Config names: below the LLM, the server's engine process, the
benchmarks and the tensor-parallel workers, which all load through here."""

from dataclasses import replace

import torch
from tqdm import tqdm

from kestrel.config import Config
from kestrel.weights.loader import QUANTIZED_WEIGHTS, load, load_weights
from kestrel.weights.shapes import fill_random, load_shape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """ "auto": float32 on the CPU (the reference path), bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(config: Config, device: torch.device, progress: bool = True, select=None):
    """(model, tokenizer, source) of `config` on `device`: the checkpoint, or random weights of
    a named shape (source None). `select(model)`: names of parameters a checkpoint's loading
    leaves on the meta device (weights.loader.load_model)."""
    dtype = resolve_dtype(config.model.dtype, device)
    mtp = config.speculation.speculative == "mtp"  # the checkpoint's MTP layer proposes
    if config.model.shape:
        return (*load_shape(config.model.shape, dtype, device, select=select, mtp=mtp), None)
    model = config.model
    return load(model.model, dtype, device, progress, model.quantized_weights, select, mtp)


def load_in_groups(config: Config, device: torch.device, groups_of, each, progress: bool = True):
    """`load_model`, one group of parameters at a time, so that only the group being loaded is
    ever whole: `groups_of(model)` (the model built empty) lists (parameter names, key) groups
    in load order; parameters in none stay on the meta device, never read (a pipeline stage's
    other layers). `each(model, key)` runs once a group is in (a tensor-parallel rank cuts it to
    its shard there). Returns what `load_model` does."""
    groups: list[tuple[set[str], object]] = []

    def first(model) -> set[str]:
        groups.extend(groups_of(model))
        every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        return every - groups[0][0]

    model, tokenizer, source = load_model(config, device, progress, first)
    each(model, groups[0][1])
    packed = QUANTIZED_WEIGHTS[config.model.quantized_weights]
    layers = tqdm(groups[1:], desc="loading layer by layer", disable=not progress, leave=False)
    for names, key in layers:
        if source is None:  # a random shape
            fill_random(model, device, names)
        else:
            every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
            load_weights(model, source, False, device, packed, frozenset(every - names))
        each(model, key)
    return model, tokenizer, source


def load_draft(config: Config, device: torch.device, tokenizer, progress: bool = True):
    """--speculative draft's model on `device` (None without it), loaded as the model is (with
    --shape, --draft-model names a shape); ValueError naming --draft-model when its vocabulary is
    not the model's (its proposals would be other tokens)."""
    spec = config.speculation
    if spec.speculative != "draft":
        return None
    shape = spec.draft_model if config.model.shape else None
    model_config = replace(config.model, model=spec.draft_model, shape=shape)
    draft, draft_tokenizer, _ = load_model(replace(config, model=model_config), device, progress)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"--draft-model {spec.draft_model}: its tokenizer's vocabulary differs from the "
            "model's; a draft must share the model's tokenizer"
        )
    return draft

"""Helpers that compare kestrel with transformers on tiny random-weight checkpoints."""

from pathlib import Path

import torch

from kestrel.cache import SequenceCache
from kestrel.models.batch import ForwardBatch
from kestrel.weights.loader import load_model, resolve


def save_tiny(model_cls, config, folder: Path, tokenizer=None, seed: int = 0) -> Path:
    """Build a transformers model from `config` with random weights and save it to `folder`."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _randomize_norms(model)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def _randomize_norms(model) -> None:
    # norms initialise to ones/zeros, which would hide a wrong (1 + w) or a missing norm
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)


def reference_logits(folder: Path, model_cls, ids: list[int]) -> torch.Tensor:
    """transformers' full-prompt forward: (len(ids), V) float32 logits."""
    model = model_cls.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def load_kestrel(folder: Path):
    return load_model(resolve(str(folder)), torch.float32, torch.device("cpu"), progress=False)


def chunked_logits(model, ids: list[int], chunk: int, max_kv_size=None, keep=0) -> torch.Tensor:
    """Prefill `ids` in chunks of `chunk` tokens; (len(ids), V) logits for every position."""
    cache = SequenceCache(model.cache_specs())
    out = []
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            piece = torch.tensor(ids[start : start + chunk])
            cache.make_room(len(piece), max_kv_size, keep)
            out.append(model(ForwardBatch.single(cache, piece)))
            cache.advance(len(piece))
    return torch.cat(out)


def decode_logits(model, ids: list[int], prefill: int) -> torch.Tensor:
    """Prefill the first `prefill` tokens at once, then feed the rest one token at a time."""
    cache = SequenceCache(model.cache_specs())
    out = []
    with torch.no_grad():
        for piece in [ids[:prefill]] + [[t] for t in ids[prefill:]]:
            out.append(model(ForwardBatch.single(cache, torch.tensor(piece))))
            cache.advance(len(piece))
    return torch.cat(out)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol=1e-4, atol=1e-4) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)

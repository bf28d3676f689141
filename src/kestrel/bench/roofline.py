"""Roofline ceilings for `kestrel bench`: what one decode step must read, over the bandwidth.

A decode step reads the weights its tokens use and their live KV. For a mixture of experts that is
not every parameter: a token reads its top-k routed experts (plus the shared ones), the attention,
one row of the embedding table and the whole head. A batch of B sequences reads the union of their
experts; with uniform routing an expert is left unread with probability (1 - k/E)^B. The vision
tower of a multimodal family runs once per image, never per decoded token.

The byte counts come from kestrel's family model (built on the meta device when only a config is
at hand), which knows its experts, shared KV layers and latent caches; a raw config does not. A
quantized layer counts the bytes it stores (its packed values and scales), not a float copy.
"""

import torch
from torch import nn

from kestrel.models.layers.moe import Experts
from kestrel.models.layers.quant import QuantEmbedding, Quantized, QuantLinear

# the reference machine's measured ceilings (DESIGN.md section 5)
H200 = dict(bandwidth=4.25e12, flops=786e12)
# submodules that decoding never reads (the Qwen-VL vision tower encodes images at prefill)
NOT_PER_TOKEN = ("visual",)


def meta_model(config, dtype):
    """kestrel's family model of `config` on the meta device: shapes only, no memory."""
    from kestrel.weights.loader import build_model

    return build_model(config, dtype, torch.device("meta"))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight, each shared (tied) one once."""
    return sum(_bytes(p) for _, p in _weights(model))


def kv_bytes_per_token(config, dtype) -> int:
    """KV bytes a token costs, from kestrel's family: it knows its caches (sliding, shared, latent,
    recurrent layers), the raw config does not."""
    return meta_model(config, dtype).kv_bytes_per_token(dtype)


def active_weight_bytes(model: nn.Module, batch: int = 1) -> float:
    """Weight bytes one decode step of `batch` sequences reads: routed experts by the expected
    share a batch touches, embedding tables by the rows it looks up, the rest whole."""
    parts = _read_fractions(model, batch)
    return sum(_bytes(p) * parts.get(name, 1.0) for name, p in _decode_parameters(model))


def active_bytes_per_token(config, dtype) -> float:
    """Weight bytes one decoded token reads, for the family of `config` (single stream)."""
    return active_weight_bytes(meta_model(config, dtype), batch=1)


def _weights(model: nn.Module):
    """(name, tensor) of every weight once: the parameters, and the stored tensors of quantized
    layers and expert stacks (buffers by role; a tied head shares its embedding's)."""
    seen = set()
    stored = (
        (f"{prefix}.{role}", getattr(m, role))
        for prefix, m in model.named_modules()
        if isinstance(m, Quantized)
        for role in m.roles
    )
    for name, t in (*model.named_parameters(), *stored):
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t


def _decode_parameters(model: nn.Module):
    for name, p in _weights(model):
        if not any(part in NOT_PER_TOKEN for part in name.split(".")):
            yield name, p


def _read_fractions(model: nn.Module, batch: int) -> dict[str, float]:
    """{parameter name: fraction of it a step reads} for the parameters read only in part."""
    heads = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    heads |= {id(m.qweight) for m in model.modules() if isinstance(m, QuantLinear)}
    parts = {}
    for prefix, module in model.named_modules():
        if isinstance(module, nn.Embedding) and id(module.weight) not in heads:
            parts[f"{prefix}.weight"] = min(batch, module.num_embeddings) / module.num_embeddings
        if isinstance(module, QuantEmbedding) and id(module.qweight) not in heads:
            share = min(batch, module.num_embeddings) / module.num_embeddings
            parts.update({f"{prefix}.{role}": share for role in module.roles})
        experts = getattr(module, "experts", None)
        if isinstance(experts, Experts):
            top_k = getattr(module, "top_k", None) or module.router.top_k
            unread = (1 - top_k / experts.num_experts) ** batch
            for name, _ in _weights(experts):
                parts[f"{prefix}.experts.{name}"] = 1 - unread
    return parts


def _bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def ceilings(args, model, kv_per_token: int, dtype, work, concurrency: int) -> dict:
    """Roofline bounds: decode is at best active weights (+ live KV) / bandwidth per step, prefill
    and big batches at best 2 * active params * tokens / FLOP rate. `model` is kestrel's family
    (a meta one will do)."""
    bw, flops = args.bandwidth, args.flops
    if not bw or not flops:
        return {}
    per_token = active_weight_bytes(model, 1)
    params = per_token / torch.finfo(dtype).bits * 8  # multiply-adds per token
    bounds = {"weight_bytes": weight_bytes(model), "active_weight_bytes": per_token}
    if work.num_requests == 1:
        step = per_token + kv_per_token * work.prompt_tokens
        return {**bounds, "ceiling_decode_tok_s": bw / step}
    p, o, n = work.prompt_tokens, work.output_tokens, work.num_requests
    time_min = 2 * params * n * p / flops
    waves = -(-n // concurrency)
    batch = min(n, concurrency)
    w = active_weight_bytes(model, batch)
    for step in range(o):
        kv = kv_per_token * batch * (p + step)
        time_min += waves * max((w + kv) / bw, 2 * params * batch / flops)
    return {**bounds, "ceiling_output_tok_s": n * o / time_min}

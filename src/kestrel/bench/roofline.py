"""Roofline ceilings for `kestrel bench`: what one decode step must read, over the bandwidth.

A decode step reads the weights its tokens use and their live KV. For a mixture of experts that is
not every parameter: a token reads its top-k routed experts (plus the shared ones), the attention,
one row of the embedding table and the whole head. A batch of B sequences reads the union of their
experts; with uniform routing an expert is left unread with probability (1 - k/E)^B. The vision
tower of a multimodal family runs once per image, never per decoded token.

The byte counts come from kestrel's family model (built on the meta device when only a config is
at hand), which knows its experts, shared KV layers and latent caches; a raw config does not. A
quantized layer counts the bytes it stores (its packed values and scales), not a float copy.

The bandwidth and FLOP rate are the card's own, measured once per process (`card_rates`): a
device-to-device `copy_` of 1 GiB counted as the bytes read plus the bytes written (2 GiB a copy,
the convention of vendors' copy figures), and a bf16 matmul of 8192 x 8192 x 8192; best of ten.
An H200 copies at about 4.25 TB/s and an H100 at about 3.0.
"""

import functools
import time

import torch
from torch import nn

from kestrel.models.layers.moe import Experts
from kestrel.models.layers.quant import QuantEmbedding, Quantized, QuantLinear

COPY_BYTES = 1 << 30  # large enough that launch latency and caches are noise on any card
MATMUL_SIZE = 8192
REPEATS = 10
# submodules that decoding never reads (the Qwen-VL vision tower encodes images at prefill)
NOT_PER_TOKEN = ("visual",)


@functools.cache
def card_rates(device: torch.device) -> dict:
    """{"bandwidth": bytes/s, "flops": FLOP/s} measured on `device` (once per process)."""
    n = MATMUL_SIZE if device.type == "cuda" else 1024  # a CPU takes seconds for one of 8192
    return {"bandwidth": copy_bandwidth(device), "flops": matmul_flops(device, n)}


def copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES) -> float:
    """Bytes read + bytes written per second by one device-to-device copy, best of REPEATS."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _best_time(functools.partial(dst.copy_, src), device)
    del src, dst
    _free(device)
    return 2 * nbytes / seconds


def matmul_flops(device: torch.device, n: int = MATMUL_SIZE, dtype=torch.bfloat16) -> float:
    """FLOP/s of one n x n x n matmul in `dtype` (2 n^3 FLOPs), best of REPEATS."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _best_time(functools.partial(torch.matmul, a, b), device)
    del a, b
    _free(device)
    return 2 * n**3 / seconds


def _best_time(op, device: torch.device) -> float:
    """The shortest of REPEATS timed calls of `op` in seconds, after two untimed ones (clocks
    ramp up); on CUDA timed by events around the kernel, not the host's clock."""
    timer = _cuda_time if device.type == "cuda" else _host_time
    for _ in range(2):
        op()
    return min(timer(op, device) for _ in range(REPEATS))


def _cuda_time(op, device: torch.device) -> float:
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        end.record()
        torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3


def _host_time(op, device: torch.device) -> float:
    start = time.perf_counter()
    op()
    return time.perf_counter() - start


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


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


# a measured rate and the ceiling it is read against, per mode
MEASURED_AGAINST = {"decode_tok_s": "ceiling_decode_tok_s", "output_tok_s": "ceiling_output_tok_s"}


def of_ceiling(numbers: dict) -> dict:
    """{"of_ceiling": measured rate / its ceiling} where a record has both (for a single stream:
    the share of the card's bandwidth its decode uses)."""
    for rate, ceiling in MEASURED_AGAINST.items():
        if numbers.get(rate) and numbers.get(ceiling):
            return {"of_ceiling": numbers[rate] / numbers[ceiling]}
    return {}

"""Helpers that compare kestrel with transformers on tiny random-weight checkpoints."""

from contextlib import contextmanager
from pathlib import Path

import torch
import transformers

from kestrel.cache.sequence import SequenceCache
from kestrel.models.batch import ForwardBatch, SeqChunk
from kestrel.weights.loader import load_model, resolve


def save_tiny(model_cls, config, folder: Path, tokenizer=None, seed: int = 0, tweak=None) -> Path:
    """Build a transformers model from `config` with random weights and save it to `folder`.
    `tweak(model)`, when given, runs before saving (e.g. to randomize a zero-initialised buffer)."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _randomize_norms(model)
    if tweak is not None:
        with torch.no_grad():
            tweak(model)
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


def tiny_llama(folder: Path):
    """A 2-layer random llama on SmolLM2's vocabulary, saved in `folder` and loaded into kestrel:
    the engine-level tests' model."""
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    return load_kestrel(save_tiny(transformers.LlamaForCausalLM, config, folder))


def load_kestrel(folder: Path):
    return load_model(resolve(str(folder)), torch.float32, torch.device("cpu"), progress=False)


def model_device(model) -> torch.device:
    return next(iter(model.state_dict().values())).device


def chunked_logits(model, ids: list[int], chunk: int, max_kv_size=None, keep=0) -> torch.Tensor:
    """Prefill `ids` in chunks of `chunk` tokens; (len(ids), V) logits for every position."""
    cache = SequenceCache(model.cache_specs())
    device = model_device(model)
    out = []
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            piece = torch.tensor(ids[start : start + chunk], device=device)
            cache.make_room(len(piece), max_kv_size, keep)
            out.append(model(ForwardBatch.single(cache, piece)))
            cache.advance(len(piece))
    return torch.cat(out)


def decode_logits(model, ids: list[int], prefill: int) -> torch.Tensor:
    """Prefill the first `prefill` tokens at once, then feed the rest one token at a time."""
    cache = SequenceCache(model.cache_specs())
    device = model_device(model)
    out = []
    with torch.no_grad():
        for piece in [ids[:prefill]] + [[t] for t in ids[prefill:]]:
            out.append(model(ForwardBatch.single(cache, torch.tensor(piece, device=device))))
            cache.advance(len(piece))
    return torch.cat(out)


def packed_logits(
    model, seqs: list[list[int]], chunks: list[int], prefill=None
) -> list[torch.Tensor]:
    """Run several sequences batched as the server does: each step packs the next `chunks[i]`
    tokens of every unfinished sequence (after a first chunk of `prefill[i]` when given) into one
    ForwardBatch, in reverse sequence order. Per sequence, (len, V) logits of every token."""
    caches = [SequenceCache(model.cache_specs()) for _ in seqs]
    done = [0] * len(seqs)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    with torch.no_grad():
        while live := [i for i in reversed(range(len(seqs))) if done[i] < len(seqs[i])]:
            sizes = {i: (prefill[i] if prefill and done[i] == 0 else chunks[i]) for i in live}
            pieces = {i: seqs[i][done[i] : done[i] + sizes[i]] for i in live}
            starts = [sum(len(pieces[j]) for j in live[:n]) for n in range(len(live))]
            batch = ForwardBatch(
                torch.tensor([t for i in live for t in pieces[i]]),
                torch.cat([torch.arange(len(pieces[i])) + caches[i].offset for i in live]),
                [SeqChunk(caches[i], s, len(pieces[i])) for i, s in zip(live, starts, strict=True)],
                torch.arange(sum(len(p) for p in pieces.values())),
            )
            logits = model(batch)
            for i, s in zip(live, starts, strict=True):
                outs[i].append(logits[s : s + len(pieces[i])])
                caches[i].advance(len(pieces[i]))
                done[i] += len(pieces[i])
    return [torch.cat(o) for o in outs]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol=1e-4, atol=1e-4) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


# outputs "differ" by more than this: 100 times assert_close's tolerance, far beyond float noise
DIFFER_BY = 1e-2


def assert_differ(actual: torch.Tensor, other: torch.Tensor, at_least: float = DIFFER_BY) -> None:
    """Some element of `actual` differs from `other`'s by more than `at_least`."""
    gap = (actual - other).abs().max().item()
    assert gap > at_least, f"outputs differ by at most {gap:.2e}, not more than {at_least:.0e}"


# --- `--max-kv-size` checks: the dense reference of docs/architecture.md §1 ---------------------


def trimmed_visibility(
    n: int, chunk: int, max_kv_size: int, keep: int = 0, window: int | None = None
) -> torch.Tensor:
    """(n, n) bool: may query i see key j when `n` tokens are prefilled in chunks of `chunk` under
    `max_kv_size` (sinks `keep`)? visible = j <= i, within `window`, and j still live when i's
    chunk ran (a sink j < keep, or j >= that chunk's live_start). The trims come from kestrel's
    own `make_room` on a layerless cache; the rule itself is written out here."""
    cache = SequenceCache([])
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    visible = (k <= q) if window is None else (k <= q) & (q - k < window)
    live = torch.zeros(n, n, dtype=torch.bool)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        cache.make_room(m, max_kv_size, keep)
        sinks = min(cache.keep, cache.live_start)
        live[start : start + m] = (k[0] < sinks) | (k[0] >= cache.live_start)
        cache.advance(m)
    return visible & live


def masked_reference_logits(folder: Path, model_cls, ids: list[int], masks) -> torch.Tensor:
    """transformers' full-prompt forward with custom dense masks: `masks` is an (n, n) bool tensor
    or {layer_type: (n, n) bool} for models with several layer types. (n, V) float32 logits."""
    model = model_cls.from_pretrained(folder, torch_dtype=torch.float32).eval()

    def additive(mask: torch.Tensor) -> torch.Tensor:
        # (1, 1, n, n) float: 0 where visible, the most negative float elsewhere
        return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)[
            None, None
        ]

    if isinstance(masks, dict):  # a None mask (e.g. for hybrids' Mamba layers) passes through
        attention_mask = {t: None if m is None else additive(m) for t, m in masks.items()}
    else:
        attention_mask = additive(masks)
    with torch.no_grad():
        return model(torch.tensor([ids]), attention_mask=attention_mask).logits[0].float()


@contextmanager
def assert_masks_match_keys():
    """Within the block, every `attend` call of kestrel's models checks that its mask is (m, L)
    with L the number of keys (and values) it was given; yields the list of (m, L) seen."""
    import sys

    from kestrel.kernels.attention import attend as original

    seen: list[tuple[int, int]] = []

    def checked(q, keys, values, mask, *args, **kwargs):
        assert keys.shape[-2] == values.shape[-2], (keys.shape, values.shape)
        assert tuple(mask.shape) == (q.shape[-2], keys.shape[-2]), (mask.shape, q.shape, keys.shape)
        seen.append(tuple(mask.shape))
        return original(q, keys, values, mask, *args, **kwargs)

    patched = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("kestrel.models") and getattr(m, "attend", None) is original
    ]
    for module in patched:
        module.attend = checked
    try:
        yield seen
    finally:
        for module in patched:
            module.attend = original

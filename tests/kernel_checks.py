"""The kernel checks the GPU and CPU tests share: paged attention over sequences with trims,
sinks and sliding windows packed as the paged runner packs them, and the fused norm /
activation / RoPE ops, each against its PyTorch reference."""

import torch

from kestrel.cache import paged
from kestrel.cache.blocks import BlockManager
from kestrel.cache.paged import BlockPool, PagedSequenceCache
from kestrel.cache.sequence import CacheSpec, KVShape
from kestrel.engine.paged_runner import Packed, PackedSeq, build_batch
from kestrel.kernels import fused
from kestrel.kernels.attention import FP8, KVStore, quantize


def random_sequences(pool: BlockPool, chunk: int, lengths=(37, 90, 70)):
    """Three sequences of `lengths` tokens: plain, trimmed with 3 sinks, and all-sliding (window
    20), each about to take `chunk` new tokens; returns the packed host lists of that chunk."""
    half = pool.num_blocks // 2  # blocks [1, half) for the full layers, the rest for the window
    full = BlockManager(half - 1, pool.block_size, first_id=1)
    window = BlockManager(pool.num_blocks - half, pool.block_size, 20, first_id=half)
    plain = PagedSequenceCache([CacheSpec("full")], full.table("plain"))
    trimmed = PagedSequenceCache([CacheSpec("full")], full.table("trimmed"))
    sliding = PagedSequenceCache([CacheSpec("sliding", 20)], window.table("sliding"))
    for cache, length in zip((plain, trimmed, sliding), lengths, strict=True):
        cache.blocks.reserve(0, length)  # as the scheduler plans them
        cache.advance(length)
    trimmed.blocks.trim_front(trimmed.offset, 51, keep=3)
    p = Packed()
    bs = pool.block_size
    for s, cache in enumerate((plain, trimmed, sliding)):
        cache.blocks.reserve(cache.offset, chunk)
        start = len(p.ids)
        p.ids += [0] * chunk
        p.positions += list(range(cache.offset, cache.offset + chunk))
        p.chunk_ends += [cache.offset + chunk - 1] * chunk
        held = dict(cache.blocks.held)
        p.slots += [held[q // bs] * bs + q % bs for q in range(cache.offset, cache.offset + chunk)]
        blocks, n_sink, main_start = cache.table()
        p.seqs.append(PackedSeq(blocks, n_sink, main_start, cache.live_start, cache.keep))
        p.tiles.append((s, start, chunk))
        p.rows.append(start + chunk - 1)
    return p


def check_paged_attention(
    kernel,
    device,
    dtype,
    chunk,
    window,
    hq=8,
    hkv=2,
    d=64,
    bs=16,
    value_dim=None,
    tile_tokens=4,
    lengths=(37, 90, 70),
    kv_dtype=None,
):
    """`kernel` equals paged_attention_torch over `random_sequences`. `value_dim`: the MLA latent
    (values are the keys' first `value_dim` dims, no V pool). `kv_dtype` FP8: the pool stores
    e4m3 with random per-head scales."""
    torch.manual_seed(chunk)
    blocks = max(40, 2 * (sum(lengths) + 3 * chunk) // bs + 8)
    pool = BlockPool([KVShape(hkv, d, value_dim)], blocks, bs, kv_dtype or dtype, device)
    for t in pool.k + pool.v:
        if t is not None:
            t.copy_(torch.randn(t.shape, device=device).to(t.dtype))
    for scale in pool.k_scale + pool.v_scale:
        if scale is not None:
            scale.uniform_(0.05, 0.5)
    p = random_sequences(pool, chunk, lengths)
    batch = build_batch(p, pool, 1 if chunk == 1 else tile_tokens, device, use_triton=True)
    q = torch.randn(len(p.ids), hq, d, device=device, dtype=dtype)
    args = (q, pool.store(0), batch.attention, d**-0.5, window, value_dim)
    expected = paged.paged_attention_torch(*args)
    actual = kernel(*args)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def check_fused(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 96, device=device, dtype=dtype)
    w = torch.randn(96, device=device, dtype=dtype)
    wide = torch.randn(5, 160, device=device, dtype=dtype)
    for unit in (False, True):
        for rows in (x, wide[:, 32:128]):  # contiguous, and a column slice of a fused GEMM
            torch.testing.assert_close(
                fused.rms_norm(rows, w, 1e-6, unit),
                fused.rms_norm_torch(rows, w, 1e-6, unit),
                rtol=1e-2,
                atol=1e-2,
            )
    branch = torch.randn(5, 96, device=device, dtype=dtype)
    for unit in (False, True):
        for scale in (1.0, 0.3):  # MiniCPM3 scales its residual branches
            stream, normed = fused.add_rms_norm(x, branch, w, 1e-6, unit, scale)
            expected = x + branch * scale if scale != 1.0 else x + branch
            # fp32: the GPU may fuse branch * scale + x into one rounding (an operand's ulp)
            exact = dict(rtol=0, atol=1e-6 if dtype == torch.float32 else 0)
            torch.testing.assert_close(stream, expected, **exact)
            expected = fused.rms_norm_torch(expected, w, 1e-6, unit)
            torch.testing.assert_close(normed, expected, rtol=1e-2, atol=1e-2)
        out = fused.rms_norm_add(branch, x, w, 1e-6, unit)  # Gemma's sandwich norms
        expected = x + fused.rms_norm_torch(branch, w, 1e-6, unit)
        torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    gate_up = torch.randn(5, 2 * 1100, device=device, dtype=dtype)
    for act in ("silu", "gelu_pytorch_tanh", "relu2"):  # CUDA: one `activate` for the three
        torch.testing.assert_close(
            fused.act_mul(gate_up, act), fused.act_mul_torch(gate_up, act), rtol=1e-2, atol=1e-2
        )
    hq, hkv, d = 6, 2, 32
    qkv = torch.randn(5, (hq + 2 * hkv) * d, device=device, dtype=dtype)
    angles = torch.rand(5, d // 2, device=device) * 10
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    q, k = fused.rope_qk(qkv, cos, sin, hq, hkv, d)
    t = qkv.shape[0]
    tol = dict(rtol=1e-2, atol=1e-2)  # one bf16 ulp where a sum cancels
    q_ref = fused.rope_torch(qkv[:, : hq * d].view(t, hq, d), cos, sin)
    k_ref = fused.rope_torch(qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d), cos, sin)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)
    caches = [torch.randn(4, 4, hkv, d, device=device, dtype=dtype) for _ in range(2)]
    store = KVStore(*caches)
    slots = torch.randperm(16, device=device)[:t]

    def assert_stored(stored_q, q, k, v, v_tol=None):
        """rope_store returned `q` and put `k` and `v` in the cache slots."""
        torch.testing.assert_close(stored_q, q, rtol=0, atol=0)
        torch.testing.assert_close(caches[0].view(16, hkv, d)[slots], k, rtol=0, atol=0)
        v_tol = v_tol or dict(rtol=0, atol=0)
        torch.testing.assert_close(caches[1].view(16, hkv, d)[slots], v, **v_tol)

    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    assert_stored(fused.rope_store(qkv, cos, sin, hq, hkv, d, store, slots), q, k, v)
    # q/k RMS-normed per head before RoPE (Qwen3, Gemma 3's (1 + w), EXAONE)
    for unit in (False, True):
        qw, kw = (torch.randn(d, device=device, dtype=dtype) for _ in range(2))
        norms = (qw, kw, 1e-6, unit)
        q, k = fused.rope_qk(qkv, cos, sin, hq, hkv, d, norms)
        q_ref = fused.rms_norm_torch(qkv[:, : hq * d].view(t, hq, d), qw, 1e-6, unit)
        k_ref = fused.rms_norm_torch(
            qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d), kw, 1e-6, unit
        )
        torch.testing.assert_close(q, fused.rope_torch(q_ref, cos, sin), **tol)
        torch.testing.assert_close(k, fused.rope_torch(k_ref, cos, sin), **tol)
        assert_stored(fused.rope_store(qkv, cos, sin, hq, hkv, d, store, slots, norms), q, k, v)
    # Gemma 4: v normed without a weight; its k-equals-v layers read v from k's raw columns
    norms = (qw, kw, 1e-6, False)
    for v_col in (None, hq * d):
        start = (hq + hkv) * d if v_col is None else v_col
        raw_v = qkv[:, start : start + hkv * d].reshape(t, hkv, d)
        v_ref = fused.rms_norm_torch(raw_v, torch.ones_like(qw), 1e-6, False)
        q3 = fused.rope_store(qkv, cos, sin, hq, hkv, d, store, slots, norms, 1e-6, v_col)
        q, k = fused.rope_qk(qkv, cos, sin, hq, hkv, d, norms)
        assert_stored(q3, q, k, v_ref, tol)
    check_fp8_store(qkv, cos, sin, hq, hkv, d, slots, norms)


def check_fp8_store(qkv, cos, sin, hq, hkv, d, slots, norms):
    """rope_store into an FP8 store puts its keys and values over their heads' scales, as
    attention.write_kv does; its first chunk (`calibrate_first`) sets the scales from them."""
    device, t = qkv.device, qkv.shape[0]
    store = KVStore(
        *(torch.zeros(4, 4, hkv, d, device=device, dtype=FP8) for _ in range(2)),
        *(torch.ones(hkv, device=device) for _ in range(2)),
    )
    q_first = fused.rope_store(qkv, cos, sin, hq, hkv, d, store, slots, norms, calibrate_first=True)
    scales = store.k_scale.clone(), store.v_scale.clone()
    assert (scales[0] != 1).all() and (scales[1] != 1).all()
    stored = [c.view(16, hkv, d)[slots].float() for c in store[:2]]
    q = fused.rope_store(qkv, cos, sin, hq, hkv, d, store, slots, norms)  # the fused kernel
    # the first chunk's q/k norms are PyTorch's, the kernel's after: an ulp apart at most
    torch.testing.assert_close(q, q_first, rtol=1e-2, atol=1e-2)
    assert torch.equal(store.k_scale, scales[0]) and torch.equal(store.v_scale, scales[1])
    _, k = fused.rope_qk(qkv, cos, sin, hq, hkv, d, norms)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    for cache, scale, new, first in zip(store[:2], scales, (k, v), stored, strict=True):
        again = cache.view(16, hkv, d)[slots].float()
        # one e4m3 step where the two roundings of a tie differ
        torch.testing.assert_close(again, first, rtol=0.13, atol=0)
        torch.testing.assert_close(again, quantize(new, scale).float(), rtol=0.13, atol=0)
        top = again.abs().amax(dim=(0, 2))  # the first chunk's largest key sits at 200 / 100
        assert top.max() <= 200 * 1.07 and top.min() >= 100 * 0.93

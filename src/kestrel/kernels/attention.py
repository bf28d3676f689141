"""Attention kernels: `attend` (dense, over the keys a cache returned, with a mask) and paged
attention over a `BlockPool`: one Triton kernel for prefill chunks, decode tokens and mixed
batches (its PyTorch fallback, the reference it is tested against, is in cache/paged.py). This
module imports nothing from kestrel: kernels are the bottom of the import graph.

The kernel runs one program per (query tile, KV head, part of its group): a tile is up to
`tile_tokens` consecutive tokens of one sequence times the query heads sharing that KV head (GQA),
so each K/V block is read once per group (wide heads split the group in parts that fit shared
memory). It walks the sequence's held blocks (sinks, then the main run), derives every key's
position from its logical block, and masks by docs/architecture.md §1: pos_k <= pos_q, inside the
window, and pos_k < keep or pos_k >= live_start. The same kernel serves MLA in latent space: one
KV head whose keys are [latent, rope key] and whose values are the latent, read once.

Decode tiles (one query token) would give a sequence only a program per KV head, a few of the
GPU's SMs walking its whole context; there the keys are split too (flash decoding): each program
walks one part of the sequence's blocks and writes its unnormalised partial softmax, and a second
kernel merges the parts.

An FP8 pool stores e4m3 keys and values with a float32 scale per layer and KV head (`KVStore`):
the kernels widen each block to the query's dtype as they read it, fold the key scale into the
scores' scale and the value scale into the output, so FP8 costs the pool half the bytes and the
kernels no extra pass.
"""

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the fallback serves
    triton = None


def attend(q, keys, values, mask, scale, softcap: float | None = None) -> torch.Tensor:
    """q: (Hq, m, D), keys/values: (Hkv, L, D), mask: (m, L) bool -> (Hq, m, Dv). GQA by repeat."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[0] != keys.shape[0]
        )
    groups = q.shape[0] // keys.shape[0]
    keys = keys.repeat_interleave(groups, 0)
    values = values.repeat_interleave(groups, 0)
    scores = (q @ keys.transpose(-1, -2)).float() * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1).to(values.dtype)) @ values


class KVStore(NamedTuple):
    """One layer's keys and values in the pool, (blocks, block_size, Hkv, D) each; `v` None: the
    values are the keys' first dims (the MLA latent). An FP8 store has (Hkv,) float32 scales: a
    stored number times its head's scale is the key or value it stands for (`v_scale` None with
    `v` None: the latent's values share the key scale)."""

    k: torch.Tensor
    v: torch.Tensor | None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# scales computed from a pool's first chunk put that chunk's largest key at 200 and largest value
# at 100 of e4m3's 448 (vLLM's constants for computed scales): later tokens may be larger
FP8_KEY_RANGE, FP8_VALUE_RANGE = 200.0, 100.0


def calibrate(store: KVStore, k, v) -> None:
    """Set an FP8 store's per-head scales from the first keys/values (T, Hkv, D) it stores."""
    for scale, new, top in ((store.k_scale, k, FP8_KEY_RANGE), (store.v_scale, v, FP8_VALUE_RANGE)):
        if scale is not None and new is not None and new.shape[0]:
            amax = new.abs().amax(dim=(0, 2)).float()
            # a head of zeros keeps a usable scale
            scale.copy_(torch.where(amax > 0, amax / top, torch.ones_like(amax)))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(T, Hkv, D) -> e4m3 with the per-head `scale` (Hkv,), saturating."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype) -> torch.Tensor:
    """(..., Hkv, D) stored numbers -> `dtype` values (a plain store's are returned as they are)."""
    if scale is None:
        return stored
    return (stored.float() * scale[:, None]).to(dtype)


def write_kv(store: KVStore, k, v, slot_mapping, calibrate_first: bool = False) -> None:
    """Store new keys/values (T, Hkv, D) at their flat slots of the store's (blocks, block_size,
    Hkv, D); `v` None with the store's: the values live inside the keys (the MLA latent). With
    `calibrate_first`, an FP8 store's scales are set from these first."""
    if calibrate_first:
        calibrate(store, k, v)
    for cache, scale, new in ((store.k, store.k_scale, k), (store.v, store.v_scale, v)):
        if cache is None:
            continue
        nb, bs, h, d = cache.shape
        new = new.to(cache.dtype) if store.k_scale is None else quantize(new, scale)
        if cache.dtype == FP8:  # index_copy_ has no FP8 kernel on the CPU: copy the bytes
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, new)


# one program's query tile and K/V sub-block stay within this many bytes per row of head dims, so
# wide heads (gemma4's 512, the MLA latent's 512 + 64) fit in shared memory with two stages
_TILE_BYTES = 32768


def tile_rows(value_dim: int, itemsize: int) -> int:
    """Query rows (tile tokens x query heads) one program holds for heads `value_dim` wide: 64,
    fewer for wide heads. The runner sizes its query tiles with it."""
    return max(16, min(64, _TILE_BYTES // (_pow2(value_dim) * itemsize)))


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def paged_attention_triton(q, store: KVStore, meta, scale, window=None, value_dim=None):
    """q: (T, Hq, D) over the pool -> (T, Hq, Dv). The store's `v` None: values are the first
    `value_dim` dims of each key (MLA in latent space: one shared KV head, D = rank + rope)."""
    k_cache, v_cache = store.k, store.v
    fp8 = store.k_scale is not None
    k_scale = store.k_scale if fp8 else q
    v_scale = k_scale if store.v_scale is None else store.v_scale
    T, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two block size >= 16, not {bs}")
    dv = value_dim or (v_cache.shape[-1] if v_cache is not None else d)
    values = k_cache if v_cache is None else v_cache
    group = hq // hkv
    dv_pad, esize = _pow2(dv), q.element_size()
    # query heads of a group per program: a tile's tokens times these fill at most tile_rows
    # decode tiles split wide groups (MLA's 20-128 heads) over several programs: one sequence's
    # decode is latency-bound, and more programs read its keys in parallel
    rows_per_program = min(tile_rows(dv, esize), 16 if meta.tile_tokens == 1 else 64)
    fit = max(1, rows_per_program // meta.tile_tokens)
    heads = min(1 << (group - 1).bit_length(), 1 << (fit.bit_length() - 1))
    splits = -(-group // heads)
    rows = max(16, meta.tile_tokens * heads)
    keys = min(bs, max(16, _TILE_BYTES // (dv_pad * esize)))  # keys per inner step
    out = q.new_empty(T, hq, dv)
    kv_splits = _kv_splits(meta, hkv * splits, q.device)
    parts = out  # (T, hq, kv_splits, dv) fp32 partial sums, and their running max and sum
    if kv_splits > 1:
        parts = torch.empty(T, hq, kv_splits, dv, dtype=torch.float32, device=q.device)
        max_sum = torch.empty(T, hq, kv_splits, 2, dtype=torch.float32, device=q.device)
    grid = (meta.tile_seq.shape[0], hkv * splits, kv_splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        values,
        parts,
        max_sum if kv_splits > 1 else parts,
        meta.positions,
        meta.tile_seq,
        meta.tile_start,
        meta.tile_len,
        meta.block_tables,
        meta.num_blocks,
        meta.n_sink,
        meta.main_start,
        meta.live_start,
        meta.keep,
        k_scale,
        v_scale,
        scale * 1.4426950408889634,
        window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        parts.stride(0),
        parts.stride(1),
        meta.block_tables.stride(0),
        GROUP=group,
        HEADS=heads,
        SPLITS=splits,
        ROWS=rows,
        BLOCK=bs,
        KEYS=keys,
        DV=dv,
        DV_PAD=dv_pad,
        TAIL=d - dv,
        TAIL_PAD=_pow2(d - dv) if d > dv else 16,
        VALUES_IN_KEYS=v_cache is None,
        HAS_WINDOW=window is not None,
        FP8=fp8,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        KV_SPLITS=kv_splits,
        num_warps=4 if rows * dv_pad <= 64 * 128 else 8,
        num_stages=2,
    )
    if kv_splits > 1:
        pow2 = triton.next_power_of_2
        _merge_splits_kernel[(T * hq,)](
            parts,
            max_sum,
            out,
            hq,
            out.stride(0),
            out.stride(1),
            kv_splits,
            pow2(kv_splits),
            dv,
            dv_pad,
        )
    return out


# decode programs per SM the key splits aim for, and the most parts one sequence's keys are cut in
_PROGRAMS_PER_SM = 2
_MAX_KV_SPLITS = 32


def _kv_splits(meta, programs_per_tile: int, device) -> int:
    """Parts each decode tile's keys are split in: enough that the batch fills the GPU twice
    over, 1 (no merge) for prefill and mixed tiles and for batches that fill it already. Fixed
    by the batch's shape, not its contexts, so a CUDA graph captures it."""
    if meta.tile_tokens != 1:
        return 1
    programs = meta.tile_seq.shape[0] * programs_per_tile
    return max(1, min(_MAX_KV_SPLITS, _PROGRAMS_PER_SM * _sm_count(device) // programs))


@functools.cache
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        Q,
        K,
        V,
        OUT,
        MAX_SUM,
        POS,
        TILE_SEQ,
        TILE_START,
        TILE_LEN,
        TABLES,
        NUM_BLOCKS,
        N_SINK,
        MAIN_START,
        LIVE_START,
        KEEP,
        K_SCALE,
        V_SCALE,
        scale_log2,
        window,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_tab,
        GROUP: tl.constexpr,
        HEADS: tl.constexpr,
        SPLITS: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        KEYS: tl.constexpr,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        TAIL: tl.constexpr,
        TAIL_PAD: tl.constexpr,
        VALUES_IN_KEYS: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        FP8: tl.constexpr,
        PREC: tl.constexpr,
        KV_SPLITS: tl.constexpr,
    ):
        # key dims: [0, DV) (also the values' dims) and a tail [DV, DV + TAIL) read by scores only
        tile = tl.program_id(0)
        kvh = tl.program_id(1) // SPLITS
        part = tl.program_id(1) % SPLITS
        seq = tl.load(TILE_SEQ + tile)
        start = tl.load(TILE_START + tile)
        n = tl.load(TILE_LEN + tile)
        r = tl.arange(0, ROWS)
        tok = r // HEADS  # row -> (token of the tile, query head of this part of the group)
        in_group = part * HEADS + r % HEADS
        head = kvh * GROUP + in_group
        row_ok = (tok < n) & (in_group < GROUP)
        d = tl.arange(0, DV_PAD)
        d_ok = d < DV
        q_row = Q + (start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
        q = tl.load(q_row + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if TAIL > 0:
            e = tl.arange(0, TAIL_PAD)
            e_ok = e < TAIL
            q_tail = tl.load(
                q_row + DV + e[None, :], mask=row_ok[:, None] & e_ok[None, :], other=0.0
            )
        if FP8:  # a key's scale joins the scores', a value's is applied to the sums at the end
            scale_log2 = scale_log2 * tl.load(K_SCALE + kvh)
        q_pos = tl.load(POS + start + tok, mask=tok < n, other=-1)
        q_first = tl.load(POS + start)
        q_last = tl.load(POS + start + tl.maximum(n - 1, 0))

        nb = tl.load(NUM_BLOCKS + seq)
        n_sink = tl.load(N_SINK + seq)
        main_start = tl.load(MAIN_START + seq)
        live_start = tl.load(LIVE_START + seq)
        keep = tl.load(KEEP + seq)
        # entries whose logical block reaches past the last query are all masked: stop before
        j_end = tl.minimum(nb, n_sink + q_last // BLOCK - main_start + 1)
        j_begin = 0
        if HAS_WINDOW:  # blocks wholly behind the first query's window are masked too
            lo = tl.maximum(q_first - window + 1, 0) // BLOCK
            j_begin = tl.where(lo < n_sink, lo, n_sink + tl.maximum(lo - main_start, 0))
        j_end = tl.where(n > 0, j_end, 0)
        steps_per_block = BLOCK // KEYS
        s_begin = j_begin * steps_per_block
        s_end = tl.maximum(j_end * steps_per_block, s_begin)
        if KV_SPLITS > 1:  # this program's part of the steps
            per_part = tl.cdiv(s_end - s_begin, KV_SPLITS)
            s_begin += tl.program_id(2) * per_part
            s_end = tl.minimum(s_end, s_begin + per_part)

        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DV_PAD], tl.float32)
        kt = tl.arange(0, KEYS)
        for step in range(s_begin, s_end):
            j = step // steps_per_block
            slot = (step % steps_per_block) * KEYS + kt  # slots of block j this step reads
            logical = tl.where(j < n_sink, j, main_start + j - n_sink)
            phys = tl.load(TABLES + seq * stride_tab + j).to(tl.int64)
            k_row = K + phys * stride_kb + slot[:, None] * stride_kt + kvh * stride_kh
            k = tl.load(k_row + d[None, :], mask=d_ok[None, :], other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)  # (ROWS, KEYS)
            if TAIL > 0:
                k_tail = tl.load(k_row + DV + e[None, :], mask=e_ok[None, :], other=0.0)
                k_tail = k_tail.to(q.dtype)
                s += tl.dot(q_tail, tl.trans(k_tail), input_precision=PREC)
            s = s * scale_log2
            k_pos = logical * BLOCK + slot
            live = (k_pos < keep) | (k_pos >= live_start)
            vis = (k_pos[None, :] <= q_pos[:, None]) & live[None, :]
            if HAS_WINDOW:
                vis = vis & (q_pos[:, None] - k_pos[None, :] < window)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if VALUES_IN_KEYS:
                v = k
            else:
                v_row = V + phys * stride_vb + slot[:, None] * stride_vt + kvh * stride_vh
                v = tl.load(v_row + d[None, :], mask=d_ok[None, :], other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        if FP8:
            acc = acc * tl.load(V_SCALE + kvh)
        o_ptr = OUT + (start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
        if KV_SPLITS > 1:  # OUT is (T, Hq, KV_SPLITS, DV): the part's sums, merged later
            # a padding tile (n = 0) writes its empty part too, so the merge reads no garbage
            row_ok = (tok < tl.maximum(n, 1)) & (in_group < GROUP)
            o_ptr += tl.program_id(2) * DV
            row = (start + tok) * (stride_ot // stride_oh) + head  # token * Hq + head
            ms_ptr = MAX_SUM + (row * KV_SPLITS + tl.program_id(2)) * 2
            tl.store(ms_ptr, m_i, mask=row_ok)
            tl.store(ms_ptr + 1, l_i, mask=row_ok)
            tl.store(o_ptr + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(
                o_ptr + d[None, :],
                out.to(OUT.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )

    @triton.jit
    def _merge_splits_kernel(
        PARTS,
        MAX_SUM,
        OUT,
        hq,
        stride_ot,
        stride_oh,
        KV_SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
    ):
        # one (token, head): rescale each part's sums to the largest running max, add, normalise
        row = tl.program_id(0)
        p = tl.arange(0, SPLITS_PAD)
        p_ok = p < KV_SPLITS
        m = tl.load(MAX_SUM + (row * KV_SPLITS + p) * 2, mask=p_ok, other=float("-inf"))
        sums = tl.load(MAX_SUM + (row * KV_SPLITS + p) * 2 + 1, mask=p_ok, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty parts weigh 0
        total = tl.sum(w * sums, 0)
        d = tl.arange(0, DV_PAD)
        d_ok = d < DV
        part = tl.load(
            PARTS + (row * KV_SPLITS + p)[:, None] * DV + d[None, :],
            mask=p_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        o_ptr = OUT + (row // hq) * stride_ot + (row % hq) * stride_oh + d
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=d_ok)

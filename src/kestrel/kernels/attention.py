"""Attention kernels: `attend` (dense, over the keys a cache returned, with a mask) and paged
attention over a `BlockPool`: one Triton kernel for prefill chunks, decode tokens and mixed
batches (its PyTorch fallback, the reference it is tested against, is in cache/paged.py). This
module imports nothing from kestrel: kernels are the bottom of the import graph.

The kernel runs one program per (query tile, KV head): a tile is up to `tile_tokens` consecutive
tokens of one sequence times the query heads sharing that KV head (GQA), so each K/V block is read
once per group. It walks the sequence's held blocks (sinks, then the main run), derives every key's
position from its logical block, and masks with DESIGN.md's rule: pos_k <= pos_q, inside the
window, and pos_k < keep or pos_k >= live_start.
"""

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


def write_kv(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Store new keys/values (T, Hkv, D) at their flat slots of (blocks, block_size, Hkv, D)."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention_triton(q, k_cache, v_cache, meta, scale, window=None) -> torch.Tensor:
    T, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two block size >= 16, not {bs}")
    group = hq // hkv
    group_pad = triton.next_power_of_2(group)
    tile_tokens = meta.tile_tokens
    rows = max(16, tile_tokens * group_pad)
    out = torch.empty_like(q)
    grid = (meta.tile_seq.shape[0], hkv)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
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
        scale * 1.4426950408889634,
        window or 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        ROWS=rows,
        BLOCK=bs,
        D=d,
        D_PAD=max(16, triton.next_power_of_2(d)),
        HAS_WINDOW=window is not None,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if rows * d <= 64 * 128 else 8,
        num_stages=2,
    )
    return out


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        Q,
        K,
        V,
        OUT,
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
        scale_log2,
        window,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_ot,
        stride_oh,
        stride_tab,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        PREC: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = tl.load(TILE_SEQ + tile)
        start = tl.load(TILE_START + tile)
        n = tl.load(TILE_LEN + tile)
        r = tl.arange(0, ROWS)
        tok = r // GROUP_PAD  # row -> (token of the tile, query head of the group)
        head = kvh * GROUP + r % GROUP_PAD
        row_ok = (tok < n) & (r % GROUP_PAD < GROUP)
        d = tl.arange(0, D_PAD)
        d_ok = d < D
        q_ptr = Q + (start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
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

        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D_PAD], tl.float32)
        kt = tl.arange(0, BLOCK)
        for j in range(j_begin, j_end):
            logical = tl.where(j < n_sink, j, main_start + j - n_sink)
            phys = tl.load(TABLES + seq * stride_tab + j).to(tl.int64)
            kv_off = phys * stride_kb + kt[:, None] * stride_kt + kvh * stride_kh + d[None, :]
            k = tl.load(K + kv_off, mask=d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2  # (ROWS, BLOCK)
            k_pos = logical * BLOCK + kt
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
            v = tl.load(V + kv_off, mask=d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptr = OUT + (start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

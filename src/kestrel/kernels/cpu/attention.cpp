// Paged attention on the CPU: queries attend their sequence's keys in the block pool where they
// lie, masked (docs/architecture.md §1) from each key's position (pos_k <= pos_q, inside the
// window, pos_k < keep or pos_k >= live_start), GQA without repeating keys. The same arithmetic as
// cache/paged.py's paged_attention_torch, its reference; built by kernels/cpu_native.py.
//
// One work item is (query tile, KV head, up to 16 of the tile's tokens): the query rows of those
// tokens times the heads sharing the KV head. It walks the sequence's keys 16 at a time: the
// keys transposed (D, 16) give 16 scores per query row in D broadcast FMAs, an online softmax
// rescales each row at most once per 16 keys, and the values are read once for every row. Where
// the items are fewer than twice the threads (a decode step over few KV heads) each item's keys
// are split in parts, computed apart and merged (flash-decoding's split).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace kestrel_cpu {
namespace {

constexpr int KEYS = 16;    // keys scored at once (one vector of scores per query row)
constexpr int TOKENS = 16;  // query tokens per work item
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Sequence {  // one sequence's held blocks and the mask rule's inputs
  const int64_t* blocks;
  int64_t num_blocks, n_sink, main_start, live_start, keep;
  int64_t position(int64_t key, int64_t bs) const {  // key: index into the held slots
    const int64_t j = key / bs;
    return (j < n_sink ? j : main_start + j - n_sink) * bs + key % bs;
  }
  int64_t slot(int64_t key, int64_t bs) const { return blocks[key / bs] * bs + key % bs; }
  bool live(int64_t pos) const { return pos < keep || pos >= live_start; }
};

struct Shapes {
  int64_t bs, hq, hkv, d, dv, v_head, k_row, v_row;  // *_row: elements from one slot to the next
  int64_t group() const { return hq / hkv; }
};

// n values at p as floats: p itself for float32, else converted into `buf`
template <class T>
inline const float* floats_at(const T* p, int64_t n, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return p;
  } else {
    to_floats(p, n, buf);
    return buf;
  }
}

// The sums of 16 vectors' lanes as one vector (lane t: the sum of v[t]), in a tree of 15
// two-vector shuffles and adds rather than 16 horizontal sums stored lane by lane; clobbers v
[[gnu::always_inline]] inline f32x16 sums16(f32x16* v) {
  for (int j = 0; j < 8; ++j)  // [v(2j) 8 partial sums | v(2j+1) 8]
    v[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)  // 4 vectors' 4 partial sums each
    v[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                   22, 23, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)  // 8 vectors' 2 partial sums each
    v[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                   22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// Scores of every query row against 16 keys: few rows (decode) take a dot product per key; many
// rows (prefill) transpose the keys once into (D, 16) and get 16 scores in D broadcast FMAs
template <class T>
void score(const float* qf, int64_t R, int64_t D, const T* const* keys, const bool* cand,
           float* kt, float* buf, f32x16* s) {
  constexpr int64_t TRANSPOSE_ROWS = 8;
  const int64_t Dv = D / 16 * 16;
  if (R < TRANSPOSE_ROWS && D % 16 == 0) {  // 16 keys' products at once, summed together
    const float* k[KEYS];  // every key's row, seen or not (its score is masked after)
    for (int t = 0; t < KEYS; ++t) k[t] = floats_at(keys[t], D, kt + t * D);
    for (int64_t r = 0; r < R; ++r) {
      f32x16 products[KEYS] = {};
      for (int64_t i = 0; i < D; i += 16) {
        const f32x16 x = load<f32x16>(qf + r * D + i);
        for (int t = 0; t < KEYS; ++t) products[t] += x * load<f32x16>(k[t] + i);
      }
      s[r] = sums16(products);
    }
    return;
  }
  if (R < TRANSPOSE_ROWS) {
    for (int64_t r = 0; r < R; ++r) s[r] = f32x16{};
    for (int t = 0; t < KEYS; ++t) {
      if (!cand[t]) continue;
      const float* k = floats_at(keys[t], D, buf);
      for (int64_t r = 0; r < R; ++r) {
        const float* qr = qf + r * D;
        f32x16 v = {};
        for (int64_t i = 0; i < Dv; i += 16) v += load<f32x16>(qr + i) * load<f32x16>(k + i);
        float dot = hsum(v);
        for (int64_t i = Dv; i < D; ++i) dot += qr[i] * k[i];
        s[r][t] = dot;
      }
    }
    return;
  }
  for (int t = 0; t < KEYS; ++t) {
    const float* k = cand[t] ? floats_at(keys[t], D, buf) : nullptr;
    for (int64_t i = 0; i < D; ++i) kt[i * KEYS + t] = k ? k[i] : 0.f;
  }
  for (int64_t r = 0; r < R; ++r) {
    f32x16 v = {};
    for (int64_t i = 0; i < D; ++i) v += qf[r * D + i] * load<f32x16>(kt + i * KEYS);
    s[r] = v;
  }
}

// acc's rows (Rp of them, a multiple of VALUE_ROWS) += their probabilities `p` times 16 value
// rows (null: a key no row sees), VALUE_ROWS query rows at a time with their sums held in
// registers across the 16 keys (a sum stored and reloaded per key waits on the store)
constexpr int64_t VALUE_ROWS = 4;
inline void add_values(const f32x16* p, int64_t Rp, const float* const* v, float* acc,
                       int64_t Dv, int64_t Dp) {
  const int64_t whole = Dv / 16 * 16;
  for (int64_t r0 = 0; r0 < Rp; r0 += VALUE_ROWS) {
    float* a0 = acc + r0 * Dp;
    for (int64_t i = 0; i < whole; i += 16) {
      f32x16 a[VALUE_ROWS];
      for (int j = 0; j < VALUE_ROWS; ++j) a[j] = load<f32x16>(a0 + j * Dp + i);
      for (int t = 0; t < KEYS; ++t) {
        if (!v[t]) continue;
        const f32x16 x = load<f32x16>(v[t] + i);
        for (int j = 0; j < VALUE_ROWS; ++j) a[j] += p[r0 + j][t] * x;
      }
      for (int j = 0; j < VALUE_ROWS; ++j) store(a0 + j * Dp + i, a[j]);
    }
    for (int64_t i = whole; i < Dv; ++i)  // the last values of a row not whole vectors long
      for (int t = 0; t < KEYS; ++t)
        if (v[t])
          for (int j = 0; j < VALUE_ROWS; ++j) a0[j * Dp + i] += p[r0 + j][t] * v[t][i];
  }
}

// A part of one item's keys, when an item's keys are split among threads: the rows'
// unnormalized sums and their softmax maximum and denominator, merged after (`merge_parts`)
struct Part {
  float* acc;  // (rows, Dv)
  float* m;    // (rows)
  float* l;    // (rows)
};

// One work item over the keys [k_lo, k_hi) of its sequence's held slots: into `out` normalized,
// or, where `part` is given, as a part to merge
template <class T>
void attend_item(const T* q, const T* k_cache, const T* v_cache, T* out, const Shapes& sh,
                 const Sequence& seq, const int64_t* positions, int64_t first, int64_t tokens,
                 int64_t head, float scale, int64_t window, int64_t k_lo, int64_t k_hi,
                 const Part* part) {
  const int64_t G = sh.group(), R = tokens * G, D = sh.d, Dv = sh.dv;
  const int64_t Dp = (Dv + 15) / 16 * 16;  // accumulator rows padded to whole vectors
  const int64_t Rp = (R + VALUE_ROWS - 1) / VALUE_ROWS * VALUE_ROWS;  // rows past R: zeros
  std::vector<float> qf(R * D), acc(Rp * Dp, 0.f), kt(D * KEYS), buf(D), vbuf(KEYS * Dp);
  std::vector<float> m(R, NEG_INF), l(R, 0.f);
  std::vector<f32x16> s(Rp);
  std::vector<int32_t> qpos(R);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      to_floats(q + ((first + t) * sh.hq + head * G + g) * D, D, &qf[r * D]);
      for (int64_t i = 0; i < D; ++i) qf[r * D + i] *= scale;
      qpos[r] = int32_t(positions[first + t]);
    }
  int32_t lo = qpos[0], hi = qpos[0];
  for (int32_t p : qpos) lo = std::min(lo, p), hi = std::max(hi, p);
  const int64_t n_keys = std::min(seq.num_blocks * sh.bs, k_hi);
  const T* keys[KEYS];
  const T* values[KEYS];
  bool cand[KEYS];
  i32x16 pk, live;
  for (int64_t k0 = k_lo; k0 < n_keys; k0 += KEYS) {
    bool any = false;
    // the group's first key's block; its keys lie in one block unless the block size is not a
    // multiple of 16 (then each key finds its own)
    const int64_t in_block = k0 % sh.bs;
    const bool one_block = in_block + KEYS <= sh.bs;
    const int64_t first_pos = seq.position(k0, sh.bs), first_slot = seq.slot(k0, sh.bs);
    for (int t = 0; t < KEYS; ++t) {  // keys some row of the item may see
      const int64_t key = k0 + t;
      const bool held = key < n_keys;
      pk[t] = !held ? 0 : int32_t(one_block ? first_pos + t : seq.position(key, sh.bs));
      cand[t] = held && seq.live(pk[t]) && pk[t] <= hi && (!window || lo - pk[t] < window);
      live[t] = cand[t] ? -1 : 0;
      any |= cand[t];
      const int64_t slot = !cand[t] ? 0 : (one_block ? first_slot + t : seq.slot(key, sh.bs));
      keys[t] = k_cache + slot * sh.k_row + head * D;
      values[t] = v_cache + slot * sh.v_row + head * sh.v_head;
    }
    if (!any) continue;
    score(qf.data(), R, D, keys, cand, kt.data(), buf.data(), s.data());
    for (int64_t r = 0; r < R; ++r) {
      i32x16 seen = live & (pk <= qpos[r]);
      if (window) seen &= (qpos[r] - pk) < int32_t(window);
      const f32x16 sr = seen ? s[r] : NEG_INF;
      const float best = hmax(sr);
      if (best == NEG_INF) {  // none of these keys visible to this row
        s[r] = f32x16{};
        continue;
      }
      float* a = &acc[r * Dp];
      if (best > m[r]) {  // a new maximum: rescale what the row has summed so far
        const float correction = std::exp(m[r] - best);
        l[r] *= correction;
        for (int64_t i = 0; i < Dp; i += 16) store(a + i, load<f32x16>(a + i) * correction);
        m[r] = best;
      }
      s[r] = exp16(sr - m[r]);  // the row's probabilities (unnormalized)
      l[r] += hsum(s[r]);
    }
    const float* v[KEYS];  // the value rows as floats (other dtypes converted once), or null
    for (int t = 0; t < KEYS; ++t) v[t] = cand[t] ? floats_at(values[t], Dv, &vbuf[t * Dp]) : nullptr;
    add_values(s.data(), Rp, v, acc.data(), Dv, Dp);
  }
  if (part != nullptr) {
    for (int64_t r = 0; r < R; ++r) {
      std::copy_n(&acc[r * Dp], Dv, part->acc + r * Dv);
      part->m[r] = m[r], part->l[r] = l[r];
    }
    return;
  }
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      const float inv = l[r] > 0 ? 1.f / l[r] : 0.f;  // a row that sees no key gives zeros
      T* o = out + ((first + t) * sh.hq + head * G + g) * Dv;
      for (int64_t i = 0; i < Dv; ++i) o[i] = T(acc[r * Dp + i] * inv);
    }
}

// The parts of one item into `out`: each row's sums rescaled to the largest maximum, then
// divided by the rescaled denominators (a row that sees no key gives zeros)
template <class T>
void merge_parts(const std::vector<Part>& parts, T* out, const Shapes& sh, int64_t first,
                 int64_t tokens, int64_t head) {
  const int64_t G = sh.group(), Dv = sh.dv;
  std::vector<float> sum(Dv);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = t * G + g;
      float best = NEG_INF, l = 0.f;
      for (const Part& p : parts) best = std::max(best, p.m[r]);
      std::fill(sum.begin(), sum.end(), 0.f);
      for (const Part& p : parts) {
        if (p.m[r] == NEG_INF) continue;
        const float w = std::exp(p.m[r] - best);
        l += w * p.l[r];
        for (int64_t i = 0; i < Dv; ++i) sum[i] += w * p.acc[r * Dv + i];
      }
      const float inv = l > 0 ? 1.f / l : 0.f;
      T* o = out + ((first + t) * sh.hq + head * G + g) * Dv;
      for (int64_t i = 0; i < Dv; ++i) o[i] = T(sum[i] * inv);
    }
}

// q (T, Hq, D), k_cache (blocks, block_size, Hkv, D), v_cache the same with Dv, or undefined: the
// values are the keys' first `value_dim` dims (the MLA latent). Per tile and per sequence, the
// metadata of cache/paged.py's PagedAttention (int64). window 0: none. -> (T, Hq, Dv)
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                           const c10::optional<at::Tensor>& v_cache, int64_t value_dim,
                           const at::Tensor& positions, const at::Tensor& tile_seq,
                           const at::Tensor& tile_start, const at::Tensor& tile_len,
                           const at::Tensor& block_tables, const at::Tensor& num_blocks,
                           const at::Tensor& n_sink, const at::Tensor& main_start,
                           const at::Tensor& live_start, const at::Tensor& keep, double scale,
                           int64_t window) {
  const at::Tensor q = q_in.contiguous();
  const bool has_v = v_cache.has_value() && v_cache->defined();
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.is_contiguous(),
              "q must be (T, Hq, D) and k_cache (blocks, block_size, Hkv, D)");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "q and the cache must share a dtype");
  const at::Tensor v = has_v ? *v_cache : k_cache;
  TORCH_CHECK(v.is_contiguous() && v.scalar_type() == q.scalar_type(), "bad v_cache");
  for (const at::Tensor* t : {&positions, &tile_seq, &tile_start, &tile_len, &block_tables,
                              &num_blocks, &n_sink, &main_start, &live_start, &keep})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "metadata must be int64");
  Shapes sh{k_cache.size(1), q.size(1), k_cache.size(2), k_cache.size(3),
            has_v ? v.size(3) : value_dim, v.size(3), k_cache.size(2) * k_cache.size(3),
            v.size(2) * v.size(3)};
  TORCH_CHECK(sh.hq % sh.hkv == 0 && q.size(2) == sh.d && sh.dv > 0 && sh.dv <= v.size(3),
              "head shapes do not match");
  at::Tensor out = at::empty({q.size(0), sh.hq, sh.dv}, q.options());
  const int64_t* seqs = tile_seq.data_ptr<int64_t>();
  const int64_t* starts = tile_start.data_ptr<int64_t>();
  const int64_t* lens = tile_len.data_ptr<int64_t>();
  std::vector<std::array<int64_t, 4>> items;  // (sequence, first token, tokens, KV head)
  for (int64_t i = 0; i < tile_seq.numel(); ++i)
    for (int64_t t = 0; t < lens[i]; t += TOKENS)
      for (int64_t h = 0; h < sh.hkv; ++h)
        items.push_back({seqs[i], starts[i] + t, std::min<int64_t>(TOKENS, lens[i] - t), h});
  const int64_t width = block_tables.size(1);
  const int64_t* held = num_blocks.data_ptr<int64_t>();
  // Fewer items than twice the threads (one decode step over few KV heads: gemma3-270m has
  // one) leaves threads idle: each item's keys are then split in up to `splits` parts of at
  // least SPLIT_KEYS, computed apart and merged
  constexpr int64_t SPLIT_KEYS = 128;
  const int64_t threads = at::get_num_threads(), n_items = int64_t(items.size());
  const int64_t splits = n_items >= 2 * threads ? 1 : (2 * threads + n_items - 1) / n_items;
  std::vector<std::array<int64_t, 3>> work;  // (item, first key, last key + 1)
  for (int64_t w = 0; w < n_items; ++w) {
    const int64_t n_keys = held[items[w][0]] * sh.bs;
    const int64_t parts = std::max<int64_t>(1, std::min(splits, n_keys / SPLIT_KEYS));
    const int64_t step = std::max<int64_t>(KEYS, (n_keys / parts + KEYS - 1) / KEYS * KEYS);
    for (int64_t k = 0; k < std::max<int64_t>(n_keys, 1); k += step)  // whole groups of keys
      work.push_back({w, k, k + step});
  }
  const bool split = int64_t(work.size()) > n_items;
  const int64_t rows = TOKENS * sh.group();
  std::vector<float> part_acc(split ? work.size() * rows * sh.dv : 0);
  std::vector<float> part_m(split ? work.size() * rows : 0), part_l(part_m.size());
  std::vector<Part> parts(split ? work.size() : 0);
  for (size_t i = 0; i < parts.size(); ++i)
    parts[i] = {&part_acc[i * rows * sh.dv], &part_m[i * rows], &part_l[i * rows]};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    at::parallel_for(0, int64_t(work.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t w = begin; w < end; ++w) {
        const auto [item, k_lo, k_hi] = work[w];
        const auto [s, first, tokens, head] = items[item];
        const Sequence seq{block_tables.data_ptr<int64_t>() + s * width, held[s],
                           n_sink.data_ptr<int64_t>()[s], main_start.data_ptr<int64_t>()[s],
                           live_start.data_ptr<int64_t>()[s], keep.data_ptr<int64_t>()[s]};
        attend_item<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                              v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), sh, seq,
                              positions.data_ptr<int64_t>(), first, tokens, head, float(scale),
                              window, k_lo, k_hi, split ? &parts[w] : nullptr);
      }
    });
    if (!split) return;
    for (size_t w = 0; w < work.size();) {  // each item's parts, in order
      size_t next = w;
      while (next < work.size() && work[next][0] == work[w][0]) ++next;
      const auto [s, first, tokens, head] = items[work[w][0]];
      merge_parts<scalar_t>({parts.begin() + w, parts.begin() + next},
                            out.data_ptr<scalar_t>(), sh, first, tokens, head);
      w = next;
    }
  });
  return out;
}

}  // namespace
}  // namespace kestrel_cpu

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor? v_cache, int value_dim, "
      "Tensor positions, Tensor tile_seq, Tensor tile_start, Tensor tile_len, "
      "Tensor block_tables, Tensor num_blocks, Tensor n_sink, Tensor main_start, "
      "Tensor live_start, Tensor keep, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) { m.impl("paged_attention", kestrel_cpu::paged_attention); }

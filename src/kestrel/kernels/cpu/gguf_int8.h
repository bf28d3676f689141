// x @ W.T for decode's few rows of x with x quantized to int8, as llama.cpp multiplies: each
// block of 32 activations becomes one float scale d = max|x| / 127 and 32 int8 values, and W's
// blocks (gguf_blocks.h's `decode8`: unsigned bytes with a scale and a bias per group) meet them
// in integer dot products of four byte pairs per 32-bit lane (AVX-512 VNNI's vpdpbusd, AVX-VNNI's
// 256-bit one; plain C++ elsewhere, correct but slow, so kernels/cpu_native.py chooses this path
// only where the instruction exists). A group g of W's row contributes
//     s_g * d_g * sum(q_w * q_x) + b_g * d_g * sum(q_x),
// the first per 4-element lane (the group's scale spread over its lanes), the second from the
// per-group sums of x computed once per call. The float path (gguf.cpp) stays as the exact one.
#pragma once

#include <ATen/Parallel.h>

#include <cmath>

#include "gguf_blocks.h"

namespace kestrel_cpu {
namespace {

// the int8 dot-product instruction this build has, by its width (0: none; plain C++, slow)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KESTREL_INT8_DOT 512
#elif defined(__AVXVNNI__)
#define KESTREL_INT8_DOT 256
#else
#define KESTREL_INT8_DOT 0
#endif
constexpr bool FAST_INT8_DOT = KESTREL_INT8_DOT != 0;

// 16 lanes, each the sum of four products of an unsigned byte of w and a signed one of x
inline i32x16 dot4(u8x64 w, i8x64 x) {
#if KESTREL_INT8_DOT == 512
  return i32x16(_mm512_dpbusd_epi32(_mm512_setzero_si512(), __m512i(w), __m512i(x)));
#elif KESTREL_INT8_DOT == 256
  __m256i w2[2], x2[2], out[2];
  std::memcpy(w2, &w, 64), std::memcpy(x2, &x, 64);
  for (int h = 0; h < 2; ++h) out[h] = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w2[h], x2[h]);
  return load<i32x16>(out);
#else
  i32x16 sums;
  for (int l = 0; l < 16; ++l) {
    int32_t sum = 0;
    for (int k = 0; k < 4; ++k) sum += int32_t(w[4 * l + k]) * int32_t(x[4 * l + k]);
    sums[l] = sum;
  }
  return sums;
#endif
}

template <class T>
constexpr int group_of() {
  if constexpr (T::elements == 32)
    return 32;
  else
    return T::group;
}

constexpr bool GATHER_SCALES =
#if defined(__AVX512F__) && defined(__AVX512VL__)
    true;
#else
    false;
#endif

// The scales and biases of `Blocks` (at most eight) 32-element blocks at p in lanes 0-7 (the
// rest 0): the half floats at each block's start gathered in one instruction and converted in
// one. Sixteen scalar conversions stored to an array and loaded back as vectors cost more than
// the dot products (a 168 MB Q4_1 matrix on 2 cores: 11.5 GB/s two blocks a step, 18 eight a
// step with the gather)
template <class T, int Blocks>
inline void gathered_scales(const uint8_t* p, f32x16& s, f32x16& b) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
  const __m256i starts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i offsets = _mm256_mullo_epi32(starts, _mm256_set1_epi32(T::bytes));
  const __m256i words = _mm256_mmask_i32gather_epi32(  // no read past the unit's last block
      _mm256_setzero_si256(), (1 << Blocks) - 1, offsets, p, 1);
  const auto halves = [](__m256i w) {  // the low half float of each 32-bit word, as 16 lanes
    return f32x16(_mm512_zextps256_ps512(_mm256_cvtph_ps(_mm256_cvtepi32_epi16(w))));
  };
  s = halves(words);
  if constexpr (T::bias)
    b = halves(_mm256_srli_epi32(words, 16));  // the min follows the scale
  else
    b = s * T::offset;
#endif
}

// What one step of the kernel decodes: 256 elements of a k-quant, or `Blocks` 32-element blocks
// (eight: 256 elements, four vectors of bytes, as a k-quant; two for a row's last 64 when its
// length is not a multiple of 256), with a scale and a bias per group of `group` elements: eight
// blocks a step share one conversion of their scales and one product with x's. `order`: the
// unit's vectors hold its blocks of 32 elements in this order (64 bytes of a k-quant hold four
// sub-blocks, two in the low nibbles and two in the high ones); x is laid out alike, so a vector
// of nibbles needs no shuffle.
template <class T, int Blocks = (T::elements == 32 ? 8 : 1)>
struct Unit {
  static constexpr bool small = T::elements == 32;  // blocks of 32 elements, several a unit
  static constexpr int elements = Blocks * T::elements, bytes = Blocks * T::bytes;
  static constexpr int group = group_of<T>(), groups = elements / group;

  static constexpr int order(int k) {
    if constexpr (small)
      return k;
    else
      return T::order[k];
  }

  static void decode(const uint8_t* p, u8x64* q, f32x16& s, f32x16& b) {
    if constexpr (small) {
      float s8[16] = {}, b8[16] = {};
      for (int k = 0; k < Blocks; k += 2) {
        u8x32 first, second;
        T::decode8(p + k * T::bytes, first, s8[k], b8[k]);
        T::decode8(p + (k + 1) * T::bytes, second, s8[k + 1], b8[k + 1]);
        q[k / 2] = concat<u8x64>(first, second);
      }
      if constexpr (GATHER_SCALES) {
        gathered_scales<T, Blocks>(p, s, b);  // the compiler drops the scalar scales above
      } else {
        s = load<f32x16>(s8), b = load<f32x16>(b8);
      }
    } else {
      T::decode8(p, q, s, b);
    }
  }

  // lane l of vector v covers 4 elements of one group: which one (vector arithmetic on
  // constants, which the compiler folds; a loop over the lanes stays a loop)
  static i32x16 lane_groups(int v) {
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const i32x16 blocks = {order(0), order(1), order(2), order(3),
                           order(4), order(5), order(6), order(7)};
    const i32x16 position = 64 * v + 4 * lane;
    return (32 * __builtin_shuffle(blocks, position / 32) + position % 32) / group;
  }
};

// M rows of x as int8, each unit's blocks of 32 in the unit's order: the values, and per group
// of the unit's `group` elements (16 or 32, in x's own order) the scale d and d * the values'
// sum; the per-group arrays padded with 16 zeros (a unit reads 16 lanes from its first group)
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, sums;
  int64_t cols, groups;

  template <class U>
  Int8Rows(U, const float* x, int64_t M, int64_t cols)
      : q(M * cols), cols(cols), groups(cols / U::group + 16) {
    d.assign(M * groups, 0.f), sums.assign(M * groups, 0.f);
    constexpr int blocks = U::elements / 32, per_block = 32 / U::group;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < cols / 32; ++k) {
        const int64_t own = k - k % blocks + U::order(k % blocks);
        const int64_t g = m * groups + per_block * own;
        quantize_block<per_block>(x + m * cols + 32 * own, q.data() + m * cols + 32 * k,
                                  d.data() + g, sums.data() + g);
      }
  }

  // 32 values to `out`, with the scale and the scaled sum of each of their Parts groups
  template <int Parts>
  static void quantize_block(const float* x, int8_t* out, float* d, float* sums) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    int32_t part_sums[Parts] = {};
    for (int i = 0; i < 32; ++i) {
      out[i] = int8_t(std::nearbyint(x[i] * inverse));
      part_sums[i * Parts / 32] += out[i];
    }
    for (int p = 0; p < Parts; ++p) d[p] = scale, sums[p] = scale * part_sums[p];
  }

  const int8_t* values(int64_t m) const { return q.data() + m * cols; }
  const float* scales(int64_t m) const { return d.data() + m * groups; }
  const float* group_sums(int64_t m) const { return sums.data() + m * groups; }
};

// Units [j0, j1) of R rows of W (`rows`) times M rows of x, added to acc; the rows take turns
// unit by unit, so R accumulations are in flight at once
template <class U, int M, int R>
inline void add_units(const Int8Rows& x, int64_t m0, const uint8_t* const* rows, int64_t j0,
                      int64_t j1, int64_t row_bytes, f32x16 (&acc)[R][M]) {
  constexpr int V = U::elements / 64;
  u8x64 q[V];
  f32x16 s, b;
  for (int64_t j = j0; j < j1; ++j)
    for (int r = 0; r < R; ++r) {
      const uint8_t* unit = rows[r] + j * U::bytes;
      for (int line = 0; line < U::bytes; line += 64)  // the next R rows' unit (gguf.cpp)
        __builtin_prefetch(unit + R * row_bytes + line);
      U::decode(unit, q, s, b);
      for (int m = 0; m < M; ++m) {
        const int64_t g = j * U::groups;
        const f32x16 scale = s * load<f32x16>(x.scales(m0 + m) + g);
        acc[r][m] += b * load<f32x16>(x.group_sums(m0 + m) + g);
        const int8_t* xq = x.values(m0 + m) + j * U::elements;
        for (int v = 0; v < V; ++v) {
          const f32x16 lanes = __builtin_shuffle(scale, U::lane_groups(v));
          acc[r][m] += floats(dot4(q[v], load<i8x64>(xq + 64 * v))) * lanes;
        }
      }
    }
}

// M rows of x times W as mm_batch (gguf.cpp) runs them, R rows of W at a time per thread, each
// unit of a row decoded once and met by all M rows of x; a row of 32-element blocks whose length
// is not a multiple of 256 ends in units of two blocks
template <class T, int M, int R>
void mm8_batch(const Int8Rows& x, int64_t m0, const uint8_t* bp, int64_t row_bytes, int64_t N,
               float* out) {
  using U = Unit<T>;
  using Tail = Unit<T, U::small ? 2 : 1>;
  const int64_t units = x.cols / U::elements;
  const int64_t tail0 = units * U::elements / Tail::elements, tails = x.cols / Tail::elements;
  at::parallel_for(0, (N + R - 1) / R, 4, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin * R; n0 < std::min(end * R, N); n0 += R) {
      const int rows = int(std::min<int64_t>(R, N - n0));
      const uint8_t* row[R];
      for (int r = 0; r < R; ++r) row[r] = bp + (n0 + std::min(r, rows - 1)) * row_bytes;
      f32x16 acc[R][M] = {};
      add_units<U, M, R>(x, m0, row, 0, units, row_bytes, acc);
      if (U::small) add_units<Tail, M, R>(x, m0, row, tail0, tails, row_bytes, acc);
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < rows; ++r) out[m * N + n0 + r] = hsum(acc[r][m]);
    }
  });
}

// whether the int8 path takes x of `cols` columns for type T (whole units only)
template <class T>
bool int8_serves(int64_t cols) {
  return cols % (Unit<T>::small ? 64 : Unit<T>::elements) == 0;
}

// (M, cols) float x @ W.T -> out (M, N), in passes of 8, 4, 2 and 1 rows of x
template <class T>
void mm8_streaming(const float* x, int64_t M, const uint8_t* bp, int64_t row_bytes, int64_t N,
                   int64_t cols, float* out) {
  const Int8Rows rows_of_x(Unit<T>{}, x, M, cols);
  int64_t m0 = 0;
  for (int rows : {8, 4, 2, 1})
    for (; M - m0 >= rows; m0 += rows) {
      float* o = out + m0 * N;
      if (rows == 8) mm8_batch<T, 8, 2>(rows_of_x, m0, bp, row_bytes, N, o);
      if (rows == 4) mm8_batch<T, 4, 2>(rows_of_x, m0, bp, row_bytes, N, o);
      if (rows == 2) mm8_batch<T, 2, 4>(rows_of_x, m0, bp, row_bytes, N, o);
      if (rows == 1) mm8_batch<T, 1, 4>(rows_of_x, m0, bp, row_bytes, N, o);
    }
}

}  // namespace
}  // namespace kestrel_cpu

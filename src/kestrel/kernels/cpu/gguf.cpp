// GGUF blocks on the CPU: x @ W.T straight from llama.cpp's block layout, and W's rows
// dequantized, for the types kernels/quant.py decodes in PyTorch (that file is the reference:
// the same bits to the same values). Built and loaded by kernels/cpu_native.py.
//
// Every type decodes a block into vectors of 16 small integers (as floats) q, each with a scale
// s and a bias b: w = s * q + b, the weights the activations multiply in registers. The vectors
// are vec.h's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace kestrel_cpu {
namespace {

constexpr int QK_K = 256;

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction; the portable conversion is a dozen per scale
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// 16 bytes at p. The empty asm keeps GCC from merging neighbouring loads into one it then
// unpacks byte by byte (3x slower for Q8_0's two loads per block)
inline u8x16 bytes16(const uint8_t* p) {
  u8x16 v = load<u8x16>(p);
#if defined(__x86_64__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
  return v;
}

// bytes widen to int32 first: GCC scalarizes a direct byte-to-float vector conversion
inline i32x16 ints(u8x16 v) { return __builtin_convertvector(v, i32x16); }
inline f32x16 floats(i32x16 v) { return __builtin_convertvector(v, f32x16); }
inline f32x16 floats(u8x16 v) { return floats(ints(v)); }
inline f32x16 signed_floats(u8x16 v) { return floats((ints(v) ^ 128) - 128); }  // int8 bytes

// bit `first + lane` of `bits`, in each of 16 lanes
inline i32x16 bit_lanes(uint32_t bits, int first) {
  const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return (i32x16{} + int32_t(bits >> first)) >> lane & 1;
}

// Each type: elements and bytes per block, whether its weights have a bias, and `decode`: the
// block's elements / 16 vectors q with their scales s and biases b, in the reference's order.

struct Q4_0 {
  static constexpr int elements = 32, bytes = 18;
  static constexpr bool bias = false;
  static void decode(const uint8_t* p, f32x16* q, float* s, float*) {
    const u8x16 qs = bytes16(p + 2);  // low nibbles are elements 0-15, high ones 16-31
    q[0] = floats(qs & 15) - 8.f, q[1] = floats(qs >> 4) - 8.f;
    s[0] = s[1] = f16(p);
  }
};

struct Q4_1 {
  static constexpr int elements = 32, bytes = 20;
  static constexpr bool bias = true;
  static void decode(const uint8_t* p, f32x16* q, float* s, float* b) {
    const u8x16 qs = bytes16(p + 4);
    q[0] = floats(qs & 15), q[1] = floats(qs >> 4);
    s[0] = s[1] = f16(p), b[0] = b[1] = f16(p + 2);
  }
};

// 32 five-bit values: nibbles as Q4, bit i of the little-endian uint32 at `qh` on top of value i
inline void five_bits(const uint8_t* qh, const uint8_t* qs, f32x16* q, int offset) {
  uint32_t high;
  std::memcpy(&high, qh, 4);
  const u8x16 v = bytes16(qs);
  q[0] = floats(ints(v & 15) | bit_lanes(high, 0) << 4) - float(offset);
  q[1] = floats(ints(v >> 4) | bit_lanes(high, 16) << 4) - float(offset);
}

struct Q5_0 {
  static constexpr int elements = 32, bytes = 22;
  static constexpr bool bias = false;
  static void decode(const uint8_t* p, f32x16* q, float* s, float*) {
    five_bits(p + 2, p + 6, q, 16);
    s[0] = s[1] = f16(p);
  }
};

struct Q5_1 {
  static constexpr int elements = 32, bytes = 24;
  static constexpr bool bias = true;
  static void decode(const uint8_t* p, f32x16* q, float* s, float* b) {
    five_bits(p + 4, p + 8, q, 0);
    s[0] = s[1] = f16(p), b[0] = b[1] = f16(p + 2);
  }
};

struct Q8_0 {
  static constexpr int elements = 32, bytes = 34;
  static constexpr bool bias = false;
  static void decode(const uint8_t* p, f32x16* q, float* s, float*) {
    q[0] = signed_floats(bytes16(p + 2)), q[1] = signed_floats(bytes16(p + 18));
    s[0] = s[1] = f16(p);
  }
};

// Q4_K / Q5_K: eight sub-blocks of 32, each with a 6-bit scale and min packed in 12 bytes:
// w = d * sc * q - dmin * m. Sub-blocks 2c and 2c + 1 are the low and high nibbles of 32 bytes.
inline void k_scales(const uint8_t* p, float* s, float* b) {
  const float d = f16(p), dmin = f16(p + 2);
  const uint8_t* sc = p + 4;
  for (int j = 0; j < 8; ++j) {
    int scale, min;
    if (j < 4) {
      scale = sc[j] & 0x3F, min = sc[j + 4] & 0x3F;
    } else {
      scale = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 2) & 0x30);
      min = (sc[j + 4] >> 4) | ((sc[j] >> 2) & 0x30);
    }
    s[2 * j] = s[2 * j + 1] = d * scale, b[2 * j] = b[2 * j + 1] = -dmin * min;
  }
}

struct Q4_K {
  static constexpr int elements = QK_K, bytes = 144;
  static constexpr bool bias = true;
  static void decode(const uint8_t* p, f32x16* q, float* s, float* b) {
    k_scales(p, s, b);
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < 2; ++h) {
        const u8x16 v = bytes16(p + 16 + 32 * c + 16 * h);
        q[4 * c + h] = floats(v & 15), q[4 * c + 2 + h] = floats(v >> 4);
      }
  }
};

struct Q5_K {
  static constexpr int elements = QK_K, bytes = 176;
  static constexpr bool bias = true;
  static void decode(const uint8_t* p, f32x16* q, float* s, float* b) {
    k_scales(p, s, b);
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < 2; ++h) {
        const u8x16 v = bytes16(p + 48 + 32 * c + 16 * h);
        const u8x16 high = bytes16(p + 16 + 16 * h);  // bit g: sub-block g's fifth bits
        q[4 * c + h] = floats((v & 15) | ((high >> (2 * c)) & 1) << 4);
        q[4 * c + 2 + h] = floats((v >> 4) | ((high >> (2 * c + 1)) & 1) << 4);
      }
  }
};

// Q6_K: 16 groups of 16 with int8 scales; low nibbles in 128 bytes, two high bits in 64
struct Q6_K {
  static constexpr int elements = QK_K, bytes = 210;
  static constexpr bool bias = false;
  static void decode(const uint8_t* p, f32x16* q, float* s, float*) {
    const float d = f16(p + 208);
    for (int i = 0; i < 16; ++i) s[i] = d * int8_t(p[192 + i]);
    for (int c = 0; c < 2; ++c)
      for (int g = 0; g < 4; ++g)  // element 128c + 32g + j
        for (int h = 0; h < 2; ++h) {
          const u8x16 ql = bytes16(p + 64 * c + 32 * (g % 2) + 16 * h);
          const u8x16 qh = bytes16(p + 128 + 32 * c + 16 * h);
          const u8x16 low = g < 2 ? ql & 15 : ql >> 4;
          q[8 * c + 2 * g + h] = floats(low | ((qh >> (2 * g)) & 3) << 4) - 32.f;
        }
  }
};

// `f` called with the type of `code`, as kernels/cpu_native.py's QTYPES number them
template <class F>
auto dispatch(int64_t code, F&& f) {
  switch (code) {
    case 0: return f(Q4_0{});
    case 1: return f(Q4_1{});
    case 2: return f(Q5_0{});
    case 3: return f(Q5_1{});
    case 4: return f(Q8_0{});
    case 5: return f(Q4_K{});
    case 6: return f(Q5_K{});
    case 7: return f(Q6_K{});
  }
  TORCH_CHECK(false, "unknown GGUF type code ", code);
}

template <class T>
void check(const at::Tensor& blocks, int64_t cols) {
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be a contiguous (rows, row bytes) uint8 tensor");
  TORCH_CHECK(cols % T::elements == 0 && blocks.size(1) == cols / T::elements * T::bytes,
              "blocks of ", blocks.size(1), " bytes per row do not hold ", cols, " columns");
}

// rows [begin, end) of W dequantized into `w` ((end - begin), cols)
template <class T>
void dequantize_rows(const uint8_t* bp, int64_t row_bytes, int64_t cols, int64_t begin,
                     int64_t end, float* w) {
  const int64_t per_row = cols / T::elements;
  at::parallel_for(0, (end - begin) * per_row, 16, [&](int64_t first, int64_t last) {
    f32x16 q[T::elements / 16];
    float s[T::elements / 16], b[T::elements / 16] = {};
    for (int64_t k = first; k < last; ++k) {
      const int64_t n = begin + k / per_row, j = k % per_row;
      T::decode(bp + n * row_bytes + j * T::bytes, q, s, b);
      for (int v = 0; v < T::elements / 16; ++v) {
        const f32x16 wv = s[v] * q[v] + b[v];
        std::memcpy(w + k * T::elements + 16 * v, &wv, sizeof(wv));
      }
    }
  });
}

// M rows of x (decode, small batches) times W: each thread takes a run of W's rows, R at a time,
// decodes their blocks once into weights in registers, and loads every row of x once per vector
// to multiply it into all R; the M x R vector accumulators (independent chains of FMAs) are
// summed once per output. W streams from memory once per call.
template <class T, int M, int R>
void mm_batch(const float* x, const uint8_t* bp, int64_t row_bytes, int64_t N, int64_t cols,
              float* out) {
  constexpr int V = T::elements / 16;
  const int64_t per_row = cols / T::elements;
  at::parallel_for(0, (N + R - 1) / R, 4, [&](int64_t begin, int64_t end) {
    f32x16 q[V], w[R][V];
    float s[V], b[V] = {};
    for (int64_t n0 = begin * R; n0 < std::min(end * R, N); n0 += R) {
      const int rows = int(std::min<int64_t>(R, N - n0));
      f32x16 acc[M][R] = {};
      for (int64_t j = 0; j < per_row; ++j) {
        for (int r = 0; r < R; ++r) {
          const uint8_t* block = bp + (n0 + std::min(r, rows - 1)) * row_bytes + j * T::bytes;
          // the same block of the next R rows: a thread's next stretch of W, fetched while this
          // one computes (W streams from memory; the hardware prefetcher alone leaves it idle)
          __builtin_prefetch(block + R * row_bytes);
          T::decode(block, q, s, b);
          for (int v = 0; v < V; ++v) w[r][v] = T::bias ? s[v] * q[v] + b[v] : s[v] * q[v];
        }
        for (int v = 0; v < V; ++v)
          for (int m = 0; m < M; ++m) {
            const f32x16 xv = load<f32x16>(x + m * cols + j * T::elements + 16 * v);
            for (int r = 0; r < R; ++r) acc[m][r] += w[r][v] * xv;
          }
      }
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < rows; ++r) out[m * N + n0 + r] = hsum(acc[m][r]);
    }
  });
}

template <class T>
void mm_streaming(const float* x, int64_t M, const uint8_t* bp, int64_t row_bytes, int64_t N,
                  int64_t cols, float* out) {
  // passes of 8, 4, 2 and 1 rows of x (out is (M, N) row-major: each fills whole rows of it),
  // with four to sixteen accumulators
  for (int rows : {8, 4, 2, 1})
    for (; M >= rows; M -= rows, x += rows * cols, out += rows * N) {
      if (rows == 8) mm_batch<T, 8, 2>(x, bp, row_bytes, N, cols, out);
      if (rows == 4) mm_batch<T, 4, 2>(x, bp, row_bytes, N, cols, out);
      if (rows == 2) mm_batch<T, 2, 4>(x, bp, row_bytes, N, cols, out);
      if (rows == 1) mm_batch<T, 1, 4>(x, bp, row_bytes, N, cols, out);
    }
}

// Past this many rows of x (prefill chunks), tiles of W dequantized once go through the BLAS
// GEMM: decoding once per tile beats decoding once per eight rows (measured: even at 32 rows
// streaming runs at 90 GFMA/s on two cores, the tiles at 50)
constexpr int64_t STREAMING_ROWS = 32;
constexpr int64_t TILE_FLOATS = 1 << 20;  // 4 MB of W as floats at once

// (M, K) x @ W.T, W as (N, row bytes) blocks -> (M, N), in x's dtype
at::Tensor gguf_mm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t code, int64_t cols) {
  return dispatch(code, [&](auto type) {
    using T = decltype(type);
    check<T>(blocks, cols);
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == cols, "x must be (M, ", cols, ")");
    const at::Tensor x = x_in.to(at::kFloat).contiguous();
    const int64_t M = x.size(0), N = blocks.size(0), row_bytes = blocks.size(1);
    const uint8_t* bp = blocks.data_ptr<uint8_t>();
    at::Tensor out = at::empty({M, N}, x.options());
    if (M <= STREAMING_ROWS) {
      mm_streaming<T>(x.data_ptr<float>(), M, bp, row_bytes, N, cols,
                      out.data_ptr<float>());
      return out.to(x_in.scalar_type());
    }
    const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(N, TILE_FLOATS / cols));
    at::Tensor w = at::empty({tile, cols}, x.options());
    for (int64_t n = 0; n < N; n += tile) {
      const int64_t rows = std::min(tile, N - n);
      dequantize_rows<T>(bp, row_bytes, cols, n, n + rows, w.data_ptr<float>());
      out.narrow(1, n, rows).copy_(at::mm(x, w.narrow(0, 0, rows).t()));
    }
    return out.to(x_in.scalar_type());
  });
}

// (N, row bytes) blocks -> (N, cols) float32
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t code, int64_t cols) {
  return dispatch(code, [&](auto type) {
    using T = decltype(type);
    check<T>(blocks, cols);
    at::Tensor out = at::empty({blocks.size(0), cols}, blocks.options().dtype(at::kFloat));
    dequantize_rows<T>(blocks.data_ptr<uint8_t>(), blocks.size(1), cols, 0, blocks.size(0),
                       out.data_ptr<float>());
    return out;
  });
}

}  // namespace
}  // namespace kestrel_cpu

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) {
  m.def("gguf_mm(Tensor x, Tensor blocks, int qtype, int cols) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int qtype, int cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) {
  m.impl("gguf_mm", kestrel_cpu::gguf_mm);
  m.impl("gguf_dequantize", kestrel_cpu::gguf_dequantize);
}

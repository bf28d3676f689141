// GGUF blocks on the CPU: x @ W.T straight from llama.cpp's block layout (float activations
// here, int8 ones in gguf_int8.cpp), and W's rows dequantized, for the types of gguf_blocks.h.
// Built and loaded by kernels/cpu_native.py.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "gguf_int8.h"

namespace kestrel_cpu {
namespace {

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

// (M, K) x @ W.T, W as (N, row bytes) blocks -> (M, N), in x's dtype; decode's few rows of x
// quantized to int8 where `int8` asks for it (gguf_int8.h)
at::Tensor gguf_mm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t code, int64_t cols,
                   bool int8) {
  return dispatch(code, [&](auto type) {
    using T = decltype(type);
    check<T>(blocks, cols);
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == cols, "x must be (M, ", cols, ")");
    const at::Tensor x = x_in.to(at::kFloat).contiguous();
    const int64_t M = x.size(0), N = blocks.size(0), row_bytes = blocks.size(1);
    const uint8_t* bp = blocks.data_ptr<uint8_t>();
    at::Tensor out = at::empty({M, N}, x.options());
    if (M <= STREAMING_ROWS && int8 && int8_serves<T>(cols)) {
      mm8_streaming<T>(x.data_ptr<float>(), M, bp, row_bytes, N, cols, out.data_ptr<float>());
      return out.to(x_in.scalar_type());
    }
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

bool fast_int8_dot() { return FAST_INT8_DOT; }

}  // namespace
}  // namespace kestrel_cpu

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) {
  m.def("gguf_mm(Tensor x, Tensor blocks, int qtype, int cols, bool int8) -> Tensor");
  m.def("fast_int8_dot() -> bool", &kestrel_cpu::fast_int8_dot);
  m.def("gguf_dequantize(Tensor blocks, int qtype, int cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) {
  m.impl("gguf_mm", kestrel_cpu::gguf_mm);
  m.impl("gguf_dequantize", kestrel_cpu::gguf_dequantize);
}

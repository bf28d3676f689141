// The vector types and loads kestrel's CPU kernels share: GCC/Clang vector extensions, which the
// compiler maps to AVX-512, AVX2 or NEON.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstring>
#include <type_traits>
#include <utility>

namespace kestrel_cpu {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef uint8_t u8x64 __attribute__((vector_size(64)));
typedef int8_t i8x64 __attribute__((vector_size(64)));

template <class V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

inline void store(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

// a then b in one vector twice their size (a shuffle: through memory, the two stores and the
// wider load stall store-to-load forwarding, 3x slower)
template <class Out, class In, size_t... I>
inline Out concat(In a, In b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, I...);
}
template <class Out, class In>
inline Out concat(In a, In b) {
  static_assert(sizeof(Out) == 2 * sizeof(In));
  return concat<Out>(a, b, std::make_index_sequence<sizeof(Out) / sizeof(a[0])>());
}

inline float hsum(f32x16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(__m512(v));  // a shuffle tree, not 15 dependent adds
#else
  float s = 0;
  for (int l = 0; l < 16; ++l) s += v[l];
  return s;
#endif
}

inline float hmax(f32x16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(__m512(v));
#else
  float m = v[0];
  for (int l = 1; l < 16; ++l) m = v[l] > m ? v[l] : m;
  return m;
#endif
}

// e^x to about 2e-7 relative (x clamped to [-87, 88]; e^-inf = 0): 2^(x log2 e) as 2^i times
// 2^f, f in [-1/2, 1/2] (i the nearest integer), 2^f by its degree-6 Taylor series
inline f32x16 exp16(f32x16 x) {
  const f32x16 clamped = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const f32x16 t = clamped * 1.44269504f;
  const f32x16 up = t + 0.5f;
  i32x16 i = __builtin_convertvector(up, i32x16);  // truncates toward zero, then down to floor:
  i += __builtin_convertvector(i, f32x16) > up;     // a true comparison is -1
  const f32x16 f = t - __builtin_convertvector(i, f32x16);
  constexpr float ln2[] = {1.f, 6.93147181e-1f, 2.40226507e-1f, 5.55041087e-2f,
                           9.61812911e-3f, 1.33335581e-3f, 1.54035304e-4f};  // ln(2)^k / k!
  f32x16 p = f32x16{} + ln2[6];
  for (int k = 5; k >= 0; --k) p = p * f + ln2[k];
  f32x16 scale;
  const i32x16 bits = (i + 127) << 23;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? 0.f : p * scale;
}

// n values of type T at p as floats at out (the kernels compute in float32 whatever the dtype)
template <class T>
inline void to_floats(const T* p, int64_t n, float* out) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, p, n * sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = float(p[i]);
  }
}

}  // namespace kestrel_cpu

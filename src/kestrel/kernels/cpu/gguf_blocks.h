// GGUF's block types as kernels/cpu/gguf.cpp and gguf_int8.cpp read them: for each, its size and
// two decodings of one block. kernels/quant.py is the reference (the same bits to the same values).
//
// `decode`: the block's elements as vectors of 16 small integers (as floats) q, each with a scale
// s and a bias b: w = s * q + b, the weights float activations multiply in registers.
// `decode8`: the same integers as unsigned bytes for the int8 dot products, with one scale and
// one bias per group of `group` elements (the bias holds the integers' offset: Q4_0's -8 is
// b = -8 s); 32-element types decode 32 bytes, the k-quants 256 (four vectors of 64).
#pragma once

#include <ATen/ATen.h>

#if defined(__F16C__) || defined(__AVX512F__)
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
inline i32x16 ints(u8x16 v) {
#if defined(__AVX512F__)
  return i32x16(_mm512_cvtepu8_epi32(__m128i(v)));  // GCC sometimes widens lane by lane
#else
  return __builtin_convertvector(v, i32x16);
#endif
}
inline f32x16 floats(i32x16 v) { return __builtin_convertvector(v, f32x16); }
inline f32x16 floats(u8x16 v) { return floats(ints(v)); }
inline f32x16 signed_floats(u8x16 v) { return floats((ints(v) ^ 128) - 128); }  // int8 bytes

// bit `first + lane` of `bits`, in each of 16 lanes
inline i32x16 bit_lanes(uint32_t bits, int first) {
  const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return (i32x16{} + int32_t(bits >> first)) >> lane & 1;
}

// 16 in byte i where bit i of the little-endian uint32 at p is set (the fifth bits of Q5_0/Q5_1)
inline u8x32 sixteens(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return u8x32(_mm256_maskz_set1_epi8(bits, 16));
#else
  u8x32 v;
  for (int i = 0; i < 32; ++i) v[i] = (bits >> i & 1) << 4;
  return v;
#endif
}

// a 32-element block's low nibbles (elements 0-15) then high nibbles (16-31)
inline u8x32 nibbles(const uint8_t* p) {
  const u8x16 v = bytes16(p);
  return concat<u8x32>(v & 15, v >> 4);
}

// Each type: elements and bytes per block, whether its weights have a bias, and `decode`: the
// block's elements / 16 vectors q with their scales s and biases b, in the reference's order.

struct Q4_0 {
  static constexpr int elements = 32, bytes = 18;
  static constexpr bool bias = false;
  static constexpr float offset = -8.f;  // w = s * (q + offset): the bias is offset * s
  static void decode(const uint8_t* p, f32x16* q, float* s, float*) {
    const u8x16 qs = bytes16(p + 2);  // low nibbles are elements 0-15, high ones 16-31
    q[0] = floats(qs & 15) - 8.f, q[1] = floats(qs >> 4) - 8.f;
    s[0] = s[1] = f16(p);
  }
  static void decode8(const uint8_t* p, u8x32& q, float& s, float& b) {
    q = nibbles(p + 2), s = f16(p), b = offset * s;
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
  static void decode8(const uint8_t* p, u8x32& q, float& s, float& b) {
    q = nibbles(p + 4), s = f16(p), b = f16(p + 2);
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
  static constexpr float offset = -16.f;  // w = s * (q + offset): the bias is offset * s
  static void decode(const uint8_t* p, f32x16* q, float* s, float*) {
    five_bits(p + 2, p + 6, q, 16);
    s[0] = s[1] = f16(p);
  }
  static void decode8(const uint8_t* p, u8x32& q, float& s, float& b) {
    q = nibbles(p + 6) | sixteens(p + 2), s = f16(p), b = offset * s;
  }
};

struct Q5_1 {
  static constexpr int elements = 32, bytes = 24;
  static constexpr bool bias = true;
  static void decode(const uint8_t* p, f32x16* q, float* s, float* b) {
    five_bits(p + 4, p + 8, q, 0);
    s[0] = s[1] = f16(p), b[0] = b[1] = f16(p + 2);
  }
  static void decode8(const uint8_t* p, u8x32& q, float& s, float& b) {
    q = nibbles(p + 8) | sixteens(p + 4), s = f16(p), b = f16(p + 2);
  }
};

struct Q8_0 {
  static constexpr int elements = 32, bytes = 34;
  static constexpr bool bias = false;
  static constexpr float offset = -128.f;  // w = s * (q + offset): the bias is offset * s
  static void decode(const uint8_t* p, f32x16* q, float* s, float*) {
    q[0] = signed_floats(bytes16(p + 2)), q[1] = signed_floats(bytes16(p + 18));
    s[0] = s[1] = f16(p);
  }
  // int8 values as unsigned bytes by adding 128, taken back out in the bias
  static void decode8(const uint8_t* p, u8x32& q, float& s, float& b) {
    q = concat<u8x32>(bytes16(p + 2), bytes16(p + 18)) ^ 128, s = f16(p), b = offset * s;
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

// the same eight scales and biases in lanes 0-7 (the rest 0), unpacked in registers: of the
// 12 bytes as words a | b | c, sub-block j < 4 has scale a_j & 63 and min b_j & 63; j >= 4 takes
// its low four bits from c_(j-4) (scale: the low nibble, min: the high one) and its top two
// from bits 6-7 of a_(j-4) (scale) or b_(j-4) (min). Built in memory, the words' stores stall the
// vector load that reads them.
inline void k_scales8(const uint8_t* p, f32x16& s, f32x16& b) {
  typedef uint32_t u32x4 __attribute__((vector_size(16)));
  const uint32_t w[3] = {load<uint32_t>(p + 4), load<uint32_t>(p + 8), load<uint32_t>(p + 12)};
  const u32x4 ab = {w[0], w[0], w[1], w[1]}, c = u32x4{} + w[2], shift = {0, 0, 4, 4};
  const u32x4 low = ab & 0x3F3F3F3F, high = (c >> shift & 0x0F0F0F0F) | (ab >> 2 & 0x30303030);
  const u32x4 odd = {0, ~0u, 0, ~0u};  // lanes: scales 0-3, 4-7, mins 0-3, 4-7
  const u32x4 unpacked = (low & ~odd) | (high & odd);
  u8x16 bytes;
  std::memcpy(&bytes, &unpacked, 16);  // a register move, not a store
  const f32x16 v = floats(bytes), zero = {};
  const i32x16 scales = {0, 1, 2, 3, 4, 5, 6, 7, 16, 16, 16, 16, 16, 16, 16, 16};
  const i32x16 mins = {8, 9, 10, 11, 12, 13, 14, 15, 16, 16, 16, 16, 16, 16, 16, 16};
  s = f16(p) * __builtin_shuffle(v, zero, scales);
  b = -f16(p + 2) * __builtin_shuffle(v, zero, mins);
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
  // 64 bytes hold sub-blocks 4c and 4c + 2 in their low nibbles, 4c + 1 and 4c + 3 in the high
  static constexpr int group = 32, order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  static void decode8(const uint8_t* p, u8x64* q, f32x16& s, f32x16& b) {
    k_scales8(p, s, b);
    for (int c = 0; c < 2; ++c) {
      const u8x64 v = load<u8x64>(p + 16 + 64 * c);
      q[2 * c] = v & 15, q[2 * c + 1] = v >> 4;
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
  // Q4_K's order; sub-block g's fifth bits are bit g of the 32 bytes at p + 16
  static constexpr int group = 32, order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  static void decode8(const uint8_t* p, u8x64* q, f32x16& s, f32x16& b) {
    k_scales8(p, s, b);
    const u8x32 bits = load<u8x32>(p + 16);
    const u8x64 high = concat<u8x64>(bits, bits >> 2);  // bit 4c: sub-block 4c, then 4c + 2
    for (int c = 0; c < 2; ++c) {
      const u8x64 v = load<u8x64>(p + 48 + 64 * c);
      q[2 * c] = (v & 15) | ((high >> (4 * c)) & 1) << 4;
      q[2 * c + 1] = (v >> 4) | ((high >> (4 * c + 1)) & 1) << 4;
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
  static constexpr int group = 16, order[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  static void decode8(const uint8_t* p, u8x64* q, f32x16& s, f32x16& b) {
    s = f16(p + 208) * signed_floats(bytes16(p + 192)), b = -32.f * s;
    for (int c = 0; c < 2; ++c) {  // elements 128c + 64h + j: vector 2c + h
      const u8x32 low = load<u8x32>(p + 64 * c), high = load<u8x32>(p + 64 * c + 32);
      const u8x32 qh = load<u8x32>(p + 128 + 32 * c);
      q[2 * c] = concat<u8x64>((low & 15) | (qh & 3) << 4, (high & 15) | ((qh >> 2) & 3) << 4);
      q[2 * c + 1] = concat<u8x64>(low >> 4 | ((qh >> 4) & 3) << 4, high >> 4 | (qh >> 6) << 4);
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

}  // namespace
}  // namespace kestrel_cpu

// The per-token work between the CPU's matmuls, one op each instead of a handful of ATen ops:
// RMSNorm, the gated MLP's activation times up, and RoPE on q and k of a fused qkv projection
// with k and v stored straight into their paged-cache slots. The same arithmetic as the PyTorch
// fallbacks of kernels/fused.py, their reference; built by kernels/cpu_native.py.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "vec.h"

namespace kestrel_cpu {
namespace {

// rows per parallel task: the ops are cheap per row, and a thread's start costs microseconds
constexpr int64_t ROWS_PER_TASK = 8;

#define FLOATING_TYPES(NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, NAME, __VA_ARGS__)

// x: (rows, H) with unit stride along H -> (rows, H) contiguous
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, H) with contiguous rows");
  const int64_t rows = x.size(0), H = x.size(1), stride = x.stride(0);
  TORCH_CHECK(weight.numel() == H && weight.is_contiguous(), "weight must be (H,)");
  at::Tensor out = at::empty({rows, H}, x.options());
  const at::Tensor w = weight.to(at::kFloat);
  const float* wp = w.data_ptr<float>();
  FLOATING_TYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
      std::vector<float> row(H);
      for (int64_t r = begin; r < end; ++r) {
        to_floats(xp + r * stride, H, row.data());
        double squares = 0;
        for (int64_t i = 0; i < H; ++i) squares += double(row[i]) * row[i];
        const float inv = 1.f / std::sqrt(float(squares / H) + float(eps));
        scalar_t* o = op + r * H;
        for (int64_t i = 0; i < H; ++i) {
          const float y = row[i] * inv;  // (1 + w) y in float; w y after rounding y to the dtype
          o[i] = unit_offset ? scalar_t(y * (1.f + wp[i])) : scalar_t(wp[i] * float(scalar_t(y)));
        }
      }
    });
  });
  return out;
}

// act(g) for 16 values: silu, or gelu's tanh approximation
inline f32x16 activate(f32x16 g, bool gelu) {
  if (!gelu) return g / (1.f + exp16(-g));
  const f32x16 u = 0.7978845608f * (g + 0.044715f * g * g * g);
  const f32x16 tanh = 1.f - 2.f / (exp16(2.f * u) + 1.f);
  return 0.5f * g * (1.f + tanh);
}

// gate_up (T, 2I) [gate | up] -> (T, I) act(gate) * up
at::Tensor act_mul(const at::Tensor& gate_up, bool gelu) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be (T, 2I) with contiguous rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({T, I}, gate_up.options());
  FLOATING_TYPES(gate_up.scalar_type(), "act_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
      std::vector<float> gate(I + 16), up(I + 16);
      for (int64_t t = begin; t < end; ++t) {
        to_floats(gp + t * stride, I, gate.data());
        to_floats(gp + t * stride + I, I, up.data());
        for (int64_t i = 0; i < I; i += 16) {  // the tail past I computes on scratch
          const f32x16 y = activate(load<f32x16>(&gate[i]), gelu) * load<f32x16>(&up[i]);
          for (int l = 0; l < 16 && i + l < I; ++l) op[t * I + i + l] = scalar_t(y[l]);
        }
      }
    });
  });
  return out;
}

// products and sums rounded one by one, as PyTorch's elementwise ops round them (no FMA)
#if defined(__clang__)
#define NO_CONTRACT
#define NO_CONTRACT_BODY _Pragma("clang fp contract(off)")
#else
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#define NO_CONTRACT_BODY
#endif

// One head of d values rotated (rotate-half RoPE: x cos + [-x2, x1] sin) into `out`
template <class T>
NO_CONTRACT void rotate(const T* x, const float* cos, const float* sin, int64_t d, T* out) {
  NO_CONTRACT_BODY
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float rotated = i < half ? -float(x[i + half]) : float(x[i - half]);
    // products in the dtype, as rope_torch computes them
    out[i] = T(float(T(float(x[i]) * float(T(cos[i])))) + float(T(rotated * float(T(sin[i])))));
  }
}

struct QKV {
  int64_t hq, hkv, d;
};

// qkv (T, (hq + 2 hkv) d); cos/sin (T, d). q (T, hq, d) rotated into q_out; k rotated and v into
// k_out / v_out at row slots[t] ((rows, hkv, d) each)
template <class T>
void rope_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, QKV s,
               T* q_out, T* k_out, T* v_out, const int64_t* slots) {
  const int64_t n = qkv.size(0), stride = qkv.stride(0), width = s.hkv * s.d;
  const T* base = qkv.data_ptr<T>();
  at::parallel_for(0, n, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = base + t * stride;
      const float* c = cos.data_ptr<float>() + t * cos.stride(0);
      const float* sn = sin.data_ptr<float>() + t * sin.stride(0);
      for (int64_t h = 0; h < s.hq; ++h)
        rotate(row + h * s.d, c, sn, s.d, q_out + (t * s.hq + h) * s.d);
      const int64_t at_slot = slots[t];
      for (int64_t h = 0; h < s.hkv; ++h)
        rotate(row + (s.hq + h) * s.d, c, sn, s.d, k_out + at_slot * width + h * s.d);
      std::memcpy(v_out + at_slot * width, row + (s.hq + s.hkv) * s.d, width * sizeof(T));
    }
  });
}

void check_rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, QKV s) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (s.hq + 2 * s.hkv) * s.d,
              "qkv must be (T, (hq + 2 hkv) d) with contiguous rows");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(1) == 1 && t->size(1) == s.d &&
                    t->size(0) == qkv.size(0),
                "cos and sin must be float32 (T, d)");
}

// -> q (T, hq, d) rotated; k rotated and v written at their flat slots of the caches
// (blocks, block_size, hkv, d)
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t hq, int64_t hkv, int64_t d, at::Tensor k_cache, at::Tensor v_cache,
                      const at::Tensor& slot_mapping) {
  const QKV s{hq, hkv, d};
  check_rope(qkv, cos, sin, s);
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->is_contiguous() && c->scalar_type() == qkv.scalar_type() && c->dim() == 4 &&
                    c->size(2) == hkv && c->size(3) == d,
                "caches must be contiguous (blocks, block_size, hkv, d) in qkv's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == qkv.size(0),
              "slot_mapping must be int64 (T,)");
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < slot_mapping.numel(); ++t)
    TORCH_CHECK(sm[t] >= 0 && sm[t] < slots, "slot ", sm[t], " outside the cache");
  at::Tensor q = at::empty({qkv.size(0), hq, d}, qkv.options());
  FLOATING_TYPES(qkv.scalar_type(), "rope_store", [&] {
    rope_rows<scalar_t>(qkv, cos, sin, s, q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                        v_cache.data_ptr<scalar_t>(), sm);
  });
  return q;
}

}  // namespace
}  // namespace kestrel_cpu

TORCH_LIBRARY_FRAGMENT(kestrel_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("act_mul(Tensor gate_up, bool gelu) -> Tensor");
  m.def(
      "rope_store(Tensor qkv, Tensor cos, Tensor sin, int hq, int hkv, int d, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor");
}

TORCH_LIBRARY_IMPL(kestrel_cpu, CPU, m) {
  m.impl("rms_norm", kestrel_cpu::rms_norm);
  m.impl("act_mul", kestrel_cpu::act_mul);
  m.impl("rope_store", kestrel_cpu::rope_store);
}

// Row-wise ops of a decoder layer fused into one pass each: RMSNorm, the residual add before it, and SiLU * mul.
//
// In plain torch an RMSNorm is six ops (pow, mean, add, rsqrt, two muls) and SiLU * mul three (chunk, silu, mul),
// each a pass over the activations and, at batch 64, its own parallel region. These do one pass per row, rows
// split over torch's OpenMP pool only when there are enough of them to be worth a region (a decode step at batch
// 1 stays on the calling thread). The arithmetic follows the torch ops they replace (Hugging Face Llama): the
// residual sum is rounded to the input dtype, the norm runs in fp32 and is rounded before the weight multiplies
// it, SiLU's output is rounded before the multiply; only the order of the fp32 sum of squares differs.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <tuple>
#include <vector>

#include "vec_math.h"

namespace {

using pdserve_native::exp_nonpositive;
using pdserve_native::load_f32;
using pdserve_native::round_to;
using pdserve_native::store_f32;

// About 32K elements per task: smaller rows share a task, so a region never spawns for a handful of values.
constexpr int64_t kElementsPerTask = 32768;

inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(width, 1)); }

// One row: optionally sum = x + residual (rounded to T, as torch's add is), then out = w * T(sum / rms(sum)).
template <typename T>
void norm_row(const T* __restrict__ x, const T* __restrict__ residual, const T* __restrict__ w,
              T* __restrict__ out, T* __restrict__ sum, int64_t H, float eps) {
  float squares = 0.0f;
  if (residual != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) store_f32(sum + i, load_f32(x + i) + load_f32(residual + i));
    x = sum;
  }
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < H; ++i) {
    const float v = load_f32(x + i);
    squares += v * v;
  }
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) store_f32(out + i, load_f32(w + i) * round_to<T>(load_f32(x + i) * inv));
}

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& w, at::Tensor& out,
               at::Tensor* sum, double eps) {
  const int64_t H = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* sp = sum ? sum->data_ptr<T>() : nullptr;
  at::parallel_for(0, x.size(0), row_grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row<T>(xp + r * H, rp ? rp + r * H : nullptr, wp, op + r * H, sp ? sp + r * H : nullptr, H,
                  static_cast<float>(eps));
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, " runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), op, ": input and weight differ in dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": fp32 or bf16 only");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), op, ": weight must match the last dim");
}

at::Tensor run_norm(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& w, at::Tensor* sum,
                    double eps) {
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::empty(x2.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float>(x2, residual, wc, out, sum, eps);
  } else {
    norm_rows<c10::BFloat16>(x2, residual, wc, out, sum, eps);
  }
  return out.view(x.sizes());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  return run_norm(x, nullptr, weight, nullptr, eps);
}

// (norm of x + residual, x + residual): the residual stream's next value comes back rather than being written
// into an input, so neither argument is modified.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and residual differ in shape or dtype");
  const at::Tensor r2 = residual.reshape({-1, x.size(-1)}).contiguous();
  at::Tensor sum = at::empty(r2.sizes(), x.options());
  at::Tensor out = run_norm(x, &r2, weight, &sum, eps);
  return {out, sum.view(x.sizes())};
}

// silu(g) = g / (1 + e^-g), written with e = exp(-|g|) so the exponent never overflows and never goes subnormal
// (a large negative g made torch's silu take the slow subnormal path: 5x slower on a random model's activations).
template <typename T>
void silu_mul_row(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out, int64_t I) {
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const float g = load_f32(gate + i);
    const float e = exp_nonpositive(-std::fabs(g));
    const float silu = (g >= 0.0f ? g : g * e) / (1.0f + e);
    store_f32(out + i, round_to<T>(silu) * load_f32(up + i));
  }
}

template <typename T>
void silu_mul_rows(const T* in, T* out, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, row_grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row<T>(in + r * 2 * I, in + r * 2 * I + I, out + r * I, I);
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up_in) {
  TORCH_CHECK(gate_up_in.device().is_cpu() && gate_up_in.size(-1) % 2 == 0, "silu_and_mul: [..., 2 * I] on CPU");
  const int64_t I = gate_up_in.size(-1) / 2;
  const at::Tensor gate_up = gate_up_in.reshape({-1, 2 * I}).contiguous();
  std::vector<int64_t> shape(gate_up_in.sizes().begin(), gate_up_in.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty({gate_up.size(0), I}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), gate_up.size(0), I);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_and_mul: fp32 or bf16 only");
    silu_mul_rows<c10::BFloat16>(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
                                 gate_up.size(0), I);
  }
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
}

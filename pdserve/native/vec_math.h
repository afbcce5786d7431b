// Small vectorizable math shared by the kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

namespace pdserve_native {

// exp for x <= 0 (scores minus their running max), vectorizable: 2^n * p(r) with the Cephes expf polynomial,
// within 2 ulp of std::exp over the range softmax uses; glibc's scalar expf per score cost more than the rest.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  // n = round(x / ln 2) by the 1.5 * 2^23 trick: std::floor kept GCC 12 from vectorizing any loop calling this.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Loads and stores in fp32, written on raw bits so loops over bf16 vectorize (c10::BFloat16's conversions are
// opaque to the vectorizer); the store rounds to nearest even, NaN stays NaN, as c10's conversion does.
inline float load_f32(const float* p) { return *p; }

inline float load_f32(const c10::BFloat16* p) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[0]) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline void store_f32(float* p, float x) { *p = x; }

inline void store_f32(c10::BFloat16* p, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  reinterpret_cast<uint16_t*>(p)[0] = static_cast<uint16_t>(x != x ? 0x7FC0u : rounded);
}

// x as the dtype T would hold it, back in fp32: where torch rounds an intermediate to the tensor's dtype.
template <typename T>
inline float round_to(float x) {
  T held;
  store_f32(&held, x);
  return load_f32(&held);
}

}  // namespace pdserve_native

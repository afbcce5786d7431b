// The decode attention's inner loops in AVX-512 for head_dim 64 and 128, included only where the compiler targets
// AVX-512 (paged_attention.cpp keeps the portable loops for every other CPU and head size).
//
// The portable loops widened each bf16 block into a tile and then read it back, so bf16 did all of fp32's work
// and the widening on top. Here a key or value row is widened in registers as it is loaded (a bf16 is the top half
// of an fp32: zero-extend and shift), the query rows and the output rows of up to four query heads stay in
// registers across the whole context, and sixteen tokens' dot products are reduced together by a transpose tree.
// The arithmetic is the portable path's: fp32 products summed in fp32, the same online softmax and exp.
#pragma once

#if defined(__AVX512F__)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include <c10/util/BFloat16.h>

namespace pdserve_native::avx512 {

// Tokens handled together: one zmm of scores.
constexpr int64_t kChunk = 16;

template <int R>
inline void load_row(const float* p, __m512 (&r)[R]) {
  for (int i = 0; i < R; ++i) r[i] = _mm512_loadu_ps(p + 16 * i);
}

template <int R>
inline void load_row(const c10::BFloat16* p, __m512 (&r)[R]) {
  const __m256i* raw = reinterpret_cast<const __m256i*>(p);
  for (int i = 0; i < R; ++i) {
    r[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(raw + i)), 16));
  }
}

// exp_nonpositive (vec_math.h) on sixteen lanes, with the same constants and rounding trick.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 shift = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shift), shift);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// A zmm's sixteen lanes of partial dot products reduce to one sum; sixteen tokens' sums are folded together by a
// transpose tree (pairs 256, 128, 64 and 32 bits at a time) instead of sixteen separate horizontal sums. The tree
// is fed four tokens at a time so that few partial vectors are live at once.

// Four tokens' partial vectors -> one vector whose 128-bit lane j holds four partial sums of the j-th token.
inline __m512 fold4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // ab: a's eight partial sums, then b's; cd likewise.
  return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
}

// Four fold4 results (tokens 0-3, 4-7, 8-11, 12-15) -> lane t holds token t's sum.
inline __m512 sum16(__m512 q0, __m512 q1, __m512 q2, __m512 q3) {
  // 64-bit unpacks move pairs of floats; the sums are of floats again.
  const auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  const auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  const __m512 d0 = _mm512_add_ps(lo(q0, q1), hi(q0, q1)), d1 = _mm512_add_ps(lo(q2, q3), hi(q2, q3));
  // d0, 128-bit lane j: two partials of token j, then two of token 4 + j; d1 the same for 8 + j and 12 + j.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x88), _mm512_shuffle_ps(d0, d1, 0xDD));
  // 128-bit lane j: tokens j, 4 + j, 8 + j, 12 + j.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// Query heads [0, G) of one KV head's group against `length` keys: their rows (R = head_dim / 16 zmm each),
// running max, sum and output stay in registers from the first block to the last.
template <int HD, int G, typename T>
class GroupAttention {
  static constexpr int R = HD / 16;
  __m512 q_[G][R], acc_[G][R];
  float m_[G], l_[G];

 public:
  GroupAttention(const T* q, float scale) {
    for (int g = 0; g < G; ++g) {
      load_row(q + g * HD, q_[g]);
      for (int i = 0; i < R; ++i) q_[g][i] = _mm512_mul_ps(q_[g][i], _mm512_set1_ps(scale));
      for (int i = 0; i < R; ++i) acc_[g][i] = _mm512_setzero_ps();
      m_[g] = -std::numeric_limits<float>::infinity();
      l_[g] = 0.0f;
    }
  }

  // n <= 16 consecutive tokens: keys and values are their rows, HD apart.
  void chunk(const T* keys, const T* values, int64_t n) {
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    __m512 folded[G][4];
    for (int64_t quad = 0; quad < 4; ++quad) {
      if (quad * 4 >= n) {
        for (int g = 0; g < G; ++g) folded[g][quad] = _mm512_setzero_ps();
        continue;
      }
      __m512 partial[G][4];
      for (int64_t j = 0; j < 4; ++j) {
        const int64_t t = quad * 4 + j;
        if (t >= n) {
          for (int g = 0; g < G; ++g) partial[g][j] = _mm512_setzero_ps();
          continue;
        }
        __m512 k[R];
        load_row(keys + t * HD, k);
        for (int g = 0; g < G; ++g) {
          __m512 p = _mm512_mul_ps(q_[g][0], k[0]);
          for (int i = 1; i < R; ++i) p = _mm512_fmadd_ps(q_[g][i], k[i], p);
          partial[g][j] = p;
        }
      }
      for (int g = 0; g < G; ++g) folded[g][quad] = fold4(partial[g][0], partial[g][1], partial[g][2], partial[g][3]);
    }
    __m512 scores[G];
    for (int g = 0; g < G; ++g) scores[g] = sum16(folded[g][0], folded[g][1], folded[g][2], folded[g][3]);
    alignas(64) float weights[G][16];
    for (int g = 0; g < G; ++g) {
      const __m512 s = _mm512_mask_blend_ps(live, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), scores[g]);
      const float new_max = std::max(m_[g], _mm512_reduce_max_ps(s));
      // On the first chunk m is -inf and the correction is exp(-87), of no weight: acc and l are still zero.
      const float correction = _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(m_[g] - new_max)));
      const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
      l_[g] = l_[g] * correction + _mm512_reduce_add_ps(e);
      m_[g] = new_max;
      if (correction != 1.0f) {
        for (int i = 0; i < R; ++i) acc_[g][i] = _mm512_mul_ps(acc_[g][i], _mm512_set1_ps(correction));
      }
      _mm512_store_ps(weights[g], e);
    }
    for (int64_t t = 0; t < n; ++t) {
      __m512 v[R];
      load_row(values + t * HD, v);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(weights[g][t]);
        for (int i = 0; i < R; ++i) acc_[g][i] = _mm512_fmadd_ps(w, v[i], acc_[g][i]);
      }
    }
  }

  void finish(T* out) const {
    alignas(64) float row[HD];
    for (int g = 0; g < G; ++g) {
      const float inv = l_[g] > 0.0f ? 1.0f / l_[g] : 0.0f;  // length 0: zeros, not NaN
      for (int i = 0; i < R; ++i) _mm512_store_ps(row + 16 * i, _mm512_mul_ps(acc_[g][i], _mm512_set1_ps(inv)));
      for (int d = 0; d < HD; ++d) out[g * HD + d] = static_cast<T>(row[d]);
    }
  }
};

// One sequence's G query heads of one KV head over the blocks its table names; `cache` points at that KV head's
// rows in block 0.
template <int HD, int G, typename T>
void attend_group(const T* q, float scale, const T* cache, int64_t block_stride, int64_t kv_stride,
                  int64_t block_size, const int64_t* table, int64_t length, T* out) {
  GroupAttention<HD, G, T> state(q, scale);
  for (int64_t b = 0; b * block_size < length; ++b) {
    const T* keys = cache + table[b] * block_stride;
    const int64_t n = std::min(block_size, length - b * block_size);
    for (int64_t t = 0; t < n; t += kChunk) {
      state.chunk(keys + t * HD, keys + kv_stride + t * HD, std::min(kChunk, n - t));
    }
  }
  state.finish(out);
}

// The whole group, four query heads at a time (a fifth set of rows would no longer fit the 32 registers).
template <int HD, typename T>
void attend(const T* q, float scale, int64_t group, const T* cache, int64_t block_stride, int64_t kv_stride,
            int64_t block_size, const int64_t* table, int64_t length, T* out) {
  for (int64_t g = 0; g < group; g += 4) {
    const T* qg = q + g * HD;
    T* og = out + g * HD;
    switch (std::min<int64_t>(4, group - g)) {
      case 1: attend_group<HD, 1>(qg, scale, cache, block_stride, kv_stride, block_size, table, length, og); break;
      case 2: attend_group<HD, 2>(qg, scale, cache, block_stride, kv_stride, block_size, table, length, og); break;
      case 3: attend_group<HD, 3>(qg, scale, cache, block_stride, kv_stride, block_size, table, length, og); break;
      default: attend_group<HD, 4>(qg, scale, cache, block_stride, kv_stride, block_size, table, length, og);
    }
  }
}

}  // namespace pdserve_native::avx512

#endif  // __AVX512F__

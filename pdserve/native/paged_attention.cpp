// Decode attention read in place from the paged KV cache.
//
// One decode token per sequence attends over its context, which lives in the blocks its block table names. The
// torch path gathers every sequence's context into a contiguous copy per layer before attending; this kernel walks
// the block table once per (sequence, kv head) and keeps a running (online) softmax, so nothing is copied (the
// portable loops below widen a bf16 block into a tile that stays in L1; the AVX-512 ones for head_dim 64 and 128,
// in attention_avx512.h, widen rows in registers). All query heads of a kv head (GQA's group) are attended
// together, so each key and value is read once per group.
//
// layer_cache is one layer's view of the pool [num_blocks, 2, kv_heads, block_size, head_dim]; only the last three
// dimensions need to be dense, the block and K/V strides are taken from the tensor (the layer axis sits between
// them in the pool).

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_avx512.h"
#include "vec_math.h"

namespace {

using pdserve_native::exp_nonpositive;

// One block's n rows of head_dim values as fp32: fp32 blocks are read where they are (a block's rows are dense),
// bf16 blocks are widened into `tile`, which stays in L1.
inline const float* tile_f32(const float* src, float*, int64_t) { return src; }

inline const float* tile_f32(const c10::BFloat16* src, float* tile, int64_t count) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits = static_cast<uint32_t>(raw[i]) << 16;
    std::memcpy(&tile[i], &bits, sizeof(float));
  }
  return tile;
}

struct Shape {
  int64_t heads, kv_heads, group, block_size, head_dim, max_blocks;
  int64_t block_stride, kv_stride, head_stride, token_stride;
  float scale;
};

// Per-thread scratch: the group's queries, running max / sum / output, one block's scores and a widened tile.
struct Scratch {
  std::vector<float> q, m, l, acc, scores, tile;
  explicit Scratch(const Shape& s)
      : q(s.group * s.head_dim), m(s.group), l(s.group), acc(s.group * s.head_dim),
        scores(s.group * s.block_size), tile(s.block_size * s.head_dim) {}
};

// HD is head_dim when known at compile time (the common sizes), so the loops over it unroll into registers and
// a query row or an output row stays in registers across a block; 0 reads it from the shape.
template <int HD>
inline int64_t head_dim_of(const Shape& s) { return HD > 0 ? HD : s.head_dim; }

template <int HD, typename T>
void score_block(const Shape& s, const T* keys, int64_t n, Scratch& w) {
  const int64_t D = head_dim_of<HD>(s);
  const float* k = tile_f32(keys, w.tile.data(), n * D);
  for (int64_t g = 0; g < s.group; ++g) {
    const float* q = w.q.data() + g * D;
    float* sc = w.scores.data() + g * s.block_size;
    for (int64_t t = 0; t < n; ++t) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += q[d] * k[t * D + d];
      sc[t] = dot;
    }
  }
}

// Folds one block's scores into the running softmax; leaves exp(score - max) in w.scores.
void softmax_block(const Shape& s, int64_t n, Scratch& w) {
  for (int64_t g = 0; g < s.group; ++g) {
    float* sc = w.scores.data() + g * s.block_size;
    float block_max = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sc[t]);
    const float new_max = std::max(w.m[g], block_max);
    const float correction = exp_nonpositive(w.m[g] - new_max);  // 0 on the first block (m = -inf)
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      sc[t] = exp_nonpositive(sc[t] - new_max);
      sum += sc[t];
    }
    w.l[g] = w.l[g] * correction + sum;
    w.m[g] = new_max;
    if (correction != 1.0f) {
      float* acc = w.acc.data() + g * s.head_dim;
#pragma omp simd
      for (int64_t d = 0; d < s.head_dim; ++d) acc[d] *= correction;
    }
  }
}

template <int HD, typename T>
void accumulate_block(const Shape& s, const T* values, int64_t n, Scratch& w) {
  const int64_t D = head_dim_of<HD>(s);
  const float* v = tile_f32(values, w.tile.data(), n * D);
  for (int64_t g = 0; g < s.group; ++g) {
    const float* p = w.scores.data() + g * s.block_size;
    float* acc = w.acc.data() + g * D;
    for (int64_t t = 0; t < n; ++t) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += p[t] * v[t * D + d];
    }
  }
}

// One sequence and one kv head: its query group against the sequence's `length` keys, block by block.
template <int HD, typename T>
void attend(const Shape& s, const T* q, const T* cache, const int64_t* table, int64_t length, T* out,
            Scratch& w) {
  const int64_t D = head_dim_of<HD>(s);
  for (int64_t i = 0; i < s.group * D; ++i) w.q[i] = static_cast<float>(q[i]) * s.scale;
  std::fill(w.m.begin(), w.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.end(), 0.0f);
  std::fill(w.acc.begin(), w.acc.end(), 0.0f);
  for (int64_t b = 0; b * s.block_size < length; ++b) {
    const int64_t n = std::min(s.block_size, length - b * s.block_size);
    const T* keys = cache + table[b] * s.block_stride;
    score_block<HD>(s, keys, n, w);
    softmax_block(s, n, w);
    accumulate_block<HD>(s, keys + s.kv_stride, n, w);
  }
  for (int64_t g = 0; g < s.group; ++g) {
    const float inv = w.l[g] > 0.0f ? 1.0f / w.l[g] : 0.0f;  // length 0: zeros, not NaN
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(w.acc[g * D + d] * inv);
  }
}

template <int HD, typename T>
void run(const Shape& s, const at::Tensor& q, const at::Tensor& cache, const at::Tensor& table,
         const at::Tensor& lengths, at::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* cp = cache.data_ptr<T>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, q.size(0) * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch w(s);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / s.kv_heads, h = item % s.kv_heads;
      const int64_t offset = (seq * s.heads + h * s.group) * s.head_dim;
      const T* cache_h = cp + h * s.head_stride;
      const int64_t* table_s = tp + seq * s.max_blocks;
#if defined(__AVX512F__)
      if constexpr (HD == 64 || HD == 128) {
        pdserve_native::avx512::attend<HD>(qp + offset, s.scale, s.group, cache_h, s.block_stride, s.kv_stride,
                                           s.block_size, table_s, lp[seq], op + offset);
        continue;
      }
#endif
      attend<HD>(s, qp + offset, cache_h, table_s, lp[seq], op + offset, w);
    }
  });
}

template <typename T>
void dispatch_head_dim(const Shape& s, const at::Tensor& q, const at::Tensor& cache, const at::Tensor& table,
                       const at::Tensor& lengths, at::Tensor& out) {
  switch (s.head_dim) {
    case 64: return run<64, T>(s, q, cache, table, lengths, out);
    case 128: return run<128, T>(s, q, cache, table, lengths, out);
    default: return run<0, T>(s, q, cache, table, lengths, out);
  }
}

at::Tensor paged_decode(const at::Tensor& q_in, const at::Tensor& cache, const at::Tensor& table_in,
                        const at::Tensor& lengths_in, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && cache.dim() == 5 && table_in.dim() == 2 && lengths_in.dim() == 1,
              "paged_decode: q [decodes, heads, head_dim], cache [blocks, 2, kv_heads, block_size, head_dim], "
              "table [decodes, max_blocks], lengths [decodes]");
  TORCH_CHECK(q_in.device().is_cpu() && cache.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(q_in.scalar_type() == cache.scalar_type(), "paged_decode: q and cache differ in dtype");
  const int64_t D = cache.size(4), bs = cache.size(3), kvh = cache.size(2);
  TORCH_CHECK(cache.size(1) == 2 && q_in.size(2) == D && q_in.size(1) % kvh == 0, "paged_decode: shapes disagree");
  TORCH_CHECK(cache.stride(4) == 1 && cache.stride(3) == D, "paged_decode: a block's rows must be dense");
  TORCH_CHECK(table_in.size(0) == q_in.size(0) && lengths_in.size(0) == q_in.size(0),
              "paged_decode: one table row and one length per decode");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor table = table_in.to(at::kLong).contiguous();
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  TORCH_CHECK(lengths.numel() == 0 || lengths.max().item<int64_t>() <= table.size(1) * bs,
              "paged_decode: a length exceeds its block table");
  at::Tensor out = at::empty_like(q);
  const Shape s{q.size(1), kvh, q.size(1) / kvh, bs, D, table.size(1),
                cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), static_cast<float>(scale)};
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "paged_decode: fp32 or bf16 only");
  if (q.scalar_type() == at::kFloat) {
    dispatch_head_dim<float>(s, q, cache, table, lengths, out);
  } else {
    dispatch_head_dim<c10::BFloat16>(s, q, cache, table, lengths, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def("paged_decode(Tensor q, Tensor layer_cache, Tensor block_table, Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_decode", &paged_decode); }

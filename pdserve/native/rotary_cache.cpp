// Rotary position embedding applied in place to q and k, and this step's k and v written into the paged cache, in
// one pass (vLLM's rotary_embedding and reshape_and_cache, fused).
//
// In plain torch the rotation is ~20 ops per layer (two table lookups, then per tensor a chunk, four muls, a sub,
// an add and a cat) and the cache write two advanced-index assignments; at batch 1 each op costs more in dispatch
// than in arithmetic. The arithmetic follows the torch path (Hugging Face Llama's rotate-half): each product and
// the sum or difference are rounded to the tensor's dtype, as torch's bf16 ops round them.
//
// q [tokens, heads, head_dim] and k, v [tokens, kv_heads, head_dim] may be strided views (a split of the fused
// projection); only their last dimension must be dense. layer_cache is one layer's view of the pool
// [num_blocks, 2, kv_heads, block_size, head_dim], its strides taken from the tensor.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "vec_math.h"

namespace {

using pdserve_native::load_f32;
using pdserve_native::round_to;
using pdserve_native::store_f32;

// One head's row rotated in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over the two halves. Not
// contracted into FMAs, so fp32 rounds as torch's separate mul and sub do (with FMAs it differed by an ulp).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_row(T* __restrict__ x, const T* __restrict__ cos,
                                                             const T* __restrict__ sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load_f32(x + i), x2 = load_f32(x + half + i);
    const float c = load_f32(cos + i), s = load_f32(sin + i);
    store_f32(x + i, round_to<T>(x1 * c) - round_to<T>(x2 * s));
    store_f32(x + half + i, round_to<T>(x2 * c) + round_to<T>(x1 * s));
  }
}

template <typename T>
void copy_row(const T* __restrict__ src, T* __restrict__ dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

struct Views {
  at::Tensor q, k, v, cache;
  const int64_t* positions;
  const int64_t* slot_block;
  const int64_t* slot_offset;
};

template <typename T>
void run(const Views& a, const at::Tensor& cos_table, const at::Tensor& sin_table) {
  const int64_t tokens = a.q.size(0), heads = a.q.size(1), kv_heads = a.k.size(1), D = a.q.size(2), half = D / 2;
  T* q = a.q.data_ptr<T>();
  T* k = a.k.data_ptr<T>();
  const T* v = a.v.data_ptr<T>();
  T* cache = a.cache.data_ptr<T>();
  const T* cos = cos_table.data_ptr<T>();
  const T* sin = sin_table.data_ptr<T>();
  // A few flops per element: threads pay only for prefill chunks; a decode batch (64 tokens) stays on the calling
  // thread, where a parallel region would wait on a second core that another process may hold.
  const int64_t grain = std::max<int64_t>(1, 131072 / ((heads + 2 * kv_heads) * D));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + a.positions[t] * cos_table.stride(0);
      const T* s = sin + a.positions[t] * sin_table.stride(0);
      for (int64_t h = 0; h < heads; ++h) rotate_row<T>(q + t * a.q.stride(0) + h * a.q.stride(1), c, s, half);
      T* slot = cache + a.slot_block[t] * a.cache.stride(0) + a.slot_offset[t] * a.cache.stride(3);
      for (int64_t h = 0; h < kv_heads; ++h) {
        T* kr = k + t * a.k.stride(0) + h * a.k.stride(1);
        rotate_row<T>(kr, c, s, half);
        copy_row<T>(kr, slot + h * a.cache.stride(2), D);
        copy_row<T>(v + t * a.v.stride(0) + h * a.v.stride(1), slot + a.cache.stride(1) + h * a.cache.stride(2), D);
      }
    }
  });
}

void check(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
           const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& cache, const at::Tensor& slot_block,
           const at::Tensor& slot_offset) {
  const char* op = "rotary_embedding_and_cache";
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && cache.dim() == 5, op,
              ": q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim], "
              "cache [blocks, 2, kv_heads, block_size, head_dim]");
  const int64_t tokens = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == D && D % 2 == 0 && cache.size(1) == 2 &&
                  cache.size(2) == k.size(1) && cache.size(4) == D, op, ": shapes disagree");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == D / 2, op,
              ": cos and sin are [positions, head_dim / 2]");
  for (const at::Tensor* t : {&q, &k, &v, &cos, &sin, &cache}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == q.scalar_type(), op, ": CPU tensors of one dtype");
    TORCH_CHECK(t->stride(-1) == 1, op, ": the last dimension must be dense");
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, op, ": fp32 or bf16 only");
  for (const at::Tensor* t : {&positions, &slot_block, &slot_offset}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == tokens && t->scalar_type() == at::kLong && t->is_contiguous(), op,
                ": positions and slots are one int64 per token");
  }
  // Out-of-range indices would write outside the cache: checked here, as torch's indexing checks them.
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* block = slot_block.data_ptr<int64_t>();
  const int64_t* offset = slot_offset.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), op, ": position ", pos[t], " is past the rotary table");
    TORCH_CHECK(block[t] >= 0 && block[t] < cache.size(0) && offset[t] >= 0 && offset[t] < cache.size(3), op,
                ": slot (", block[t], ", ", offset[t], ") is outside the cache");
  }
}

void rotary_embedding_and_cache(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& cache, const at::Tensor& slot_block, const at::Tensor& slot_offset) {
  check(positions, q, k, v, cos, sin, cache, slot_block, slot_offset);
  const Views a{q, k, v, cache, positions.data_ptr<int64_t>(), slot_block.data_ptr<int64_t>(),
                slot_offset.data_ptr<int64_t>()};
  if (q.scalar_type() == at::kFloat) {
    run<float>(a, cos, sin);
  } else {
    run<c10::BFloat16>(a, cos, sin);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rotary_embedding_and_cache(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, "
        "Tensor sin, Tensor(c!) layer_cache, Tensor slot_block, Tensor slot_offset) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("rotary_embedding_and_cache", &rotary_embedding_and_cache); }

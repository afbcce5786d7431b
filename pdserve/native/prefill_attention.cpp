// Prefill attention read in place from the paged KV cache: each prefill chunk's new tokens attend causally over
// the chunk's cached context and over themselves (their k and v are already in the cache, written by the fused
// rotary op), flash style: an online softmax over tiles of keys, nothing of size tokens x keys materialized.
//
// The two products per tile (S = Q K^T and O += P V) go through oneDNN's batch-reduce GEMM micro-kernel as torch
// exposes it (at::native::cpublas::brgemm, what torch's own CPU flash attention uses for fp16): AMX tiles for bf16
// where the CPU has them, AVX-512 for fp32. torch's SDPA computes the same tiles through general GEMM calls, each
// a library call with its own setup, and for a chunk with cached context it needs the context gathered into a copy
// and a mask tensor; here every key is read from its block once per (chunk, kv head) into a packed tile.
//
// Work is split over (chunk, kv head, block of query tokens); the query heads of a kv head (GQA's group) are rows
// of one GEMM, so each packed key tile serves all of them. Items are taken heaviest first (the last query blocks
// of a causal chunk see the most keys) from a shared counter, which keeps two threads busy to the end.
//
// q [tokens, heads, head_dim] may be a strided view (a split of the fused projection); only its last dimension
// must be dense. out [tokens, heads, head_dim] is dense; only the chunks' rows are written. layer_cache is one
// layer's view of the pool [num_blocks, 2, kv_heads, block_size, head_dim], its strides taken from the tensor.

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_avx512.h"
#include "vec_math.h"

namespace {

using pdserve_native::exp_nonpositive;
using pdserve_native::load_f32;
using pdserve_native::store_f32;

// Keys per tile (S's columns, P V's reduction), in steps of kStep: a query block's last tile is cut to the steps it
// sees. Each brgemm call costs ~1 us of setup in torch's wrapper, so tiles are wide enough to bury it.
constexpr int64_t kTile = 256;
constexpr int64_t kStep = 64;
constexpr int64_t kQueryBlock = 32;  // query tokens per work item (rows = tokens x the group's heads)

// brgemm takes B packed in pairs along the reduction dimension for bf16 (VNNI: B[k][n] at ((k/2) N + n) 2 + k%2)
// and plainly row-major for fp32.
template <typename T>
constexpr int64_t kPair = 1;
template <>
constexpr int64_t kPair<c10::BFloat16> = 2;

template <typename T>
inline int64_t packed_index(int64_t k, int64_t n, int64_t N) {
  return ((k / kPair<T>) * N + n) * kPair<T> + k % kPair<T>;
}

struct Chunk {
  int64_t start, end, context, keys, first_tile;
  const int64_t* table;
};

struct Geometry {
  int64_t heads, kv_heads, group, D, block_size, tiles;
  int64_t block_stride, kv_stride, head_stride, token_stride;  // the cache's
  int64_t q_token_stride, q_head_stride;
  float scale;
};

// The keys [first, first + kTile) of one chunk and kv head into a K^T tile ([D x kTile]) and a V tile
// ([kTile x D]), packed for brgemm; keys past the chunk's end are zeros (every row masks them).
template <typename T>
void pack_tile(const Geometry& g, const T* cache_h, const Chunk& c, int64_t first, T* kt, T* v) {
  const int64_t D = g.D;
  for (int64_t n = 0; n < kTile; ++n) {
    const int64_t key = first + n;
    if (key >= c.keys) {
      for (int64_t d = 0; d < D; ++d) {
        kt[packed_index<T>(d, n, kTile)] = T(0.0f);
        v[packed_index<T>(n, d, D)] = T(0.0f);
      }
      continue;
    }
    const T* k_row = cache_h + c.table[key / g.block_size] * g.block_stride + (key % g.block_size) * g.token_stride;
    const T* v_row = k_row + g.kv_stride;
    for (int64_t d = 0; d < D; ++d) {
      kt[packed_index<T>(d, n, kTile)] = k_row[d];
      v[packed_index<T>(n, d, D)] = v_row[d];
    }
  }
}

struct Item {
  int64_t chunk, head, first_query, tiles;  // tiles: how many the block's last query sees (its cost)
};

// Per-thread buffers of one work item: the group's query rows, a tile of scores and of probabilities, the running
// max, sum and output of every row.
template <typename T>
struct Scratch {
  std::vector<T> q, p;
  std::vector<float> s, o, m, l;
  Scratch(int64_t rows, int64_t D)
      : q(rows * D), p(rows * kTile), s(rows * kTile), o(rows * D), m(rows), l(rows) {}
};

// The running softmax of one row over a tile's first `cols` scores, of which it sees the first `visible`: folds
// them in, leaves the row's probabilities (rounded to T, as torch's flash attention rounds them before P V; zeros
// where unseen) in p and rescales the row's output o. m is the running max of the scaled scores.
template <typename T>
void softmax_row(const float* s, T* p, int64_t cols, int64_t visible, float scale, float& m, float& l, float* o,
                 int64_t D) {
  float raw_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : raw_max)
  for (int64_t i = 0; i < visible; ++i) raw_max = std::max(raw_max, s[i]);
  const float new_max = std::max(m, raw_max * scale);
  const float correction = exp_nonpositive(m - new_max);  // 0 on the first tile (m = -inf)
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < cols; ++i) {
    const float e = i < visible ? exp_nonpositive(s[i] * scale - new_max) : 0.0f;
    sum += e;
    store_f32(p + i, e);
  }
  l = l * correction + sum;
  m = new_max;
  if (correction != 1.0f) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] *= correction;
  }
}

#if defined(__AVX512F__)
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }

inline void store16(c10::BFloat16* p, __m512 x) {  // round to nearest even, as store_f32 does
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
#else
  const __m512i bits = _mm512_castps_si512(x);  // probabilities: never NaN
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
#endif
}

inline __mmask16 lanes(int64_t n) { return static_cast<__mmask16>((1u << std::clamp<int64_t>(n, 0, 16)) - 1u); }

// 2^t for t <= 0: 2^round(t) by vscalefps times a degree-6 polynomial for 2^f on [-1/2, 1/2] (fitted on Chebyshev
// nodes: within 3e-9 before fp32 rounding, so within about an ulp), ten instructions where the decode kernel's
// exp takes seventeen; a prefill takes the exponential of every score, so this is most of its softmax. t is
// clamped at -100: smaller probabilities (< 1e-30) would be subnormal, which slow P V's FMAs and change nothing.
inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-100.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5469732e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3400433e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180253e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503272e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// softmax_row in sixteen-lane registers (cols a multiple of 16, D of 16). The exponentials of the fully visible
// sixteens go four at a time, each with its own sum, so their dependency chains overlap.
template <typename T>
void softmax_row_avx512(const float* s, T* p, int64_t cols, int64_t visible, float scale, float& m, float& l,
                        float* o, int64_t D) {
  constexpr float kLog2e = 1.44269504088896341f;  // exp(x) = 2^(x log2 e), the scale folded into one FMA
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < visible; i += 16) {
    vmax = _mm512_mask_max_ps(vmax, lanes(visible - i), vmax, _mm512_loadu_ps(s + i));
  }
  const float new_max = std::max(m, _mm512_reduce_max_ps(vmax) * scale);
  const float correction = _mm512_cvtss_f32(exp2_nonpositive(_mm512_set1_ps((m - new_max) * kLog2e)));
  const __m512 vscale = _mm512_set1_ps(scale * kLog2e), vnew = _mm512_set1_ps(new_max * kLog2e);
  const auto prob = [&](int64_t i) { return exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + i), vscale, vnew)); };
  __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const int64_t full = visible / 16 * 16;
  int64_t i = 0;
  for (; i + 64 <= full; i += 64) {
    __m512 e[4];
    for (int u = 0; u < 4; ++u) e[u] = prob(i + 16 * u);
    for (int u = 0; u < 4; ++u) {
      sum[u] = _mm512_add_ps(sum[u], e[u]);
      store16(p + i + 16 * u, e[u]);
    }
  }
  for (; i < full; i += 16) {
    const __m512 e = prob(i);
    sum[0] = _mm512_add_ps(sum[0], e);
    store16(p + i, e);
  }
  if (i < visible) {
    const __m512 e = _mm512_maskz_mov_ps(lanes(visible - i), prob(i));
    sum[1] = _mm512_add_ps(sum[1], e);
    store16(p + i, e);
    i += 16;
  }
  for (; i < cols; i += 16) store16(p + i, _mm512_setzero_ps());
  l = l * correction + _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3])));
  m = new_max;
  if (correction != 1.0f) {
    const __m512 c = _mm512_set1_ps(correction);
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), c));
  }
}
#endif

// One tile's scores (`cols` of them per row) into the running softmax of every row of the item.
template <typename T>
void softmax_tile(const Geometry& g, const Chunk& c, const Item& it, int64_t rows, int64_t first_key, int64_t cols,
                  Scratch<T>& w) {
  for (int64_t r = 0; r < rows; ++r) {
    T* p = w.p.data() + r * kTile;
    // The row's token sees keys up to its own position: context + its index in the chunk.
    const int64_t visible = std::min<int64_t>(cols, c.context + it.first_query + r / g.group - first_key + 1);
    if (visible <= 0) {
      std::fill(p, p + cols, T(0.0f));
      continue;
    }
    const float* s = w.s.data() + r * kTile;
    float* o = w.o.data() + r * g.D;
#if defined(__AVX512F__)
    if (g.D % 16 == 0) {
      softmax_row_avx512(s, p, cols, visible, g.scale, w.m[r], w.l[r], o, g.D);
      continue;
    }
#endif
    softmax_row(s, p, cols, visible, g.scale, w.m[r], w.l[r], o, g.D);
  }
}

template <typename T>
void attend_item(const Geometry& g, const Chunk& c, const Item& it, const T* q, const T* kt_all, const T* v_all,
                 T* out, Scratch<T>& w) {
  const int64_t D = g.D, G = g.group;
  const int64_t tokens = std::min(kQueryBlock, c.end - c.start - it.first_query), rows = tokens * G;
  for (int64_t t = 0; t < tokens; ++t) {
    const T* src = q + (c.start + it.first_query + t) * g.q_token_stride + it.head * G * g.q_head_stride;
    for (int64_t h = 0; h < G; ++h) std::memcpy(&w.q[(t * G + h) * D], src + h * g.q_head_stride, D * sizeof(T));
  }
  std::fill(w.o.begin(), w.o.begin() + rows * D, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);
  constexpr bool vnni = kPair<T> == 2;
  const int64_t tile_elems = D * kTile;
  // The last key the item's last row sees; past it nothing is computed but the rest of its step.
  const int64_t last_key = c.context + it.first_query + tokens - 1;
  for (int64_t j = 0; j < it.tiles; ++j) {
    const int64_t tile = (it.head * g.tiles + c.first_tile + j) * tile_elems;
    const int64_t cols = std::min(kTile, (last_key - j * kTile) / kStep * kStep + kStep);
    at::native::cpublas::brgemm(rows, cols, D, D, kTile, kTile, false, w.q.data(), kt_all + tile, w.s.data(), vnni);
    softmax_tile(g, c, it, rows, j * kTile, cols, w);
    at::native::cpublas::brgemm(rows, D, cols, kTile, D, D, true, w.p.data(), v_all + tile, w.o.data(), vnni);
  }
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = t * G + h;
      const float inv = w.l[r] > 0.0f ? 1.0f / w.l[r] : 0.0f;
      T* dst = out + ((c.start + it.first_query + t) * g.heads + it.head * G + h) * D;
      for (int64_t d = 0; d < D; ++d) store_f32(dst + d, w.o[r * D + d] * inv);
    }
  }
}

template <typename T>
void run(const Geometry& g, const std::vector<Chunk>& chunks, const at::Tensor& q, const at::Tensor& cache,
         at::Tensor& out) {
  const int64_t tile_elems = g.D * kTile;
  at::Tensor kt = at::empty({g.kv_heads * g.tiles * tile_elems}, q.options());
  at::Tensor v = at::empty({g.kv_heads * g.tiles * tile_elems}, q.options());
  T* kt_all = kt.data_ptr<T>();
  T* v_all = v.data_ptr<T>();
  const T* cp = cache.data_ptr<T>();
  at::parallel_for(0, g.kv_heads * g.tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / g.tiles, tile = i % g.tiles;
      size_t c = 0;
      while (c + 1 < chunks.size() && chunks[c + 1].first_tile <= tile) ++c;
      pack_tile(g, cp + h * g.head_stride, chunks[c], (tile - chunks[c].first_tile) * kTile,
                kt_all + i * tile_elems, v_all + i * tile_elems);
    }
  });
  std::vector<Item> items;
  for (size_t c = 0; c < chunks.size(); ++c) {
    for (int64_t first = 0; first < chunks[c].end - chunks[c].start; first += kQueryBlock) {
      const int64_t last_key = chunks[c].context + std::min(first + kQueryBlock, chunks[c].end - chunks[c].start) - 1;
      for (int64_t h = 0; h < g.kv_heads; ++h) items.push_back({static_cast<int64_t>(c), h, first, last_key / kTile + 1});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.tiles > b.tiles; });
  std::atomic<size_t> next{0};
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch<T> w(kQueryBlock * g.group, g.D);
    for (size_t i = next++; i < items.size(); i = next++) {
      attend_item(g, chunks[items[i].chunk], items[i], qp, kt_all, v_all, op, w);
    }
    at::native::cpublas::brgemm_release(kPair<T> == 2);
  });
}

std::vector<Chunk> chunks_of(const at::Tensor& spans, const at::Tensor& tables, int64_t tokens, int64_t block_size,
                             int64_t num_blocks, int64_t* total_tiles) {
  const char* op = "paged_prefill";
  std::vector<Chunk> chunks;
  const int64_t* sp = spans.data_ptr<int64_t>();
  *total_tiles = 0;
  for (int64_t c = 0; c < spans.size(0); ++c) {
    const int64_t start = sp[3 * c], end = sp[3 * c + 1], context = sp[3 * c + 2], keys = context + end - start;
    TORCH_CHECK(0 <= start && start < end && end <= tokens && context >= 0, op, ": chunk ", c, " spans [", start,
                ", ", end, ") with context ", context, " outside the ", tokens, " query rows");
    TORCH_CHECK(keys <= tables.size(1) * block_size, op, ": chunk ", c, "'s ", keys, " keys exceed its block table");
    const int64_t* table = tables.data_ptr<int64_t>() + c * tables.size(1);
    for (int64_t b = 0; b * block_size < keys; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, op, ": block ", table[b], " is outside the cache");
    }
    chunks.push_back({start, end, context, keys, *total_tiles, table});
    *total_tiles += (keys + kTile - 1) / kTile;
  }
  return chunks;
}

void paged_prefill(const at::Tensor& q, const at::Tensor& cache, at::Tensor& out, const at::Tensor& spans_in,
                   const at::Tensor& tables_in, double scale) {
  const char* op = "paged_prefill";
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && out.sizes() == q.sizes() && out.is_contiguous(), op,
              ": q [tokens, heads, head_dim], out like q and dense, cache [blocks, 2, kv_heads, block_size, head_dim]");
  TORCH_CHECK(spans_in.dim() == 2 && spans_in.size(1) == 3 && tables_in.dim() == 2 &&
                  tables_in.size(0) == spans_in.size(0), op, ": spans [chunks, 3] and tables [chunks, max_blocks]");
  const at::Tensor* operands[] = {&q, &cache, &out};
  for (const at::Tensor* t : operands) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == q.scalar_type(), op, ": CPU tensors of one dtype");
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, op, ": fp32 or bf16 only");
  const int64_t D = cache.size(4), kvh = cache.size(2);
  TORCH_CHECK(cache.size(1) == 2 && q.size(2) == D && q.size(1) % kvh == 0 && D % 2 == 0, op, ": shapes disagree");
  TORCH_CHECK(cache.stride(4) == 1 && q.stride(2) == 1, op, ": the last dimension must be dense");
  const at::Tensor spans = spans_in.to(at::kLong).contiguous();
  const at::Tensor tables = tables_in.to(at::kLong).contiguous();
  Geometry g{q.size(1), kvh, q.size(1) / kvh, D, cache.size(3), 0, cache.stride(0), cache.stride(1),
             cache.stride(2), cache.stride(3), q.stride(0), q.stride(1), static_cast<float>(scale)};
  const std::vector<Chunk> chunks = chunks_of(spans, tables, q.size(0), g.block_size, cache.size(0), &g.tiles);
  if (chunks.empty()) return;
  if (q.scalar_type() == at::kFloat) {
    run<float>(g, chunks, q, cache, out);
  } else {
    run<c10::BFloat16>(g, chunks, q, cache, out);
  }
}

// Whether brgemm serves this dtype here: bf16 needs AMX (oneDNN packs only for it), fp32 oneDNN's micro-kernels.
bool prefill_supported(at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return at::native::cpublas::could_pack(at::kBFloat16);
  if (dtype != at::kFloat) return false;
  try {
    float a[16] = {}, b[16 * 16] = {}, c[16] = {};
    at::native::cpublas::brgemm(1, 16, 16, 16, 16, 16, false, a, b, c, false);
    at::native::cpublas::brgemm_release(false);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("paged_prefill(Tensor q, Tensor layer_cache, Tensor(a!) out, Tensor spans, Tensor block_tables, "
        "float scale) -> ()");
  m.def("prefill_supported(ScalarType dtype) -> bool", &prefill_supported);  // no tensors: one kernel for all
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_prefill", &paged_prefill); }

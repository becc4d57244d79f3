// Attention of T float32 queries against a float16 KV cache view, on the CPU: one kernel for prefill chunks,
// verification steps and 1-token decoding, whose result for a query row is the same bits however many rows go
// with it, wherever the batch starts and whatever the number of threads.
//
// q (Hq, T, D) float32; k, v (Hkv, L, D) float16 views of a cache laid out [context | the T new keys], any head
// and row strides, each row's D contiguous; origin: the absolute position of view index 0. Query t sits at view
// index i = L - T + t and reads keys j <= i, and j > i - window with a window (window <= 0: none). Output
// (Hq, T, D) float32 = softmax(scale q k^T) v on the float16 keys and values (widened exactly), up to float32
// rounding.
//
// The order of arithmetic of one output element depends only on its query's position and the keys it reads:
// - keys are cut into blocks of kBlock and segments of kSegment keys, both aligned to absolute positions
//   (origin + j), never to the view's start or to the batch;
// - a score is the FMA chain over d = 0 .. D-1 of the scaled query and the key, keys across vector lanes (no
//   horizontal sums);
// - within a segment, an online softmax runs over its blocks in increasing position: per block the row's maximum
//   (exact, in any order), its weights exp(s - m) (vector_exp.h), their sum added lane-wise to a running vector of
//   sums, and the output's block sum, the FMA chain over the block's keys in order, added to the rescaled output
//   in one FMA. Keys a row does not read get weight 0 exactly, which leaves every sum as it was, so a row gives the
//   same bits whichever other rows share its tiles;
// - a row's segments are merged in segment order, then its output divided by its sum.
// Threads split the work only by (KV head, group of rows, segment): no element's order depends on them.
//
// For many rows the G = Hq / Hkv query heads of a KV head and the T queries are R = G T rows, ordered position by
// position (t G + g), in groups of kGroupRows. A unit of work widens and transposes each block's keys and widens
// its values once for the whole group; tiles of a few rows then read them from L1: their scores (rows x 64 keys in
// registers), the softmax step, and the values' product (rows x D columns in registers). Segments give a 1-row
// decode its parallelism (flash-decoding). Three bodies: AVX-512 and AVX2 (F16C) for D a multiple of their
// width, 64 and 128 compiled for their size, and plain C++ for everything else, picked by isa.h.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "isa.h"
#include "vector_exp.h"

namespace {

using triforce_cpu::chosen_isa;
using triforce_cpu::Isa;

constexpr int64_t kBlock = 64;        // keys per online-softmax step, aligned to absolute positions
constexpr int64_t kSegment = 2048;    // keys per segment merged at the end, aligned to absolute positions
constexpr int64_t kGroupRows = 96;    // query rows per unit of work, which share each block's widened K and V
constexpr int64_t kTileRows = 24;     // rows whose scores and weights are taken together before their values
constexpr int64_t kMaxDim = 256;     // the widest head the vector bodies take
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

constexpr int64_t kAhead = 2;         // blocks between the one read and the one prefetched

// prefetcht1 (into L2) of the lines of n elements from `at` (an address past the cache's end is fine: prefetches never
// fault); in assembly, which the optimiser keeps (it dropped __builtin_prefetch from the unit's loop)
template <typename T>
inline void prefetch_row(const T* at, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(T))
    asm volatile("prefetcht1 %0" : : "m"(*reinterpret_cast<const char*>(at + i)));
}

inline int64_t floor_to(int64_t x, int64_t step) { return x / step * step; }  // x >= 0
inline int64_t segment_of(int64_t position) { return position / kSegment; }

struct Problem {
  const float* q;  // (Hkv, R, D) scaled queries, row r = t G + g being query head h G + g, query t
  const at::Half *k, *v;
  int64_t k_head, k_row, v_head, v_row;  // strides, in elements
  int64_t rows, group, queries, keys, dim, origin, window;
  int64_t first_segment, segments;  // the segments any row reads
  float* partials;                  // (Hkv, segments, R, 2 + D): maximum, sum of exponentials, unnormalised output

  int64_t last_key(int64_t r) const { return keys - queries + r / group; }
  int64_t first_key(int64_t r) const { return window > 0 ? std::max<int64_t>(0, last_key(r) - window + 1) : 0; }
  float* partial(int64_t head, int64_t segment, int64_t r) const {
    return partials + ((head * segments + segment - first_segment) * rows + r) * (2 + dim);
  }
};

struct Body {
  void (*attend_unit)(const Problem&, int64_t head, int64_t row0, int64_t rows, int64_t segment, float* scratch);
  void (*combine_row)(const Problem&, int64_t head, int64_t r, float* out);
  int64_t (*scratch)(int64_t dim);
};

// exp as vector_exp.h computes it, one float at a time: the same clamp, rounding, polynomial and scaling.
inline float exp_scalar(float x) {
  using namespace triforce_cpu;
  const float clamped = std::max(std::min(x, kExpHigh), kExpLow);
  const float n = std::nearbyint(clamped * kLog2e);
  const float r = std::fma(-n, kLn2Low, std::fma(-n, kLn2High, clamped));
  float p = std::fma(kExpPoly[0], r, kExpPoly[1]);
  for (int i = 2; i < 6; ++i) p = std::fma(p, r, kExpPoly[i]);
  p = std::fma(p, r * r, r + 1.0f);
  return x < kExpLow ? 0.f : std::ldexp(p, int(n));
}

}  // namespace

// ---- AVX-512: 16 keys or 16 columns of D a register

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace avx512 {
namespace {

struct Ops {
  static constexpr int64_t kLanes = 16;
  static constexpr int kScoreRows = 6;     // x 4 key vectors: 24 accumulators
  static constexpr int kScoreKeys = 4;
  static constexpr int kValueRows = 6;     // x 4 column vectors: 24 accumulators
  static constexpr int kValueColumns = 4;
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* at) { return _mm512_loadu_ps(at); }
  static V load(const at::Half* at) { return widen16(at); }
  static void store(float* at, V x) { _mm512_storeu_ps(at, x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V exp(V x) { return triforce_cpu::exp512(x); }
  static float first(V x) { return _mm512_cvtss_f32(x); }
  static float reduce_add(V x) { return _mm512_reduce_add_ps(x); }
  static float reduce_max(V x) { return _mm512_reduce_max_ps(x); }
  // -inf in the lanes whose index lane0 + i lies outside [lo, hi]
  static V hide(V x, int64_t lane0, int64_t lo, int64_t hi) {
    const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(int32_t(lane0)),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __mmask16 outside = _mm512_cmplt_epi32_mask(index, _mm512_set1_epi32(int32_t(lo))) |
                              _mm512_cmpgt_epi32_mask(index, _mm512_set1_epi32(int32_t(hi)));
    return _mm512_mask_blend_ps(outside, x, _mm512_set1_ps(kMinusInf));
  }
  static V widen16(const at::Half* at) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
  }
  static void widen(const at::Half* from, float* to, int64_t n) {
    for (int64_t i = 0; i < n; i += kLanes) store(to + i, widen16(from + i));
  }
};

// r[i] (row i of a 16 x 16 tile) -> r[c] (column c): unpacks within 128-bit lanes, then a 4 x 4 transpose of
// the lanes.
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4 i + k], lane L: column 4 L + k of rows 4 i .. 4 i + 3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 a = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44), b = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xEE);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44);
    const __m512 d = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xEE);
    t[k] = _mm512_shuffle_f32x4(a, c, 0x88);
    t[4 + k] = _mm512_shuffle_f32x4(a, c, 0xDD);
    t[8 + k] = _mm512_shuffle_f32x4(b, d, 0x88);
    t[12 + k] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// keys_t (D, kBlock) = the block's keys [ja, jb) (rows row_stride apart) widened, for every 16-key group that
// holds one of them; the group's other keys are 0.
inline void transpose_keys(const at::Half* block, int64_t row_stride, int64_t ja, int64_t jb, int64_t dim,
                           float* keys_t, int64_t ahead) {
  alignas(64) float rows[16 * kMaxDim];  // the group's keys widened row by row: the cache is read in order
  for (int64_t g = ja / 16 * 16; g < jb; g += 16) {
    for (int64_t i = 0; i < 16; ++i) {
      prefetch_row(block + (ahead + g + i) * row_stride, dim);
      if (g + i >= ja && g + i < jb)
        Ops::widen(block + (g + i) * row_stride, rows + i * dim, dim);
      else
        std::fill(rows + i * dim, rows + (i + 1) * dim, 0.f);
    }
    for (int64_t d = 0; d < dim; d += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(rows + i * dim + d);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(keys_t + (d + i) * kBlock + g, r[i]);
    }
  }
}

#include "cache_attention_body.h"

}  // namespace
}  // namespace avx512
#pragma GCC pop_options

// ---- AVX2 with F16C: 8 keys or 8 columns a register

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
namespace {

struct Ops {
  static constexpr int64_t kLanes = 8;
  static constexpr int kScoreRows = 3;     // x 4 key vectors: 12 accumulators of 16 registers
  static constexpr int kScoreKeys = 4;
  static constexpr int kValueRows = 3;     // x 4 column vectors: 12 accumulators
  static constexpr int kValueColumns = 4;
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* at) { return _mm256_loadu_ps(at); }
  static V load(const at::Half* at) { return widen8(at); }
  static void store(float* at, V x) { _mm256_storeu_ps(at, x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V exp(V x) { return triforce_cpu::exp256(x); }
  static float first(V x) { return _mm256_cvtss_f32(x); }
  static float reduce_add(V x) {  // ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
    const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
  }
  static float reduce_max(V x) {
    const __m128 halves = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 pairs = _mm_max_ps(halves, _mm_movehl_ps(halves, halves));
    return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
  }
  static V hide(V x, int64_t lane0, int64_t lo, int64_t hi) {
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(int32_t(lane0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i outside = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(lo)), index),
                                            _mm256_cmpgt_epi32(index, _mm256_set1_epi32(int32_t(hi))));
    return _mm256_blendv_ps(x, _mm256_set1_ps(kMinusInf), _mm256_castsi256_ps(outside));
  }
  static V widen8(const at::Half* at) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  }
  static void widen(const at::Half* from, float* to, int64_t n) {
    for (int64_t i = 0; i < n; i += kLanes) store(to + i, widen8(from + i));
  }
};

// r[i] (row i of an 8 x 8 tile) -> r[c] (column c).
inline void transpose8(__m256* r) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // s[4 i + k], half h: column 4 h + k of rows 4 i .. 4 i + 3
    s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(s[k], s[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(s[k], s[4 + k], 0x31);
  }
}

inline void transpose_keys(const at::Half* block, int64_t row_stride, int64_t ja, int64_t jb, int64_t dim,
                           float* keys_t, int64_t ahead) {
  for (int64_t g = ja / 8 * 8; g < jb; g += 8) {
    for (int64_t i = 0; i < 8; ++i) prefetch_row(block + (ahead + g + i) * row_stride, dim);
    const bool whole = g >= ja && g + 8 <= jb;
    for (int64_t d = 0; d < dim; d += 8) {
      __m256 r[8];
      if (whole)
        for (int i = 0; i < 8; ++i) r[i] = Ops::widen8(block + (g + i) * row_stride + d);
      else
        for (int i = 0; i < 8; ++i)
          r[i] = g + i >= ja && g + i < jb ? Ops::widen8(block + (g + i) * row_stride + d) : _mm256_setzero_ps();
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(keys_t + (d + i) * kBlock + g, r[i]);
    }
  }
}

#include "cache_attention_body.h"

}  // namespace
}  // namespace avx2
#pragma GCC pop_options

// ---- plain C++: any D, any CPU; one key or one column at a time, the same orders of arithmetic

namespace plain {
namespace {

struct Ops {
  static constexpr int64_t kLanes = 1;
  static constexpr int kScoreRows = 4;
  static constexpr int kScoreKeys = 4;
  static constexpr int kValueRows = 4;
  static constexpr int kValueColumns = 4;
  using V = float;
  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  static V load(const float* at) { return *at; }
  static V load(const at::Half* at) { return static_cast<float>(*at); }
  static void store(float* at, V x) { *at = x; }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V div(V a, V b) { return a / b; }
  static V max(V a, V b) { return std::max(a, b); }
  static V exp(V x) { return exp_scalar(x); }
  static float first(V x) { return x; }
  static float reduce_add(V x) { return x; }
  static float reduce_max(V x) { return x; }
  static V hide(V x, int64_t lane0, int64_t lo, int64_t hi) { return lane0 < lo || lane0 > hi ? kMinusInf : x; }
  static void widen(const at::Half* from, float* to, int64_t n) {
    for (int64_t i = 0; i < n; ++i) to[i] = static_cast<float>(from[i]);  // exact
  }
};

inline void transpose_keys(const at::Half* block, int64_t row_stride, int64_t ja, int64_t jb, int64_t dim,
                           float* keys_t, int64_t ahead) {
  for (int64_t j = ja; j < jb; ++j) {
    prefetch_row(block + (ahead + j) * row_stride, dim);
    for (int64_t d = 0; d < dim; ++d) keys_t[d * kBlock + j] = static_cast<float>(block[j * row_stride + d]);
  }
}

#include "cache_attention_body.h"

}  // namespace
}  // namespace plain

namespace {

// The chosen ISA's body for D; the plain one where D is not a multiple of its width or above kMaxDim.
Body chosen_body(int64_t dim) {
  const Isa isa = chosen_isa();
  if (isa == Isa::avx512 && dim % 16 == 0 && dim <= kMaxDim) return avx512::body(dim);
  if (isa != Isa::scalar && dim % 8 == 0 && dim <= kMaxDim) return avx2::body(dim);
  return plain::body(dim);
}

void check_cache(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.scalar_type() == at::kHalf, name,
              ": a float16 CPU tensor (KV heads, length, head dim)");
  TORCH_CHECK(t.stride(2) == 1 || t.size(2) <= 1, name, ": each row's head dim contiguous");
}

// q (Hq, T, D) float32, k, v (Hkv, L, D) float16 -> (Hq, T, D) float32; see the top of the file.
at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                           int64_t origin, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.scalar_type() == at::kFloat,
              "q: a float32 CPU tensor (query heads, queries, head dim)");
  check_cache(k, "k");
  check_cache(v, "v");
  const int64_t q_heads = q.size(0), queries = q.size(1), dim = q.size(2), kv_heads = k.size(0), keys = k.size(1);
  TORCH_CHECK(queries >= 1 && dim >= 1, "q: at least one query and one dimension");
  TORCH_CHECK(k.size(2) == dim && v.sizes() == k.sizes(), "k, v: (Hkv, L, D) with q's D");
  TORCH_CHECK(kv_heads >= 1 && q_heads % kv_heads == 0, "q: a multiple of the ", kv_heads, " KV heads");
  TORCH_CHECK(keys >= queries, "k: the queries' own keys last, at least T = ", queries, " of them");
  TORCH_CHECK(origin >= 0, "origin: an absolute position, >= 0");
  const int64_t group = q_heads / kv_heads, rows = group * queries;

  // (Hkv, T, G, D) scaled queries: row r = t G + g of KV head h is query t of head h G + g
  const at::Tensor scaled =
      q.mul(float(scale)).view({kv_heads, group, queries, dim}).transpose(1, 2).contiguous();
  Problem p{scaled.data_ptr<float>(), k.data_ptr<at::Half>(), v.data_ptr<at::Half>(),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            rows, group, queries, keys, dim, origin, window, 0, 0, nullptr};
  p.first_segment = segment_of(origin + p.first_key(0));
  p.segments = segment_of(origin + keys - 1) - p.first_segment + 1;
  at::Tensor partials = at::empty({kv_heads, p.segments, rows, 2 + dim}, q.options());
  p.partials = partials.data_ptr<float>();

  const Body body = chosen_body(dim);
  const int64_t row_groups = (rows + kGroupRows - 1) / kGroupRows;
  at::parallel_for(0, kv_heads * row_groups * p.segments, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(body.scratch(dim));
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t segment = unit % p.segments, row_group = unit / p.segments % row_groups;
      const int64_t head = unit / p.segments / row_groups, row0 = row_group * kGroupRows;
      body.attend_unit(p, head, row0, std::min(kGroupRows, rows - row0), p.first_segment + segment,
                       scratch.data());
    }
  });
  at::Tensor out = at::empty({kv_heads, queries, group, dim}, q.options());  // rows in p's order
  float* o = out.data_ptr<float>();
  at::parallel_for(0, kv_heads * rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) body.combine_row(p, i / rows, i % rows, o + i * dim);
  });
  return out.transpose(1, 2).reshape({q_heads, queries, dim});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triforce_cpu, lib) {
  lib.def("cache_attention(Tensor q, Tensor k, Tensor v, float scale, int origin, int window) -> Tensor",
          &cache_attention);
}

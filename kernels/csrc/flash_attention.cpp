// Attention of many new queries (a prefill chunk) against a CPU cache, FlashAttention-style, in float32.
//
// q (Hq, T, D), k and v (Hkv, L, D) with D's rows contiguous (a cache's view); query t sees keys j <= L - T + t.
// The G = Hq / Hkv query heads sharing a KV head are folded into one set of G * T query rows, laid out across
// vector lanes: a tile is 64 query rows (four AVX-512 registers), its queries transposed once. For each block of 64
// keys the tile's scores come out lane-wise (keys broadcast against the transposed queries), so the running
// maximum, the exponentials and the sums of the online softmax are plain vertical operations, and the values
// are accumulated into the tile's transposed output the same way. Only blocks a tile's queries can see are read;
// the causal mask touches only the blocks that straddle its queries' limits. exp is vector_exp.h's polynomial.
// Tiles (KV head, 64 query rows) are split over torch's threads.
//
// The result is softmax(q k^T scale) v up to float32 rounding, as torch's SDPA computes it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vector_exp.h"

namespace {

constexpr int kVecs = 4;                 // registers of 16 query lanes in a tile
constexpr int64_t kTile = 16 * kVecs;    // query rows per tile
constexpr int64_t kKeyBlock = 64;        // keys per online-softmax step

using Vecs = __m512[kVecs];
using triforce_cpu::exp512;

// scores (keys, kTile) = keys (R rows of D) . queries^T (D, kTile), R keys at a time.
template <int R>
__attribute__((target("avx512f"))) void score_rows(const float* keys, int64_t key_stride, const float* queries_t,
                                                   int64_t dim, float* scores) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    __m512 q[kVecs];
    for (int c = 0; c < kVecs; ++c) q[c] = _mm512_loadu_ps(queries_t + d * kTile + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 key = _mm512_set1_ps(keys[r * key_stride + d]);
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_fmadd_ps(key, q[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(scores + r * kTile + 16 * c, acc[r][c]);
}

// out^T (4 dims, kTile) = rescale * out^T + values (keys, 4 dims)^T . weights (keys, kTile): the block's sum is
// formed on its own and then added, so that no long running sum loses the small terms.
__attribute__((target("avx512f"))) void accumulate_values(const float* values, int64_t value_stride,
                                                          const float* weights, int64_t keys, const Vecs& rescale,
                                                          float* out_t) {
  __m512 acc[4][kVecs];
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < kVecs; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    __m512 p[kVecs];
    for (int c = 0; c < kVecs; ++c) p[c] = _mm512_loadu_ps(weights + j * kTile + 16 * c);
    for (int i = 0; i < 4; ++i) {
      const __m512 value = _mm512_set1_ps(values[j * value_stride + i]);
      for (int c = 0; c < kVecs; ++c) acc[i][c] = _mm512_fmadd_ps(value, p[c], acc[i][c]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < kVecs; ++c) {
      float* out = out_t + i * kTile + 16 * c;
      _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_loadu_ps(out), rescale[c], acc[i][c]));
    }
}

struct Problem {
  const float *q, *k, *v;
  float* out;
  int64_t q_heads, group, queries, keys, dim;
  int64_t q_head_stride, k_head_stride, v_head_stride;  // rows within a head are dim floats apart
  float scale;
};

__attribute__((target("avx512f"))) void attend_tile(const Problem& p, int64_t kv_head, int64_t row0,
                                                    std::vector<float>& scratch) {
  const int64_t dim = p.dim, rows = p.group * p.queries;
  float* queries_t = scratch.data();             // (D, kTile)
  float* out_t = queries_t + dim * kTile;        // (D, kTile)
  float* scores = out_t + dim * kTile;           // (kKeyBlock, kTile)
  int32_t limit[kTile];                          // the last key each lane's query sees
  int64_t source[kTile];                         // the lane's query row: head * T + t
  for (int64_t lane = 0; lane < kTile; ++lane) {
    const int64_t row = std::min(row0 + lane, rows - 1);  // padding lanes repeat the last row, written nowhere
    const int64_t g = row / p.queries, t = row % p.queries;
    source[lane] = (kv_head * p.group + g) * p.queries + t;
    limit[lane] = int32_t(p.keys - p.queries + t);
    const float* qrow = p.q + (kv_head * p.group + g) * p.q_head_stride + t * dim;
    for (int64_t d = 0; d < dim; ++d) queries_t[d * kTile + lane] = qrow[d] * p.scale;
  }
  std::fill(out_t, out_t + dim * kTile, 0.f);
  const int32_t first_limit = *std::min_element(limit, limit + kTile);
  const int32_t last_limit = *std::max_element(limit, limit + kTile);
  Vecs running_max, total, limits;
  for (int c = 0; c < kVecs; ++c) {
    running_max[c] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    total[c] = _mm512_setzero_ps();
    limits[c] = _mm512_castsi512_ps(_mm512_loadu_si512(limit + 16 * c));
  }
  const float* keys = p.k + kv_head * p.k_head_stride;
  const float* values = p.v + kv_head * p.v_head_stride;
  for (int64_t j0 = 0; j0 <= last_limit; j0 += kKeyBlock) {
    const int64_t block = std::min<int64_t>(kKeyBlock, last_limit + 1 - j0);
    int64_t j = 0;
    for (; j + 4 <= block; j += 4) score_rows<4>(keys + (j0 + j) * dim, dim, queries_t, dim, scores + j * kTile);
    for (; j < block; ++j) score_rows<1>(keys + (j0 + j) * dim, dim, queries_t, dim, scores + j * kTile);
    const bool masked = j0 + block - 1 > first_limit;
    Vecs block_max;
    for (int c = 0; c < kVecs; ++c) block_max[c] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (j = 0; j < block; ++j) {
      for (int c = 0; c < kVecs; ++c) {
        __m512 s = _mm512_loadu_ps(scores + j * kTile + 16 * c);
        if (masked) {
          const __mmask16 hidden = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(int32_t(j0 + j)),
                                                           _mm512_castps_si512(limits[c]));
          s = _mm512_mask_blend_ps(hidden, s, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
          _mm512_storeu_ps(scores + j * kTile + 16 * c, s);
        }
        block_max[c] = _mm512_max_ps(block_max[c], s);
      }
    }
    Vecs shift, rescale;
    for (int c = 0; c < kVecs; ++c) {
      const __m512 new_max = _mm512_max_ps(running_max[c], block_max[c]);
      // a lane that has seen no key yet keeps a shift of 0, so that its exponentials stay exp(-inf) = 0
      const __mmask16 none = _mm512_cmp_ps_mask(new_max, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                                _CMP_EQ_OQ);
      shift[c] = _mm512_mask_blend_ps(none, new_max, _mm512_setzero_ps());
      rescale[c] = exp512(_mm512_sub_ps(running_max[c], shift[c]));
      running_max[c] = new_max;
    }
    Vecs block_total;
    for (int c = 0; c < kVecs; ++c) block_total[c] = _mm512_setzero_ps();
    for (j = 0; j < block; ++j) {
      for (int c = 0; c < kVecs; ++c) {
        const __m512 w = exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + j * kTile + 16 * c), shift[c]));
        _mm512_storeu_ps(scores + j * kTile + 16 * c, w);
        block_total[c] = _mm512_add_ps(block_total[c], w);
      }
    }
    for (int c = 0; c < kVecs; ++c) total[c] = _mm512_fmadd_ps(total[c], rescale[c], block_total[c]);
    for (int64_t d = 0; d < dim; d += 4)
      accumulate_values(values + j0 * dim + d, dim, scores, block, rescale, out_t + d * kTile);
  }
  float inverse[kTile];
  for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(inverse + 16 * c, _mm512_div_ps(_mm512_set1_ps(1.f), total[c]));
  for (int64_t lane = 0; lane < kTile && row0 + lane < rows; ++lane) {
    float* orow = p.out + source[lane] * dim;
    for (int64_t d = 0; d < dim; ++d) orow[d] = out_t[d * kTile + lane] * inverse[lane];
  }
}

bool avx512_here() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

// q (Hq, T, D), k, v (Hkv, L, D) float32 -> (Hq, T, D); see the top of the file.
at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(avx512_here(), "chunk_attention needs AVX-512");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v: (heads, length, head dim)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "q, k, v: float32");
  const at::Tensor qc = q.contiguous();
  const int64_t dim = q.size(2), kv_heads = k.size(0);
  TORCH_CHECK(dim % 4 == 0 && k.size(2) == dim && v.size(2) == dim, "head dim: the same, a multiple of 4");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == dim && v.stride(2) == 1 && v.stride(1) == dim,
              "k, v: each head's rows contiguous");
  TORCH_CHECK(q.size(0) % kv_heads == 0 && v.size(0) == kv_heads && v.size(1) == k.size(1), "q, k, v: heads");
  TORCH_CHECK(k.size(1) >= q.size(1), "k: at least as many keys as queries");
  at::Tensor out = at::empty_like(qc);
  const Problem p{qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
                  q.size(0), q.size(0) / kv_heads, q.size(1), k.size(1), dim,
                  q.size(1) * dim, k.stride(0), v.stride(0), float(scale)};
  const int64_t tiles = (p.group * p.queries + kTile - 1) / kTile;
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * dim * kTile + kKeyBlock * kTile);
    for (int64_t item = begin; item < end; ++item) attend_tile(p, item / tiles, item % tiles * kTile, scratch);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triforce_cpu, lib) {
  lib.def("chunk_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", &chunk_attention);
  lib.def("chunk_attention_supported() -> bool", &avx512_here);
}

// Attention of a few queries (a decode or verification step) against a float16 copy of a cache's first keys and
// values (the prefix) followed by a float32 tail that ends with the queries' own keys, on the CPU.
//
// q (Hq, T, D) float32; k_half, v_half (Hkv, P, D) float16; k_tail, v_tail (Hkv, Lt, D) float32 with Lt >= T. Any
// head and row strides, D contiguous: the prefix is a view of a longer buffer, which grows by converting only its
// new positions. Query t sees every prefix key and the tail keys j <= Lt - T + t. The G = Hq / Hkv query heads of a
// KV head and their T queries are R = G * T rows that share every read of a key and a value. Float16 is widened
// exactly (vcvtph2ps); everything after is float32, so the result is softmax(scale q k^T) v on the float16 values
// up to float32 rounding.
//
// The prefix and the tail are cut into blocks of kKeyBlock keys; a (KV head, block) pair is one unit of work: the
// block's scores (R, n) for all rows, each row's maximum m, its exponentials exp(s - m) and their sum s, and its
// unnormalised output o (R, D) = exp(scores - m) values. Units run on torch's threads (whole KV heads would be too
// few: a small model's 3 leave one of 2 threads idle half the time); then each row's blocks are combined in block
// order, out = sum_b exp(m_b - M) o_b / sum_b exp(m_b - M) s_b with M the largest m_b. Neither the blocks nor a
// unit's arithmetic depend on the number of threads, so the result does not either, bit for bit. Blocks of 256,
// 512 and 1,024 keys measured the same.
//
// Three bodies, chosen by isa.h: AVX-512 and AVX2 for D of 64 or 128, plain C++ for the rest and the tests.
// For one query the kernel streams the prefix's bytes (half those of float32) and is bound by memory; for more,
// by the multiply-adds: R * D for the scores and as many for the values, per key.

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
using triforce_cpu::exp256;
using triforce_cpu::exp512;
using triforce_cpu::Isa;

constexpr int64_t kKeyBlock = 512;  // keys per unit: a constant, so that no sum depends on the number of threads
constexpr int64_t kLanes = 16;      // the scores of a block are padded to a multiple of this with -inf
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// Keys or values of one KV head: row j (D contiguous elements) at data + j * stride.
template <typename T>
struct Rows {
  const T* data;
  int64_t stride;

  const T* row(int64_t j) const { return data + j * stride; }
  Rows from(int64_t j) const { return Rows{row(j), stride}; }
};

// A body's products over a block of n keys, for `rows` query rows q (rows, D), already scaled:
//   scores (rows, n), rows ld apart, = q keys^T
//   out (rows, D) = weights (rows, n), rows ld apart, . values (n, D)
template <typename T>
struct Products {
  void (*scores)(Rows<T> keys, int64_t n, const float* q, int64_t rows, int64_t dim, float* scores, int64_t ld);
  void (*values)(Rows<T> values, int64_t n, const float* weights, int64_t ld, int64_t rows, int64_t dim, float* out);
};

// A body's softmax step over scores (rows, width), rows ld apart, width a multiple of kLanes: each row's maximum m
// into maxima, its scores replaced by exp(s - m) (m taken as 0 where it is -inf: no key seen, all weights 0), their
// sum into sums.
using Exponentials = void (*)(float* scores, int64_t rows, int64_t width, int64_t ld, float* maxima, float* sums);

// ---- plain C++: any D, any CPU

inline float widen(float x) { return x; }
inline float widen(at::Half x) { return static_cast<float>(x); }  // exact

template <typename T>
void scores_scalar(Rows<T> keys, int64_t n, const float* q, int64_t rows, int64_t dim, float* scores, int64_t ld) {
  for (int64_t j = 0; j < n; ++j) {
    const T* key = keys.row(j);
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t d = 0; d < dim; ++d) acc += q[r * dim + d] * widen(key[d]);
      scores[r * ld + j] = acc;
    }
  }
}

template <typename T>
void values_scalar(Rows<T> values, int64_t n, const float* weights, int64_t ld, int64_t rows, int64_t dim,
                   float* out) {
  std::fill(out, out + rows * dim, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const T* value = values.row(j);
    for (int64_t r = 0; r < rows; ++r) {
      const float w = weights[r * ld + j];
      for (int64_t d = 0; d < dim; ++d) out[r * dim + d] += w * widen(value[d]);
    }
  }
}

void exponentials_scalar(float* scores, int64_t rows, int64_t width, int64_t ld, float* maxima, float* sums) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld;
    const float top = *std::max_element(s, s + width);
    const float shift = top == kMinusInf ? 0.f : top;
    float total = 0.f;
    for (int64_t j = 0; j < width; ++j) total += s[j] = std::exp(s[j] - shift);
    maxima[r] = top;
    sums[r] = total;
  }
}

// ---- AVX-512: D = 16 NV, a row of keys or values is NV registers

template <int NV>
__attribute__((target("avx512f"))) inline void load512(const at::Half* row, __m512* out) {
  for (int c = 0; c < NV; ++c)
    out[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + kLanes * c)));
}

template <int NV>
__attribute__((target("avx512f"))) inline void load512(const float* row, __m512* out) {
  for (int c = 0; c < NV; ++c) out[c] = _mm512_loadu_ps(row + kLanes * c);
}

// The lane sums of a, b, c, d: pairs of lanes are added while interleaving, twice, so that each 128-bit quarter
// holds (a, b, c, d) partial sums; then the quarters are added.
__attribute__((target("avx512f"))) inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // quarters: a b a b
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));  // quarters: c d c d
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));  // quarters: a b c d
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}

// The lane sums of a and b in the first two floats.
__attribute__((target("avx512f"))) inline __m128 sum2(__m512 a, __m512 b) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // quarters: a b a b
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(ab),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(ab), 1)));
  const __m128 quarters = _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
  return _mm_add_ps(quarters, _mm_movehl_ps(quarters, quarters));
}

// kStep keys at a time are widened into registers (16 of the 32), and every query row's products with them are
// formed against those registers: each key is read and widened once, whatever the number of rows. Each row's
// kStep dot products leave as kStep vectors whose lanes sum4 / sum2 add.
template <int NV, typename T>
__attribute__((target("avx512f"))) void scores_avx512(Rows<T> keys, int64_t n, const float* q, int64_t rows,
                                                      int64_t, float* scores, int64_t ld) {
  constexpr int kStep = NV <= 4 ? 4 : 2;
  constexpr int64_t kDim = kLanes * NV;
  int64_t j = 0;
  for (; j + kStep <= n; j += kStep) {
    __m512 key[kStep][NV];
    for (int s = 0; s < kStep; ++s) load512<NV>(keys.row(j + s), key[s]);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * kDim;
      __m512 acc[kStep];
      const __m512 first = _mm512_loadu_ps(qr);
      for (int s = 0; s < kStep; ++s) acc[s] = _mm512_mul_ps(first, key[s][0]);
      for (int c = 1; c < NV; ++c) {
        const __m512 qc = _mm512_loadu_ps(qr + kLanes * c);
        for (int s = 0; s < kStep; ++s) acc[s] = _mm512_fmadd_ps(qc, key[s][c], acc[s]);
      }
      if constexpr (kStep == 4) _mm_storeu_ps(scores + r * ld + j, sum4(acc[0], acc[1], acc[2], acc[3]));
      else _mm_storel_pi(reinterpret_cast<__m64*>(scores + r * ld + j), sum2(acc[0], acc[1]));
    }
  }
  for (; j < n; ++j) {
    __m512 key[NV];
    load512<NV>(keys.row(j), key);
    for (int64_t r = 0; r < rows; ++r) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + r * kDim), key[0]);
      for (int c = 1; c < NV; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * kDim + kLanes * c), key[c], acc);
      scores[r * ld + j] = _mm512_reduce_add_ps(acc);
    }
  }
}

// R rows' outputs stay in R * NV registers through the block; each value row is read and widened once for them.
// The loop runs at least once (n >= 1, no block is empty) and is written so: with a for loop's path that skips it,
// GCC keeps a second copy of the accumulators for the exit and copies them every step, to memory where registers
// run short.
template <int NV, int R, typename T>
__attribute__((target("avx512f"))) void value_rows_avx512(Rows<T> values, int64_t n, const float* weights,
                                                          int64_t ld, float* out) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t j = 0;
  do {  // n >= 1
    __m512 value[NV];
    load512<NV>(values.row(j), value);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(weights[r * ld + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(w, value[c], acc[r][c]);
    }
  } while (++j < n);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + r * kLanes * NV + kLanes * c, acc[r][c]);
}

template <int NV>
constexpr int kValueRows512 = 24 / NV;  // rows per pass over the values: their outputs take 24 of 32 registers

// The last rows < kValueRows512, in one pass of as many.
template <int NV, typename T, int R = kValueRows512<NV> - 1>
void value_rest_avx512(int64_t rows, Rows<T> values, int64_t n, const float* weights, int64_t ld, float* out) {
  if constexpr (R > 1) {
    if (rows < R) return value_rest_avx512<NV, T, R - 1>(rows, values, n, weights, ld, out);
  }
  value_rows_avx512<NV, R, T>(values, n, weights, ld, out);
}

template <int NV, typename T>
void values_avx512(Rows<T> values, int64_t n, const float* weights, int64_t ld, int64_t rows, int64_t,
                   float* out) {
  constexpr int kRows = kValueRows512<NV>;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    value_rows_avx512<NV, kRows, T>(values, n, weights + r * ld, ld, out + r * kLanes * NV);
  if (r < rows) value_rest_avx512<NV, T>(rows - r, values, n, weights + r * ld, ld, out + r * kLanes * NV);
}

__attribute__((target("avx512f"))) void exponentials_avx512(float* scores, int64_t rows, int64_t width, int64_t ld,
                                                            float* maxima, float* sums) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld;
    __m512 top = _mm512_set1_ps(kMinusInf);
    for (int64_t j = 0; j < width; j += kLanes) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
    const float m = _mm512_reduce_max_ps(top);
    const __m512 shift = _mm512_set1_ps(m == kMinusInf ? 0.f : m);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += kLanes) {
      const __m512 w = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift));
      _mm512_storeu_ps(s + j, w);
      total = _mm512_add_ps(total, w);
    }
    maxima[r] = m;
    sums[r] = _mm512_reduce_add_ps(total);
  }
}

// ---- AVX2 (with F16C): D = 8 NV, 16 registers

__attribute__((target("avx2,fma,f16c"))) inline __m256 load256(const at::Half* at) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 load256(const float* at) { return _mm256_loadu_ps(at); }

// The lane sums of v[0..7], one per lane: horizontal adds pair up lanes within each half twice, then the halves
// are added.
__attribute__((target("avx2,fma,f16c"))) inline __m256 sum8(const __m256* v) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // halves: a b c d
  const __m256 efgh = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // halves: e f g h
  return _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20), _mm256_permute2f128_ps(abcd, efgh, 0x31));
}

// R rows against `count` <= 8 keys: one accumulator per row, each key read once for the R rows; the rows' 8
// accumulators (one per key) are summed across lanes together by sum8.
template <int NV, int R, typename T>
__attribute__((target("avx2,fma,f16c"))) void score_rows_avx2(Rows<T> keys, int64_t count, const float* q,
                                                              float* scores, int64_t ld) {
  constexpr int64_t kDim = 8 * NV;
  __m256 partial[R][8];
  for (int k = 0; k < 8; ++k) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    if (k < count) {
      const T* key = keys.row(k);
      for (int c = 0; c < NV; ++c) {
        const __m256 kc = load256(key + 8 * c);
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * kDim + 8 * c), kc, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) partial[r][k] = acc[r];
  }
  for (int r = 0; r < R; ++r) {
    float sums[8];
    _mm256_storeu_ps(sums, sum8(partial[r]));
    std::copy(sums, sums + count, scores + r * ld);
  }
}

constexpr int kScoreRows256 = 8;  // rows per pass over 8 keys

template <int NV, typename T, int R = kScoreRows256 - 1>
void score_rest_avx2(int64_t rows, Rows<T> keys, int64_t count, const float* q, float* scores, int64_t ld) {
  if constexpr (R > 1) {
    if (rows < R) return score_rest_avx2<NV, T, R - 1>(rows, keys, count, q, scores, ld);
  }
  score_rows_avx2<NV, R, T>(keys, count, q, scores, ld);
}

template <int NV, typename T>
void scores_avx2(Rows<T> keys, int64_t n, const float* q, int64_t rows, int64_t, float* scores, int64_t ld) {
  constexpr int64_t kDim = 8 * NV;
  for (int64_t j = 0; j < n; j += 8) {
    const int64_t count = std::min<int64_t>(8, n - j);
    int64_t r = 0;
    for (; r + kScoreRows256 <= rows; r += kScoreRows256)
      score_rows_avx2<NV, kScoreRows256, T>(keys.from(j), count, q + r * kDim, scores + r * ld + j, ld);
    if (r < rows) score_rest_avx2<NV, T>(rows - r, keys.from(j), count, q + r * kDim, scores + r * ld + j, ld);
  }
}

// R rows by 32 columns of the output in 4R registers (12 of 16 for R = 3) through the block; n >= 1, as above.
template <int R, typename T>
__attribute__((target("avx2,fma,f16c"))) void value_rows_avx2(Rows<T> values, int64_t n, int64_t column,
                                                              const float* weights, int64_t ld, float* out,
                                                              int64_t dim) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t j = 0;
  do {  // n >= 1
    __m256 w[R];
    for (int r = 0; r < R; ++r) w[r] = _mm256_broadcast_ss(weights + r * ld + j);
    const T* value = values.row(j) + column;
    for (int c = 0; c < 4; ++c) {
      const __m256 vc = load256(value + 8 * c);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(w[r], vc, acc[r][c]);
    }
  } while (++j < n);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + r * dim + column + 8 * c, acc[r][c]);
}

template <typename T>
void values_avx2(Rows<T> values, int64_t n, const float* weights, int64_t ld, int64_t rows, int64_t dim,
                 float* out) {
  for (int64_t column = 0; column < dim; column += 32) {
    int64_t r = 0;
    for (; r + 3 <= rows; r += 3) value_rows_avx2<3, T>(values, n, column, weights + r * ld, ld, out + r * dim, dim);
    if (rows - r == 2) value_rows_avx2<2, T>(values, n, column, weights + r * ld, ld, out + r * dim, dim);
    if (rows - r == 1) value_rows_avx2<1, T>(values, n, column, weights + r * ld, ld, out + r * dim, dim);
  }
}

__attribute__((target("avx2,fma,f16c"))) void exponentials_avx2(float* scores, int64_t rows, int64_t width,
                                                                int64_t ld, float* maxima, float* sums) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld;
    __m256 top = _mm256_set1_ps(kMinusInf);
    for (int64_t j = 0; j < width; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    const float m = *std::max_element(lanes, lanes + 8);
    const __m256 shift = _mm256_set1_ps(m == kMinusInf ? 0.f : m);
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < width; j += 8) {
      const __m256 w = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
      _mm256_storeu_ps(s + j, w);
      total = _mm256_add_ps(total, w);
    }
    _mm256_storeu_ps(lanes, total);
    float sum = 0.f;
    for (float lane : lanes) sum += lane;
    maxima[r] = m;
    sums[r] = sum;
  }
}

// ---- the bodies and the driver

struct Body {
  Products<at::Half> prefix;
  Products<float> tail;
  Exponentials exponentials;
};

template <typename T>
Products<T> products(Isa isa, int64_t dim) {
  if (isa == Isa::avx512 && dim == 64) return {scores_avx512<4, T>, values_avx512<4, T>};
  if (isa == Isa::avx512 && dim == 128) return {scores_avx512<8, T>, values_avx512<8, T>};
  if (isa == Isa::avx2 && dim == 64) return {scores_avx2<8, T>, values_avx2<T>};
  if (isa == Isa::avx2 && dim == 128) return {scores_avx2<16, T>, values_avx2<T>};
  return {scores_scalar<T>, values_scalar<T>};
}

// The chosen ISA's body for D; the plain one where its vector bodies do not take D.
Body chosen_body(int64_t dim) {
  const Isa isa = dim == 64 || dim == 128 ? chosen_isa() : Isa::scalar;
  const Exponentials exponentials = isa == Isa::avx512 ? exponentials_avx512
                                    : isa == Isa::avx2 ? exponentials_avx2
                                                       : exponentials_scalar;
  return Body{products<at::Half>(isa, dim), products<float>(isa, dim), exponentials};
}

struct Problem {
  const float* q;  // (Hkv, R, D) scaled queries, row r = g * T + t of KV head h being query head h * G + g
  const at::Half *k_half, *v_half;
  const float *k_tail, *v_tail;
  int64_t k_half_head, k_half_row, v_half_head, v_half_row;  // strides, in elements
  int64_t k_tail_head, k_tail_row, v_tail_head, v_tail_row;
  int64_t rows, queries, dim, prefix, tail;
  int64_t prefix_blocks, blocks;  // blocks per KV head: the prefix's, then the tail's
  float* block_out;               // (Hkv, blocks, R, D) unnormalised outputs
  float* block_max;               // (Hkv, blocks, R) row maxima
  float* block_sum;               // (Hkv, blocks, R) sums of exponentials
};

// One block of n keys of a KV head: scores into `scores` (R, kKeyBlock); row r (query t = r % T) sees local keys
// up to last_seen + t; then the softmax step and the values' product, into the unit's slots of p.
template <typename T>
void attend_block(const Problem& p, const Products<T>& products, Exponentials exponentials, Rows<T> keys,
                  Rows<T> values, int64_t n, int64_t last_seen, int64_t head, int64_t unit, float* scores) {
  const float* q = p.q + head * p.rows * p.dim;
  products.scores(keys, n, q, p.rows, p.dim, scores, kKeyBlock);
  const int64_t width = (n + kLanes - 1) / kLanes * kLanes;
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t hidden_from = std::clamp<int64_t>(last_seen + r % p.queries + 1, 0, n);
    std::fill(scores + r * kKeyBlock + hidden_from, scores + r * kKeyBlock + width, kMinusInf);
  }
  exponentials(scores, p.rows, width, kKeyBlock, p.block_max + unit * p.rows, p.block_sum + unit * p.rows);
  products.values(values, n, scores, kKeyBlock, p.rows, p.dim, p.block_out + unit * p.rows * p.dim);
}

void attend_unit(const Problem& p, const Body& body, int64_t unit, float* scores) {
  const int64_t head = unit / p.blocks, block = unit % p.blocks;
  if (block < p.prefix_blocks) {
    const int64_t first = block * kKeyBlock, n = std::min(kKeyBlock, p.prefix - first);
    const Rows<at::Half> keys{p.k_half + head * p.k_half_head + first * p.k_half_row, p.k_half_row};
    const Rows<at::Half> values{p.v_half + head * p.v_half_head + first * p.v_half_row, p.v_half_row};
    attend_block(p, body.prefix, body.exponentials, keys, values, n, n, head, unit, scores);
  } else {
    const int64_t first = (block - p.prefix_blocks) * kKeyBlock, n = std::min(kKeyBlock, p.tail - first);
    const Rows<float> keys{p.k_tail + head * p.k_tail_head + first * p.k_tail_row, p.k_tail_row};
    const Rows<float> values{p.v_tail + head * p.v_tail_head + first * p.v_tail_row, p.v_tail_row};
    attend_block(p, body.tail, body.exponentials, keys, values, n, p.tail - p.queries - first, head, unit, scores);
  }
}

// Row r of KV head `head`: its blocks' outputs combined in block order into out (D).
void combine_row(const Problem& p, int64_t head, int64_t r, float* out) {
  const int64_t first = head * p.blocks * p.rows + r;  // the row's slot in block 0; rows apart per block
  float top = kMinusInf;
  for (int64_t b = 0; b < p.blocks; ++b) top = std::max(top, p.block_max[first + b * p.rows]);
  std::fill(out, out + p.dim, 0.f);
  float total = 0.f;
  for (int64_t b = 0; b < p.blocks; ++b) {
    const float m = p.block_max[first + b * p.rows];
    if (m == kMinusInf) continue;  // no key of the block seen
    const float factor = std::exp(m - top);
    total += factor * p.block_sum[first + b * p.rows];
    const float* o = p.block_out + (first + b * p.rows) * p.dim;
    for (int64_t d = 0; d < p.dim; ++d) out[d] += factor * o[d];
  }
  for (int64_t d = 0; d < p.dim; ++d) out[d] /= total;
}

void check_keys(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.scalar_type() == dtype, name, ": a ",
              c10::toString(dtype), " CPU tensor (KV heads, length, head dim)");
  TORCH_CHECK(t.stride(2) == 1 || t.size(2) <= 1, name, ": each row's head dim contiguous");
}

// q (Hq, T, D) float32, k_half, v_half (Hkv, P, D) float16, k_tail, v_tail (Hkv, Lt, D) float32 -> (Hq, T, D);
// see the top of the file.
at::Tensor half_prefix_attention(const at::Tensor& q, const at::Tensor& k_half, const at::Tensor& v_half,
                                 const at::Tensor& k_tail, const at::Tensor& v_tail, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.scalar_type() == at::kFloat,
              "q: a float32 CPU tensor (query heads, queries, head dim)");
  check_keys(k_half, "k_half", at::kHalf);
  check_keys(v_half, "v_half", at::kHalf);
  check_keys(k_tail, "k_tail", at::kFloat);
  check_keys(v_tail, "v_tail", at::kFloat);
  const int64_t q_heads = q.size(0), queries = q.size(1), dim = q.size(2), kv_heads = k_half.size(0);
  const int64_t prefix = k_half.size(1), tail = k_tail.size(1);
  TORCH_CHECK(queries >= 1 && dim >= 1, "q: at least one query and one dimension");
  TORCH_CHECK(v_half.sizes() == k_half.sizes() && k_half.size(2) == dim, "k_half, v_half: (Hkv, P, D), q's D");
  TORCH_CHECK(k_tail.size(0) == kv_heads && k_tail.size(2) == dim && v_tail.sizes() == k_tail.sizes(),
              "k_tail, v_tail: (Hkv, Lt, D), the prefix's Hkv and q's D");
  TORCH_CHECK(kv_heads >= 1 && q_heads >= kv_heads && q_heads % kv_heads == 0, "q: a multiple of the ", kv_heads,
              " KV heads");
  TORCH_CHECK(tail >= queries, "k_tail: the queries' own keys last, at least T = ", queries, " of them");

  const at::Tensor scaled = q.contiguous().mul(scale);  // (Hq, T, D) = (Hkv, R, D) row for row
  const int64_t rows = q_heads / kv_heads * queries;
  const int64_t prefix_blocks = (prefix + kKeyBlock - 1) / kKeyBlock;
  const int64_t blocks = prefix_blocks + (tail + kKeyBlock - 1) / kKeyBlock;
  at::Tensor block_out = at::empty({kv_heads, blocks, rows, dim}, q.options());
  at::Tensor block_stats = at::empty({2, kv_heads, blocks, rows}, q.options());
  const Problem p{scaled.data_ptr<float>(),
                  k_half.data_ptr<at::Half>(), v_half.data_ptr<at::Half>(),
                  k_tail.data_ptr<float>(), v_tail.data_ptr<float>(),
                  k_half.stride(0), k_half.stride(1), v_half.stride(0), v_half.stride(1),
                  k_tail.stride(0), k_tail.stride(1), v_tail.stride(0), v_tail.stride(1),
                  rows, queries, dim, prefix, tail, prefix_blocks, blocks,
                  block_out.data_ptr<float>(), block_stats[0].data_ptr<float>(), block_stats[1].data_ptr<float>()};
  const Body body = chosen_body(dim);
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(rows * kKeyBlock);
    for (int64_t unit = begin; unit < end; ++unit) attend_unit(p, body, unit, scores.data());
  });
  at::Tensor out = at::empty({q_heads, queries, dim}, q.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, kv_heads * rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) combine_row(p, i / rows, i % rows, o + i * dim);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triforce_cpu, lib) {
  lib.def("half_prefix_attention(Tensor q, Tensor k_half, Tensor v_half, Tensor k_tail, Tensor v_tail, float scale) "
          "-> Tensor",
          &half_prefix_attention);
}

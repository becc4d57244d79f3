// Attention of T float32 queries against a float16 KV cache view, on the CPU: one kernel for prefill chunks,
// verification steps and 1-token decoding, whose result for a query row is the same bits however many rows go
// with it, wherever the batch starts and whatever the number of threads.
//
// q (Hq, T, D) float32; k, v (Hkv, L, D) float16 views of a cache laid out [context | the T new keys], any head
// and row strides, each row's D contiguous; origin: the absolute position of view index 0. Query t sits at view
// index i = L - T + t and reads keys j <= i, and j > i - window with a window (window <= 0: none). Output
// (Hq, T, D) float32 = softmax(scale q k^T) v on the float16 keys and values (widened exactly), up to float32
// rounding. segment: the keys a segment holds (kernels/attention.py segment_keys: 2,048 where view indices are
// positions, 512 for the retrieval and StreamingLLM caches' slots).
//
// The order of arithmetic of one output element depends only on its query's position and the keys it reads:
// - keys are cut into blocks of kBlock and segments of `segment` keys (a multiple of kBlock), both aligned to
//   absolute positions (origin + j), never to the view's start or to the batch;
// - a score is one row's dot product with one key in an order fixed per body, the same for a pair (row, key)
//   whichever rows and keys are scored with it. AVX-512 and AVX2: lane l of 8 takes the FMA chain over
//   c = 0 .. D/8-1 of q[8 c + l] k[8 c + l] (a key's 8 columns as they lie), then
//   ((p_0 + p_4) + (p_2 + p_6)) + ((p_1 + p_5) + (p_3 + p_7)), which AVX-512 runs for two keys a register (the tree
//   as levels of shuffles over a row's 16 keys) and AVX2 for one (a butterfly over 8 keys); plain: the FMA chain over
//   d = 0 .. D-1;
// - within a segment, an online softmax runs over its blocks in increasing position: per block the row's maximum
//   (exact, in any order), its weights 2^(s - m) (vector_exp.h; scores in base 2, the queries scaled by log2(e)
//   beforehand), their sum added lane-wise to a running vector of
//   sums, and the output's block sum, the FMA chain over the block's keys in order, added to the rescaled output
//   in one FMA. Keys a row does not read get weight 0 exactly, which leaves every sum as it was, so a row gives the
//   same bits whichever other rows share its tiles;
// - a row's segments are merged in segment order, then its output divided by its sum.
// Threads split the work only by (KV head, group of rows, segment), each taking a run of units of about equal
// work: no element's order depends on them.
//
// For many rows the G = Hq / Hkv query heads of a KV head and the T queries are R = G T rows, ordered position by
// position (t G + g), in groups of kGroupRows. A unit of work with more than Ops::kDirectRows rows (a prefill chunk,
// a long verification) packs each block's keys (Ops::pack_keys) once for the group; a smaller one (a decode step's
// grouped heads, a verification of a few tokens) reads them as float16 directly, widened as the FMAs take them.
// Tiles of rows then take their scores (AVX-512: up to 6 rows against 16 keys, packed or read directly), the softmax
// step, and the values' product (rows x D columns in registers), which every value tile reads from the float16
// cache itself. Segments give a 1-row decode its parallelism (flash-decoding). Every unit asks for the next block's
// key and value rows a few lines at a time, spread over the current block's work (Stream): left to the hardware's
// prefetchers, a decode step's value loads waited on memory, and prefetches of whole blocks at once stalled it
// (their instructions waited for free miss buffers). A unit that reads its keys directly also asks for the block
// three ahead into L2, line for line with the next one: its scores transpose no keys, and what it waits on is
// memory. The blocks that every row of a verification of one score tile reads whole are the exception
// (whole_blocks): left to the hardware's prefetchers, they went faster.
// Three bodies: AVX-512 and AVX2 (F16C) for D a multiple of their width, 64 and 128 compiled for their size, and
// plain C++ for everything else, picked by isa.h.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "step_kernels.h"
#include "vector_exp.h"

namespace {

using triforce_cpu::chosen_isa;
using triforce_cpu::Isa;

constexpr int64_t kBlock = 64;        // keys per online-softmax step, aligned to absolute positions
constexpr int64_t kGroupRows = 96;    // query rows per unit of work, which share each block's packed keys
constexpr int64_t kTileRows = 24;     // rows whose scores and weights are taken together before their values
constexpr int64_t kMaxDim = 256;     // the widest head the vector bodies take
constexpr int64_t kCombineRows = 64;  // rows whose segments a thread merges at least
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// The next block's key and value rows (`keys` of each, rows k_row and v_row elements apart, `dim` float16 each),
// asked for into L1 (prefetcht0) a few lines at a time while a unit works on the current block, so that the cache is
// read while the block's arithmetic runs rather than before it; with each line, the same line of the block
// kFarBlocks after the current one (`far_keys` rows of it) into L2 (prefetcht2), so that the line the next L1
// request asks for is near. Lines go in pairs, line i of the keys with line i of the values. The block's work is
// counted in units (a row tile's scores of one key vector: kScoreUnits, its values for one key: 1); advance(n)
// issues the share of the pairs that n of the block's `units` earn, which spreads them at the rate that reads them
// in the block's time.
struct Stream {
  static constexpr int64_t kScoreUnits = 16;
  static constexpr int64_t kLineHalves = 32;  // float16 a 64-byte line
  static constexpr int64_t kFarBlocks = 3;
  const at::Half *k = nullptr, *v = nullptr, *far_k = nullptr, *far_v = nullptr;
  int64_t k_row = 0, v_row = 0, row_lines = 0;
  int64_t pairs = 0, far_pairs = 0, issued = 0, units = 1, credit = 0;
  int64_t row = 0, line = 0;  // the next pair's row and line in it, where rows are not dim apart
  bool contiguous = false;    // key rows and value rows each dim apart, dim a whole number of lines: one range each

  Stream() = default;
  // k, v: the next block's first rows, of kBlock-key blocks; the block kFarBlocks after the current one lies
  // (kFarBlocks - 1) blocks after them
  Stream(const at::Half* k, const at::Half* v, int64_t k_row, int64_t v_row, int64_t keys, int64_t dim,
         int64_t units, int64_t far_keys)
      : k(k), v(v), far_k(far_keys ? k + (kFarBlocks - 1) * kBlock * k_row : nullptr),
        far_v(far_keys ? v + (kFarBlocks - 1) * kBlock * v_row : nullptr), k_row(k_row), v_row(v_row),
        row_lines((dim + kLineHalves - 1) / kLineHalves), pairs(keys * row_lines), far_pairs(far_keys * row_lines),
        units(std::max<int64_t>(1, units)), contiguous(k_row == dim && v_row == dim && dim % kLineHalves == 0) {}

  __attribute__((always_inline)) void issue() {
    const int64_t k_at = contiguous ? issued * kLineHalves : row * k_row + line * kLineHalves;
    const int64_t v_at = contiguous ? issued * kLineHalves : row * v_row + line * kLineHalves;
    asm volatile("prefetcht0 %0" : : "m"(*reinterpret_cast<const char*>(k + k_at)));
    asm volatile("prefetcht0 %0" : : "m"(*reinterpret_cast<const char*>(v + v_at)));
    if (issued < far_pairs) {
      asm volatile("prefetcht2 %0" : : "m"(*reinterpret_cast<const char*>(far_k + k_at)));
      asm volatile("prefetcht2 %0" : : "m"(*reinterpret_cast<const char*>(far_v + v_at)));
    }
    if (!contiguous && ++line == row_lines) {
      line = 0;
      ++row;
    }
    ++issued;
  }
  __attribute__((always_inline)) void advance(int64_t n) {
    if (!k) return;
    credit += n * pairs;
    for (; credit >= units && issued < pairs; credit -= units) issue();
  }
  void finish() {
    if (k)
      while (issued < pairs) issue();
  }
};

// No read-ahead: a run of blocks that every row of a short verification reads whole (whole_blocks in
// cache_attention_body.h) leaves the next block to the hardware's prefetchers.
struct NoReadAhead {
  void advance(int64_t) {}
};

inline int64_t floor_to(int64_t x, int64_t step) { return x / step * step; }  // x >= 0

struct Problem {
  const float* q;  // (Hkv, R, D) scaled queries, row r = t G + g being query head h G + g, query t
  const at::Half *k, *v;
  int64_t k_head, k_row, v_head, v_row;  // strides, in elements
  int64_t rows, group, queries, keys, dim, origin, window;
  int64_t segment;                  // keys a segment holds, aligned to absolute positions
  int64_t first_segment, segments;  // the segments any row reads
  float* partials;                  // (Hkv, segments, R, 2 + D): maximum, sum of exponentials, unnormalised output

  int64_t last_key(int64_t r) const { return keys - queries + r / group; }
  int64_t first_key(int64_t r) const { return window > 0 ? std::max<int64_t>(0, last_key(r) - window + 1) : 0; }
  int64_t segment_of(int64_t position) const { return position / segment; }
  // the view indices [segment_begin(s), segment_end(s)) of the keys segment s holds
  int64_t segment_begin(int64_t s) const { return std::max<int64_t>(0, s * segment - origin); }
  int64_t segment_end(int64_t s) const { return std::min<int64_t>(keys, (s + 1) * segment - origin); }
  float* partial(int64_t head, int64_t segment, int64_t r) const {
    return partials + ((head * segments + segment - first_segment) * rows + r) * (2 + dim);
  }
};

struct Body {
  void (*attend_unit)(const Problem&, int64_t head, int64_t row0, int64_t rows, int64_t segment, float* scratch);
  void (*combine_row)(const Problem&, int64_t head, int64_t r, float* out);
  int64_t (*scratch)(int64_t dim);
};

// 2^x as vector_exp.h computes it, one float at a time: the same clamp, rounding, polynomial and scaling.
inline float exp2_scalar(float x) {
  using namespace triforce_cpu;
  const float clamped = std::max(x, kExp2Low);
  const float n = std::nearbyint(clamped);
  const float f = clamped - n;
  float p = std::fma(kExp2Poly[6], f, kExp2Poly[5]);
  for (int i = 4; i >= 0; --i) p = std::fma(p, f, kExp2Poly[i]);
  return std::ldexp(p, int(n));
}

}  // namespace

// ---- AVX-512: 16 keys or 16 columns of D a register

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace avx512 {
namespace {

struct Ops {
  static constexpr int64_t kLanes = 16;
  static constexpr int kValueRows = 6;     // x 4 column vectors: 24 accumulators
  static constexpr int kValueColumns = 4;
  static constexpr int64_t kDirectRows = 9;  // 3 grouped heads: a decode step, a verification of 2 or 3 tokens
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
  static V exp2(V x) { return triforce_cpu::exp2_512(x); }
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
  // Scores take one vector of 16 keys at a time. Lane l (0..7) of a pair (row r, key j) takes p_l = the FMA chain
  // over c = 0 .. D/8-1 of q_r[8 c + l] k_j[8 c + l], then ((p_0 + p_4) + (p_2 + p_6)) + ((p_1 + p_5) + (p_3 + p_7)):
  // the AVX2 body's order, in which a key's 8 columns serve as they lie. Read directly (a decode step's few rows),
  // the keys go in 8 pairs, pair p holding key 2 p's columns 8 c .. 8 c + 7 in lanes 0..7 and key 2 p + 1's in lanes
  // 8..15, against the row's 8 columns in both halves (octet); packed for many rows, in 4 groups of 4, group g
  // holding keys 4 g .. 4 g + 3, key 4 g + i in 128-bit block i, one quad (4 columns) at a time, against the row's
  // quad in every block (quad), the even quads (p_0..p_3) and the odd ones (p_4..p_7) in accumulators of their
  // own. Either way the sums then run level by level (pair_sum or the groups' two accumulators added, half_sum,
  // scores_of), and a pair's order depends on nothing else: the same bits for it whichever rows and keys go with
  // it, packed or read directly.
  static constexpr int kScoreRows = 6;  // packed: two groups at a time, x 2 accumulators each: 24
  // columns 8 c .. 8 c + 7 of two keys, a and b, widened into one vector
  __attribute__((always_inline)) static V key_pair(const at::Half* a, const at::Half* b) {
    const __m256i low = _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(low, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
  }
  // 8 columns of a row in both halves (vbroadcastf64x4: AVX-512F's broadcast of 256 bits)
  static V octet(const float* at) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(at))));
  }
  // quad m of a row in every block
  static V quad(const float* at) { return _mm512_broadcast_f32x4(_mm_loadu_ps(at)); }
  // The sums of a row's p_l, level by level. t: keys 4 i .. 4 i + 3, key 4 i + b in 128-bit block b, whose lane l
  // holds s_l = p_l + p_l+4; pair_sum takes it from pairs 2 i and 2 i + 1.
  __attribute__((always_inline)) static V pair_sum(V a, V b) {
    return add(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  // u from two t: block b holds (s_0 + s_2), (s_1 + s_3) of the first t's key, then of the second's
  __attribute__((always_inline)) static V half_sum(V t0, V t1) {
    return add(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xEE));
  }
  // the 16 scores from keys 0..7's u and keys 8..15's: lane i of block b holds key 4 i + b's, which the permutation
  // puts in lane 4 i + b
  __attribute__((always_inline)) static V scores_of(V u0, V u1) {
    const V s = add(_mm512_shuffle_ps(u0, u1, 0x88), _mm512_shuffle_ps(u0, u1, 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);
  }
  // A row's u of keys 0..7 (pass 0), parked in its 16 scores, or of keys 8..15 (pass 1), taken with the parked one
  // into the scores
  __attribute__((always_inline)) static void finish_pass(int pass, float* row, V u) {
    store(row, pass == 0 ? u : scores_of(load(row), u));
  }
  // k[m] = quad m of 4 keys' 16 float16 columns (rows `stride` apart), key i in block i: each row widened, then a
  // 4 x 4 transpose of 128-bit blocks
  static void key_quads(const at::Half* keys, int64_t stride, V k[4]) {
    for (int i = 0; i < 4; ++i) k[i] = widen16(keys + i * stride);
    const V t0 = _mm512_shuffle_f32x4(k[0], k[1], 0x44), t1 = _mm512_shuffle_f32x4(k[0], k[1], 0xEE);
    const V t2 = _mm512_shuffle_f32x4(k[2], k[3], 0x44), t3 = _mm512_shuffle_f32x4(k[2], k[3], 0xEE);
    k[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
    k[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
    k[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
    k[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
  }
  // 16 keys (rows `stride` apart) to packed (16 D): quad m of group g at (4 m + g) 16
  static void pack_keys(const at::Half* keys, int64_t stride, int64_t dim, float* packed) {
    for (int g = 0; g < 4; ++g)
      for (int64_t c = 0; c < dim; c += 16) {
        V k[4];
        key_quads(keys + 4 * g * stride + c, stride, k);
        for (int m = 0; m < 4; ++m) store(packed + ((c / 4 + m) * 4 + g) * 16, k[m]);
      }
  }
  // The scores of R query rows q (R, D) against 16 packed keys into scores (R, 16), rows kBlock apart: groups 0, 1,
  // then 2, 3, the first pass's u left in the row's scores until the second one's is taken with it.
  template <int kDim, int R>
  static void score(const float* q, const float* packed, int64_t dim, float* scores) {
    const int64_t d_end = kDim ? kDim : dim;
    for (int pass = 0; pass < 2; ++pass) {
      V acc[R][4];  // group 2 pass + j's even quads at 2 j, its odd ones at 2 j + 1
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i) acc[r][i] = zero();
      for (int64_t c = 0; c < d_end; c += 8) {
        const float* at = packed + (c + 2 * pass) * 16;  // quad c / 4 of group 2 pass; quad c / 4 + 1 is 4 after
        const V even0 = load(at), even1 = load(at + 16), odd0 = load(at + 64), odd1 = load(at + 80);
        for (int r = 0; r < R; ++r) {
          const V even = quad(q + r * d_end + c), odd = quad(q + r * d_end + c + 4);
          acc[r][0] = fma(even, even0, acc[r][0]);
          acc[r][1] = fma(odd, odd0, acc[r][1]);
          acc[r][2] = fma(even, even1, acc[r][2]);
          acc[r][3] = fma(odd, odd1, acc[r][3]);
        }
      }
      for (int r = 0; r < R; ++r)
        finish_pass(pass, scores + r * kBlock, half_sum(add(acc[r][0], acc[r][1]), add(acc[r][2], acc[r][3])));
    }
  }
  // The same scores of 16 float16 keys read as they lie (rows `stride` apart), each pair widened as the FMAs take it.
  template <int kDim, int R>
  static void score_direct(const float* q, const at::Half* keys, int64_t stride, int64_t dim, float* scores) {
    const int64_t d_end = kDim ? kDim : dim;
    static_assert(R <= kScoreRows, "score_rows tiles rows by kScoreRows");
    if constexpr (R > 3) {  // pairs 0..3, then 4..7, each widened once for every row; as score's passes
      for (int pass = 0; pass < 2; ++pass) {
        V acc[R][4];
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 4; ++j) acc[r][j] = zero();
        for (int64_t c = 0; c < d_end; c += 8) {
          V key[4];
          for (int j = 0; j < 4; ++j) {
            const int p = 4 * pass + j;
            key[j] = key_pair(keys + 2 * p * stride + c, keys + (2 * p + 1) * stride + c);
          }
          for (int r = 0; r < R; ++r) {
            const V query = octet(q + r * d_end + c);
            for (int j = 0; j < 4; ++j) acc[r][j] = fma(query, key[j], acc[r][j]);
          }
        }
        for (int r = 0; r < R; ++r) {
          const V u = half_sum(pair_sum(acc[r][0], acc[r][1]), pair_sum(acc[r][2], acc[r][3]));
          finish_pass(pass, scores + r * kBlock, u);
        }
      }
      return;
    }
    V acc[R][8];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < 8; ++p) acc[r][p] = zero();
    for (int64_t c = 0; c < d_end; c += 8) {
      V query[R];
      for (int r = 0; r < R; ++r) query[r] = octet(q + r * d_end + c);
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const V key = key_pair(keys + 2 * p * stride + c, keys + (2 * p + 1) * stride + c);
        for (int r = 0; r < R; ++r) acc[r][p] = fma(query[r], key, acc[r][p]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const V u0 = half_sum(pair_sum(acc[r][0], acc[r][1]), pair_sum(acc[r][2], acc[r][3]));
      const V u1 = half_sum(pair_sum(acc[r][4], acc[r][5]), pair_sum(acc[r][6], acc[r][7]));
      store(scores + r * kBlock, scores_of(u0, u1));
    }
  }
};

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
  static constexpr int kValueRows = 3;     // x 4 column vectors: 12 accumulators
  static constexpr int kValueColumns = 4;
  static constexpr int64_t kDirectRows = 3;
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
  static V exp2(V x) { return triforce_cpu::exp2_256(x); }
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
  // The scores of R = 1 query row q (D) against 8 keys (rows `stride` apart, float32 or float16) into scores (8). Key j's lanes l = 0..7 take
  // p_l = the FMA chain over c = 0 .. D/8-1 of q[8 c + l] k_j[8 c + l], then the fixed tree
  // ((p_0 + p_4) + (p_2 + p_6)) + ((p_1 + p_5) + (p_3 + p_7)). Accumulator 2 i + h holds key 4 h + i, the order
  // the butterfly's levels leave in lanes 0..7.
  static constexpr int kScoreRows = 1;
  template <int kDim, int R, typename T>
  static void score_keys(const float* q, const T* keys, int64_t stride, int64_t dim, float* scores) {
    const int64_t d_end = kDim ? kDim : dim;
    V p[8];
    for (int i = 0; i < 8; ++i) p[i] = zero();
    for (int64_t c = 0; c < d_end; c += 8) {
      const V query = load(q + c);
      for (int i = 0; i < 8; ++i) p[i] = fma(query, load(keys + ((i % 2) * 4 + i / 2) * stride + c), p[i]);
    }
    V t[4];  // t[i]: halves p_l + p_l+4 of accumulators 2 i, 2 i + 1
    for (int i = 0; i < 4; ++i)
      t[i] = add(_mm256_permute2f128_ps(p[2 * i], p[2 * i + 1], 0x20), _mm256_permute2f128_ps(p[2 * i], p[2 * i + 1], 0x31));
    V u[2];  // u[i], half h: lanes 0, 1 of accumulator 4 i + h, lanes 2, 3 of accumulator 4 i + 2 + h
    for (int i = 0; i < 2; ++i)
      u[i] = add(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    store(scores, add(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD)));
  }
  // Packed keys are the widened rows, one after the other; their scores and the direct ones are score_keys'.
  static void pack_keys(const at::Half* keys, int64_t stride, int64_t dim, float* packed) {
    for (int64_t j = 0; j < kLanes; ++j) widen(keys + j * stride, packed + j * dim, dim);
  }
  template <int kDim, int R>
  static void score(const float* q, const float* packed, int64_t dim, float* scores) {
    score_keys<kDim, R>(q, packed, dim, dim, scores);
  }
  template <int kDim, int R>
  static void score_direct(const float* q, const at::Half* keys, int64_t stride, int64_t dim, float* scores) {
    score_keys<kDim, R>(q, keys, stride, dim, scores);
  }
};

#include "cache_attention_body.h"

}  // namespace
}  // namespace avx2
#pragma GCC pop_options

// ---- plain C++: any D, any CPU; one key or one column at a time, the same orders of arithmetic

namespace plain {
namespace {

struct Ops {
  static constexpr int64_t kLanes = 1;
  static constexpr int kValueRows = 4;
  static constexpr int kValueColumns = 4;
  static constexpr int64_t kDirectRows = 4;
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
  static V exp2(V x) { return exp2_scalar(x); }
  static float first(V x) { return x; }
  static float reduce_add(V x) { return x; }
  static float reduce_max(V x) { return x; }
  static V hide(V x, int64_t lane0, int64_t lo, int64_t hi) { return lane0 < lo || lane0 > hi ? kMinusInf : x; }
  static void widen(const at::Half* from, float* to, int64_t n) {
    for (int64_t i = 0; i < n; ++i) to[i] = static_cast<float>(from[i]);  // exact
  }
  // The score of R = 1 query row q (D) against one key (D) into scores (1): the FMA chain over d = 0 .. D-1.
  static constexpr int kScoreRows = 1;
  template <int kDim, int R, typename T>
  static void score_keys(const float* q, const T* key, int64_t, int64_t dim, float* scores) {
    const int64_t d_end = kDim ? kDim : dim;
    float acc = 0.f;
    for (int64_t d = 0; d < d_end; ++d) acc = std::fma(q[d], load(key + d), acc);
    *scores = acc;
  }
  // Packed keys are the widened rows, one after the other; their scores and the direct ones are score_keys'.
  static void pack_keys(const at::Half* keys, int64_t stride, int64_t dim, float* packed) {
    for (int64_t j = 0; j < kLanes; ++j) widen(keys + j * stride, packed + j * dim, dim);
  }
  template <int kDim, int R>
  static void score(const float* q, const float* packed, int64_t dim, float* scores) {
    score_keys<kDim, R>(q, packed, dim, dim, scores);
  }
  template <int kDim, int R>
  static void score_direct(const float* q, const at::Half* keys, int64_t stride, int64_t dim, float* scores) {
    score_keys<kDim, R>(q, keys, stride, dim, scores);
  }
};

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

// The checks cache_attention makes of its view against q_heads query heads of dim D and T = queries queries.
void check_queries(const triforce_cpu::CacheView& view, int64_t q_heads, int64_t queries, int64_t dim) {
  TORCH_CHECK(queries >= 1 && dim >= 1, "q: at least one query and one dimension");
  TORCH_CHECK(view.dim == dim, "k, v: (Hkv, L, D) with q's D");
  TORCH_CHECK(view.kv_heads >= 1 && q_heads % view.kv_heads == 0, "q: a multiple of the ", view.kv_heads,
              " KV heads");
  TORCH_CHECK(view.keys >= queries, "k: the queries' own keys last, at least T = ", queries, " of them");
}

// q (Hq, T, D) float32, k, v (Hkv, L, D) float16 -> (Hq, T, D) float32; see the top of the file.
at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                           int64_t origin, int64_t window, int64_t segment) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.scalar_type() == at::kFloat,
              "q: a float32 CPU tensor (query heads, queries, head dim)");
  const int64_t q_heads = q.size(0), queries = q.size(1), dim = q.size(2);
  const triforce_cpu::CacheView view = triforce_cpu::cache_view(k, v);
  check_queries(view, q_heads, queries, dim);
  const int64_t kv_heads = view.kv_heads, group = q_heads / kv_heads;
  // (Hkv, T, G, D) queries scaled by scale log2(e), for scores in base 2: row r = t G + g of KV head h is query t
  // of head h G + g
  const at::Tensor scaled =
      q.mul(float(scale * 1.4426950408889634)).view({kv_heads, group, queries, dim}).transpose(1, 2).contiguous();
  at::Tensor out = at::empty({kv_heads, queries, group, dim}, q.options());  // rows in the scaled queries' order
  triforce_cpu::cache_attention_rows(scaled.data_ptr<float>(), q_heads, queries, view, origin, window, segment,
                                     out.data_ptr<float>(), queries * group * dim, group * dim);
  return out.transpose(1, 2).reshape({q_heads, queries, dim});
}

}  // namespace

namespace triforce_cpu {

CacheView cache_view(const at::Tensor& k, const at::Tensor& v) {
  check_cache(k, "k");
  check_cache(v, "v");
  TORCH_CHECK(v.sizes() == k.sizes(), "k, v: (Hkv, L, D) both");
  return CacheView{k.data_ptr<at::Half>(), v.data_ptr<at::Half>(), k.size(0), k.size(1), k.size(2),
                   k.stride(0), k.stride(1), v.stride(0), v.stride(1)};
}

void cache_attention_rows(const float* scaled, int64_t q_heads, int64_t queries, const CacheView& view,
                          int64_t origin, int64_t window, int64_t segment, float* out, int64_t head_stride,
                          int64_t time_stride) {
  const int64_t dim = view.dim, kv_heads = view.kv_heads, keys = view.keys;
  check_queries(view, q_heads, queries, dim);
  TORCH_CHECK(origin >= 0, "origin: an absolute position, >= 0");
  TORCH_CHECK(segment > 0 && segment % kBlock == 0, "segment: a positive multiple of ", kBlock, " keys");
  const int64_t group = q_heads / kv_heads, rows = group * queries;
  Problem p{scaled, view.k, view.v, view.k_head, view.k_row, view.v_head, view.v_row,
            rows, group, queries, keys, dim, origin, window, segment, 0, 0, nullptr};
  p.first_segment = p.segment_of(origin + p.first_key(0));
  p.segments = p.segment_of(origin + keys - 1) - p.first_segment + 1;
  // the calling thread's partials, kept from call to call as the units' scratch is
  thread_local std::vector<float> partials;
  const size_t partial_floats = size_t(kv_heads * p.segments * rows * (2 + dim));
  if (partials.size() < partial_floats) partials.resize(partial_floats);
  p.partials = partials.data();

  const Body body = chosen_body(dim);
  const int64_t row_groups = (rows + kGroupRows - 1) / kGroupRows;
  const int64_t units = kv_heads * row_groups * p.segments;
  struct Unit {
    int64_t head, row0, rows, segment;
  };
  const auto unit_at = [&](int64_t unit) {  // KV head, then group of rows, then segment
    const int64_t row0 = unit / p.segments % row_groups * kGroupRows;
    return Unit{unit / p.segments / row_groups, row0, std::min(kGroupRows, rows - row0),
                p.first_segment + unit % p.segments};
  };
  const auto unit_work = [&](int64_t unit) {  // the keys of its segment within the view x its rows
    const Unit u = unit_at(unit);
    return double(p.segment_end(u.segment) - p.segment_begin(u.segment)) * u.rows;
  };
  // Threads take runs of consecutive units of about equal work, not of equal count: a view's last segment may hold
  // a few keys (3 heads of 1,040 keys in segments of 512, 512 and 16: split by count, one thread reads twice the
  // keys of the other). A unit is the same work whichever thread runs it.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  std::vector<int64_t> first_unit(threads + 1, units);  // thread t runs units [first_unit[t], first_unit[t + 1])
  first_unit[0] = 0;
  double total = 0, done = 0;
  for (int64_t unit = 0; unit < units; ++unit) total += unit_work(unit);
  for (int64_t unit = 0, t = 0; unit < units; ++unit) {  // a unit goes to the thread its middle falls to
    const double work = unit_work(unit);
    const int64_t owner = std::min<int64_t>(threads - 1, int64_t((done + work / 2) * threads / total));
    while (t < owner) first_unit[++t] = unit;
    done += work;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    // a thread's scratch, kept from call to call (allocating and zeroing it took a few microseconds a call, 30 calls
    // a decode step); a unit writes every part of it before reading it
    thread_local std::vector<float> scratch;
    if (scratch.size() < size_t(body.scratch(dim))) scratch.resize(body.scratch(dim));
    for (int64_t unit = first_unit[begin]; unit < first_unit[end]; ++unit) {
      const Unit u = unit_at(unit);
      body.attend_unit(p, u.head, u.row0, u.rows, u.segment, scratch.data());
    }
  });
  // merging a row's segments is a few vectors a segment: a decode step's rows are merged by the calling thread
  at::parallel_for(0, kv_heads * rows, kCombineRows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t head = i / rows, r = i % rows;  // r = t G + g
      body.combine_row(p, head, r, out + head * head_stride + r / group * time_stride + r % group * dim);
    }
  });
}

}  // namespace triforce_cpu

TORCH_LIBRARY_FRAGMENT(triforce_cpu, lib) {
  lib.def("cache_attention(Tensor q, Tensor k, Tensor v, float scale, int origin, int window, int segment) -> Tensor",
          &cache_attention);
}

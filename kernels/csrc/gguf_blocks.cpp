// Products with GGUF weight blocks kept packed, 32 weights a block: 4-bit q's (Q4_0, Q4_1, Q4_K) and 8-bit ones
// (Q8_0; Q5_0, Q5_1, Q5_K and Q6_K, whose 5 and 6 bits are held in a byte).
//
// A block holds w = d * q + m for its 32 weights (m = 0 where there are no minimums), d and m float32 here (the
// loader, kernels/gguf.py, computes them from the file's float16 and 6- or 8-bit scales exactly as gguf-py's
// dequantization does). Q6_K has a d per 16 weights: two a block. The loader lays the blocks out in tiles of 16
// output rows:
//   4-bit: q (N/16, K/32, 16, 16) uint8, byte [j][lane] = q[row lane, 32 b + j] | q[row lane, 32 b + 16 + j] << 4
//   8-bit: q (N/16, K/32, 32, 16) int8,  byte [j][lane] = q[row lane, 32 b + j]
//   d:     (N/16, K/32 * groups, 16) float32, groups = 1 or 2 scales a block (the second for weights 16..31)
//   m:     (N/16, K/32, 16) float32, or none (groups = 1 only)
// so that one 16-byte load gives one weight column for 16 output rows, and a tile's 16 outputs are one AVX-512
// register (two AVX2 ones).
//
// Few activation rows (decode and verification steps) take, per block, d * sum(q * x) + m * sum(x) (with two
// scales, each half's sum times its d); many rows (a prefill chunk) rebuild each tile's weights as d * q + m, rounded
// exactly as the plain dequantization rounds them, and multiply those. Either way the result is the product with the
// dequantized weights up to the rounding of float32 sums: the activations are never rounded below float32, which is
// why the int8 and bf16 dot-product units (AVX512-VNNI, AVX512-BF16, AMX) are not used. One source, three bodies:
// AVX-512, AVX2+FMA and plain C++, picked at run time by what the CPU has (isa.h); tiles of output rows are split
// over torch's intra-op threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "isa.h"

namespace {

using triforce_cpu::best_isa;
using triforce_cpu::chosen_isa;
using triforce_cpu::Isa;

constexpr int64_t kBlock = 32;
constexpr int64_t kLanes = 16;  // output rows in a tile

struct Blocks {
  const uint8_t* q;
  const float* d;
  const float* m;  // nullptr where there are no minimums
  int64_t tiles, blocks;
  bool four_bit;
  int64_t groups;  // scales a block: 1, or 2 (one per 16 weights)

  int64_t block_bytes() const { return four_bit ? kBlock / 2 * kLanes : kBlock * kLanes; }
  const uint8_t* q_at(int64_t tile, int64_t b) const { return q + (tile * blocks + b) * block_bytes(); }
  // the 16 lanes' scale of block b's weights 16 * half.., (minimums: half 0, one a block)
  int64_t scale_at(int64_t tile, int64_t b, int64_t half = 0) const {
    return ((tile * blocks + b) * groups + (groups == 2 ? half : 0)) * kLanes;
  }
  int64_t minimum_at(int64_t tile, int64_t b) const { return (tile * blocks + b) * kLanes; }
};

struct Rows {  // activations x (T, K), their sums over each block (T, K/32) and outputs (T, N), row-major
  const float* x;
  const float* sums;
  float* out;
  int64_t k, n;

  Rows from(int64_t row) const { return Rows{x + row * k, sums + row * (k / kBlock), out + row * n, k, n}; }
};

// A tile's weights rebuilt as float32 d * q + m (two roundings, as the plain dequantization): buffer (K, stride),
// the tile's 16 rows in the first 16 columns. Branch-free, so that the compiler vectorises it for the target of
// the body it is inlined into.
inline void dequantize_tile(const Blocks& w, int64_t tile, float* buffer, int64_t stride = kLanes) {
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* qb = w.q_at(tile, b);
    float* out = buffer + b * kBlock * stride;
    const float* m = w.m ? w.m + w.minimum_at(tile, b) : nullptr;
    for (int half = 0; half < 2; ++half) {  // weights 16 * half + j, j < 16
      const float* d = w.d + w.scale_at(tile, b, half);
      float* half_out = out + half * 16 * stride;
      if (w.four_bit) {
        for (int j = 0; j < 16; ++j)
          for (int lane = 0; lane < kLanes; ++lane)
            half_out[j * stride + lane] = d[lane] * float((qb[j * kLanes + lane] >> (4 * half)) & 0xF) + m[lane];
      } else {
        const int8_t* qs = reinterpret_cast<const int8_t*>(qb) + half * 16 * kLanes;
        if (m) {
          for (int j = 0; j < 16; ++j)
            for (int lane = 0; lane < kLanes; ++lane)
              half_out[j * stride + lane] = d[lane] * float(qs[j * kLanes + lane]) + m[lane];
        } else {
          for (int j = 0; j < 16; ++j)
            for (int lane = 0; lane < kLanes; ++lane) half_out[j * stride + lane] = d[lane] * float(qs[j * kLanes + lane]);
        }
      }
    }
  }
}

// Plain C++: every tile's weights rebuilt, then summed row by row (CPUs without AVX2, and the tests' reference).
void tiles_scalar(const Blocks& w, const Rows& io, int64_t rows, int64_t tile_begin, int64_t tile_end) {
  std::vector<float> buffer(io.k * kLanes);  // (K, 16)
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    dequantize_tile(w, tile, buffer.data());
    for (int64_t t = 0; t < rows; ++t) {
      float acc[kLanes] = {};
      for (int64_t i = 0; i < io.k; ++i)
        for (int lane = 0; lane < kLanes; ++lane) acc[lane] += buffer[i * kLanes + lane] * io.x[t * io.k + i];
      std::copy(acc, acc + kLanes, io.out + t * io.n + tile * kLanes);
    }
  }
}

// AVX-512, few rows: a tile's 16 outputs are one register. For each block, R activation rows accumulate
// q * x in two registers each (the block's first and second 16 weights, so that consecutive multiply-adds do not
// wait on each other); then acc += d * that + m * sum(x over the block). A 4-bit q becomes a float by a table
// lookup (vpermps reads the low 4 bits of each index), an 8-bit one by conversion.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void tiles_avx512(const Blocks& w, const Rows& io,
                                                                       int64_t tile_begin, int64_t tile_end) {
  const __m512 integers = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* qb = w.q_at(tile, b);
      const float* xb = io.x + b * kBlock;
      __m512 dot[R][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_ps();
      for (int j = 0; j < 16; ++j) {
        __m512 first, second;  // columns j and j + 16 of the block, for the tile's 16 rows
        if (w.four_bit) {
          const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + j * kLanes)));
          first = _mm512_permutexvar_ps(bytes, integers);
          second = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), integers);
        } else {
          const __m128i* column = reinterpret_cast<const __m128i*>(qb + j * kLanes);
          first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(column)));
          second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(column + 16)));
        }
        for (int r = 0; r < R; ++r) {
          dot[r][0] = _mm512_fmadd_ps(first, _mm512_set1_ps(xb[r * io.k + j]), dot[r][0]);
          dot[r][1] = _mm512_fmadd_ps(second, _mm512_set1_ps(xb[r * io.k + 16 + j]), dot[r][1]);
        }
      }
      const __m512 d = _mm512_loadu_ps(w.d + w.scale_at(tile, b));
      if (w.groups == 2) {
        const __m512 d_second = _mm512_loadu_ps(w.d + w.scale_at(tile, b, 1));
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(dot[r][1], d_second, _mm512_fmadd_ps(dot[r][0], d, acc[r]));
      } else {
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_add_ps(dot[r][0], dot[r][1]), d, acc[r]);
      }
      if (w.m) {
        const __m512 m = _mm512_loadu_ps(w.m + w.minimum_at(tile, b));
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(io.sums[r * w.blocks + b]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(io.out + r * io.n + tile * kLanes, acc[r]);
  }
}

// AVX2, few rows: as AVX-512, the tile's 16 outputs as two registers done one after the other, 4-bit q's
// converted (an 8-entry permute cannot hold the 16 values).
template <int R>
__attribute__((target("avx2,fma"))) void tiles_avx2(const Blocks& w, const Rows& io, int64_t tile_begin,
                                                    int64_t tile_end) {
  const __m256i low = _mm256_set1_epi32(0xF);
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    for (int half = 0; half < 2; ++half) {
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* qb = w.q_at(tile, b) + half * 8;
        const float* xb = io.x + b * kBlock;
        __m256 dot[R][2];
        for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_ps();
        for (int j = 0; j < 16; ++j) {
          __m256 first, second;
          if (w.four_bit) {
            const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + j * kLanes)));
            first = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low));
            second = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
          } else {
            const uint8_t* column = qb + j * kLanes;
            first = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(column))));
            second = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(column + 16 * kLanes))));
          }
          for (int r = 0; r < R; ++r) {
            dot[r][0] = _mm256_fmadd_ps(first, _mm256_set1_ps(xb[r * io.k + j]), dot[r][0]);
            dot[r][1] = _mm256_fmadd_ps(second, _mm256_set1_ps(xb[r * io.k + 16 + j]), dot[r][1]);
          }
        }
        const __m256 d = _mm256_loadu_ps(w.d + w.scale_at(tile, b) + half * 8);
        if (w.groups == 2) {
          const __m256 d_second = _mm256_loadu_ps(w.d + w.scale_at(tile, b, 1) + half * 8);
          for (int r = 0; r < R; ++r)
            acc[r] = _mm256_fmadd_ps(dot[r][1], d_second, _mm256_fmadd_ps(dot[r][0], d, acc[r]));
        } else {
          for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_add_ps(dot[r][0], dot[r][1]), d, acc[r]);
        }
        if (w.m) {
          const __m256 m = _mm256_loadu_ps(w.m + w.minimum_at(tile, b) + half * 8);
          for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(io.sums[r * w.blocks + b]), acc[r]);
        }
      }
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(io.out + r * io.n + tile * kLanes + half * 8, acc[r]);
    }
  }
}

// Many rows (a prefill chunk): the weights of four tiles are rebuilt as float32 into a buffer (K, 64), then a
// register-blocked product runs over all rows, kGemmDepth steps of k at a time: per step, four weight registers
// times 6 broadcast activations into 24 accumulators (AVX2: one tile, two registers, 12 accumulators).
constexpr int kGemmRows = 6;
constexpr int64_t kGemmDepth = 128;  // steps of k per pass over the rows: their weights and activations stay in L1

template <int R, int Tiles>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void gemm_rows_avx512(const float* buffer, const float* x,
                                                                           int64_t k, int64_t steps, float* out,
                                                                           int64_t n, bool first) {
  __m512 acc[R][Tiles];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < Tiles; ++c) acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * n + c * kLanes);
  for (int64_t i = 0; i < steps; ++i) {
    __m512 weights[Tiles];
    for (int c = 0; c < Tiles; ++c) weights[c] = _mm512_loadu_ps(buffer + (i * Tiles + c) * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * k + i]);
      for (int c = 0; c < Tiles; ++c) acc[r][c] = _mm512_fmadd_ps(weights[c], xr, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < Tiles; ++c) _mm512_storeu_ps(out + r * n + c * kLanes, acc[r][c]);
}

// The last rows < kGemmRows, in one pass of as many accumulators.
template <int Tiles, int R = kGemmRows - 1>
void gemm_tail_avx512(int64_t rows, const float* buffer, const float* x, int64_t k, int64_t steps, float* out,
                      int64_t n, bool first) {
  if constexpr (R > 1) {
    if (rows < R) return gemm_tail_avx512<Tiles, R - 1>(rows, buffer, x, k, steps, out, n, first);
  }
  gemm_rows_avx512<R, Tiles>(buffer, x, k, steps, out, n, first);
}

template <int Tiles>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void gemm_avx512(const Blocks& w, const Rows& io, int64_t rows,
                                                                      int64_t tile, float* buffer) {
  for (int c = 0; c < Tiles; ++c) dequantize_tile(w, tile + c, buffer + c * kLanes, Tiles * kLanes);
  float* out = io.out + tile * kLanes;
  for (int64_t k0 = 0; k0 < io.k; k0 += kGemmDepth) {
    const int64_t steps = std::min(kGemmDepth, io.k - k0);
    int64_t t = 0;
    for (; t + kGemmRows <= rows; t += kGemmRows)
      gemm_rows_avx512<kGemmRows, Tiles>(buffer + k0 * Tiles * kLanes, io.x + t * io.k + k0, io.k, steps, out + t * io.n, io.n,
                                         k0 == 0);
    if (t < rows)
      gemm_tail_avx512<Tiles>(rows - t, buffer + k0 * Tiles * kLanes, io.x + t * io.k + k0, io.k, steps, out + t * io.n, io.n,
                              k0 == 0);
  }
}

template <int R>
__attribute__((target("avx2,fma"))) void gemm_rows_avx2(const float* buffer, const float* x, int64_t k, float* out,
                                                        int64_t n) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 first = _mm256_loadu_ps(buffer + i * kLanes), second = _mm256_loadu_ps(buffer + i * kLanes + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_set1_ps(x[r * k + i]);
      acc[r][0] = _mm256_fmadd_ps(first, xr, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(second, xr, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * n, acc[r][0]);
    _mm256_storeu_ps(out + r * n + 8, acc[r][1]);
  }
}

template <int R>
void tiles(const Blocks& w, const Rows& io, int64_t tile_begin, int64_t tile_end) {
  switch (chosen_isa()) {
    case Isa::avx512: return tiles_avx512<R>(w, io, tile_begin, tile_end);
    case Isa::avx2: return tiles_avx2<R>(w, io, tile_begin, tile_end);
    default: return tiles_scalar(w, io, R, tile_begin, tile_end);
  }
}

// activation rows a pass over a tile's blocks keeps in registers: 3 each (AVX-512: 18 of 32; AVX2: 12 of 16)
constexpr int64_t kMaxRows = 6, kMaxRowsAvx2 = 4;
constexpr int64_t kGemmFrom = 64;  // from this many rows, rebuild each tile's weights once and run the product

void row_group(const Blocks& w, const Rows& io, int64_t rows, int64_t tile_begin, int64_t tile_end) {
  switch (rows) {
    case 1: return tiles<1>(w, io, tile_begin, tile_end);
    case 2: return tiles<2>(w, io, tile_begin, tile_end);
    case 3: return tiles<3>(w, io, tile_begin, tile_end);
    case 4: return tiles<4>(w, io, tile_begin, tile_end);
    case 5: return tiles<5>(w, io, tile_begin, tile_end);
    default: return tiles<6>(w, io, tile_begin, tile_end);
  }
}

__attribute__((target("avx2,fma"))) void gemm_avx2(const Blocks& w, const Rows& io, int64_t rows, int64_t tile,
                                                    float* buffer) {
  dequantize_tile(w, tile, buffer);
  float* out = io.out + tile * kLanes;
  int64_t t = 0;
  for (; t + 6 <= rows; t += 6)
    gemm_rows_avx2<6>(buffer, io.x + t * io.k, io.k, out + t * io.n, io.n);
  for (; t < rows; ++t) gemm_rows_avx2<1>(buffer, io.x + t * io.k, io.k, out + t * io.n, io.n);
}

void gemm(const Blocks& w, const Rows& io, int64_t rows, int64_t tile_begin, int64_t tile_end) {
  std::vector<float> buffer(4 * io.k * kLanes);
  int64_t tile = tile_begin;
  if (chosen_isa() == Isa::avx512) {
    for (; tile + 4 <= tile_end; tile += 4) gemm_avx512<4>(w, io, rows, tile, buffer.data());
    for (; tile < tile_end; ++tile) gemm_avx512<1>(w, io, rows, tile, buffer.data());
  } else {
    for (; tile < tile_end; ++tile) gemm_avx2(w, io, rows, tile, buffer.data());
  }
}

Blocks check_blocks(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m) {
  TORCH_CHECK(q.device().is_cpu() && q.is_contiguous() && q.dim() == 4 && q.size(3) == kLanes,
              "blocks: a contiguous CPU tensor (N/16, K/32, 16 or 32, 16)");
  const bool four_bit = q.scalar_type() == at::kByte;
  TORCH_CHECK((four_bit && q.size(2) == 16) || (q.scalar_type() == at::kChar && q.size(2) == kBlock),
              "blocks: uint8 with 16 bytes a column pair (4-bit) or int8 with 32 (8-bit)");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.dim() == 3 && d.size(0) == q.size(0) &&
                  (d.size(1) == q.size(1) || d.size(1) == 2 * q.size(1)) && d.size(2) == kLanes,
              "scales: float32 (N/16, K/32 or K/16, 16)");
  const int64_t groups = d.size(1) / q.size(1);
  const float* minimums = nullptr;
  if (m.has_value()) {
    TORCH_CHECK(groups == 1, "minimums: blocks with one scale only");
    TORCH_CHECK(m->scalar_type() == at::kFloat && m->is_contiguous() && m->sizes() == d.sizes(),
                "minimums: float32 (N/16, K/32, 16)");
    minimums = m->data_ptr<float>();
  }
  TORCH_CHECK(!four_bit || minimums, "4-bit blocks: with minimums");
  return Blocks{static_cast<const uint8_t*>(q.data_ptr()), d.data_ptr<float>(), minimums, q.size(0), q.size(1),
                four_bit, groups};
}

// x (T, K) float32 -> (T, N): x @ W.T for the weight W (N, K) the blocks hold.
at::Tensor blocks_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                         const std::optional<at::Tensor>& m) {
  const Blocks w = check_blocks(q, d, m);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == w.blocks * kBlock,
              "x: float32 (T, K) with K = 32 * blocks");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1), n = w.tiles * kLanes;
  at::Tensor out = at::empty({rows, n}, xc.options());
  const bool many = rows >= kGemmFrom && chosen_isa() != Isa::scalar;
  // the activations' sums over each block, for the minimums' part of the few-row bodies: (T, K/32)
  const at::Tensor sums = w.m && !many ? xc.view({rows, w.blocks, kBlock}).sum(-1) : at::zeros({rows, w.blocks}, xc.options());
  const Rows io{xc.data_ptr<float>(), sums.data_ptr<float>(), out.data_ptr<float>(), k, n};
  // Tiles split over the threads; within a thread, each group of rows passes over its tiles, whose blocks stay
  // in its caches for the next group.
  const int64_t per_pass = chosen_isa() == Isa::avx2 ? kMaxRowsAvx2 : kMaxRows;
  at::parallel_for(0, w.tiles, 1, [&](int64_t tile_begin, int64_t tile_end) {
    if (many) return gemm(w, io, rows, tile_begin, tile_end);
    for (int64_t t = 0; t < rows; t += per_pass)
      row_group(w, io.from(t), std::min(per_pass, rows - t), tile_begin, tile_end);
  });
  return out;
}

std::string isa_name() {
  switch (chosen_isa()) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "scalar";
  }
}

// Run a given body from now on: 'avx512', 'avx2' or 'scalar' (the tests compare each body the CPU has).
void use_isa(const std::string& name) {
  const Isa best = best_isa();
  if (name == "scalar") chosen_isa() = Isa::scalar;
  else if (name == "avx2" && best != Isa::scalar) chosen_isa() = Isa::avx2;
  else if (name == "avx512" && best == Isa::avx512) chosen_isa() = Isa::avx512;
  else TORCH_CHECK(false, "this CPU cannot run the '", name, "' body");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triforce_cpu, lib) {
  lib.def("blocks_linear(Tensor x, Tensor q, Tensor d, Tensor? m) -> Tensor", &blocks_linear);
  lib.def("isa() -> str", &isa_name);
  lib.def("use_isa(str name) -> ()", &use_isa);
}

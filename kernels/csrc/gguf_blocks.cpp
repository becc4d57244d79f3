// Products with GGUF weight blocks kept packed, 32 weights a block: 4-bit q's (Q4_0, Q4_1, Q4_K) and 8-bit ones
// (Q8_0; Q5_0, Q5_1, Q5_K and Q6_K, whose 5 and 6 bits are held in a byte).
//
// A block holds w = d * q + m for its 32 weights (m = 0 where there are no minimums), d and m float32 here (the
// loader, kernels/gguf.py, computes them from the file's float16 and 6- or 8-bit scales exactly as gguf-py's
// dequantization does). Q6_K has a d per 16 weights: two a block. The loader lays the blocks out in tiles of 16
// output rows, block b of a tile being one record of R bytes, (N/16, K/32, R), that holds in turn
//   q:  4-bit: 256 bytes, byte 64 g + 4 lane + i = q[row lane, 32 b + 4 g + i] | q[row lane, 32 b + 16 + 4 g + i] << 4
//       8-bit: 512 bytes, byte 16 j + lane = q[row lane, 32 b + j] as int8
//   d:  float32 (groups, 16), groups = 1 or 2 scales a block (the second for weights 16..31)
//   m:  float32 (16), or none (groups = 1 only)
// so that a product reads one stream of whole cache lines (q's, d's and m's in three arrays of their own, a decode
// step's products ran at 0.75-0.8x the rate from memory, on the AMD EPYC below), one 64-byte load gives a 4-bit
// column quad of 4 weights (and their partners 16 on) for 16 output rows, shifted into place for a permutation that
// turns 4-bit q's into floats, and one 16-byte load an 8-bit column; a tile's 16 outputs are one AVX-512 register
// (two AVX2 ones).
//
// Every output element is computed in one order of arithmetic, whatever the number of activation rows T and the
// number of threads, so that a row gets the same bits in a decode step, a verification of drafts and a prefill chunk.
// Per block, the AVX-512 and AVX2 bodies take two 16-weight dots (fma along j from zero), then
// acc = fma(dot0 + dot1, d, acc) (two scales: fma(dot1, d1, fma(dot0, d0, acc))) and, with minimums,
// acc = fma(m, sum(x over the block), acc), the sum taken here in one order (block_sums); the plain body rebuilds
// w = d * q + m and adds w * x along k. Rows go through in passes of up to 6 (AVX2: 4) that differ only in how many
// rows share a q's conversion; threads split the output tiles; each body has its own order, none depends on T.
// Many rows (a prefill chunk) take the same passes, over chunks of tiles that stay in L2 (kChunkBytes). That was
// measured against the alternatives, AVX-512 on the 2-core AMD EPYC, Q4_1 and Q8_0, T = 256, CPU time of one
// thread, minimum of repeats:
// - rebuilding each tile's weights as d * q + m and multiplying those along k (the former prefill product, a
//   different order from the few-row one): the reference, 1.00;
// - these few-row passes over L2-sized chunks of tiles: 0.94-0.96 (Q4_1) and 0.86-0.90 (Q8_0) for N x K = 576 x 576,
//   1536 x 576, 576 x 1536 and 49152 x 576, and 0.87-1.01 of the former time for T = 1 to 8 (the same passes as
//   before, sum(x) no longer a separate torch reduction); on 2 threads 0.87-0.98 and 0.85-1.03;
// - the q's of 2 tiles turned into floats once into a buffer, then 4 or 5 rows x 2 tiles per pass in this same
//   per-block order: 0.96-1.10, slower than converting on the fly (its per-block scaling steps add 1/32 of the
//   multiply-adds per scale and the buffer's loads cost what the conversion did);
// - the rebuilt-weight order for every T would put a multiply and an add per weight on decode steps, whose speed is
//   bound by turning q's into floats: not taken.
// The AVX2 body, timed on the same CPU, decodes as before but takes 1.21-1.29x the former product for T = 256.
// The result is the product with the dequantized weights up to the rounding of float32 sums: the activations are
// never rounded below float32, which is why the int8 and bf16 dot-product units (AVX512-VNNI, AVX512-BF16, AMX) are
// not used. One source, three bodies: AVX-512, AVX2+FMA and plain C++, picked at run time by what the CPU has
// (isa.h); tiles of output rows are split over torch's intra-op threads.

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
#include "peak_rate.h"
#include "step_kernels.h"

namespace {

using triforce_cpu::best_isa;
using triforce_cpu::Blocks;
using triforce_cpu::chosen_isa;
using triforce_cpu::Isa;

constexpr int64_t kBlock = Blocks::kWeights;
constexpr int64_t kLanes = Blocks::kRows;  // output rows in a tile

struct Rows {  // activations x (T, K), their sums over each block (T, K/32) and outputs (T, N), row-major
  const float* x;
  const float* sums;
  float* out;
  int64_t k, n;

  Rows from(int64_t row) const { return Rows{x + row * k, sums + row * (k / kBlock), out + row * n, k, n}; }
};

// Weight i (< 32) of block b of output row `lane` of a tile, rebuilt as float32 d * q + m (two roundings, as the
// plain dequantization, kernels/gguf.py's dequantize).
inline float weight_at(const Blocks& w, int64_t tile, int64_t b, int64_t i, int64_t lane) {
  const uint8_t* qb = w.q_at(tile, b);
  const int64_t half = i / 16, j = i % 16;
  const float q = w.four_bit ? float((qb[j / 4 * 64 + lane * 4 + j % 4] >> (4 * half)) & 0xF)
                             : float(reinterpret_cast<const int8_t*>(qb)[i * kLanes + lane]);
  const float scaled = w.d_at(tile, b, half)[lane] * q;
  return w.minimums ? scaled + w.m_at(tile, b)[lane] : scaled;
}

// A tile's weights rebuilt (weight_at): buffer (K, 16).
void dequantize_tile(const Blocks& w, int64_t tile, float* buffer) {
  for (int64_t b = 0; b < w.blocks; ++b)
    for (int64_t i = 0; i < kBlock; ++i)
      for (int64_t lane = 0; lane < kLanes; ++lane)
        buffer[(b * kBlock + i) * kLanes + lane] = weight_at(w, tile, b, i, lane);
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

// Columns j and j + 16 of a block (first, second: the tile's 16 rows) times R rows' activations xb (rows k apart),
// added to dot[r][0] and dot[r][1].
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void add_columns512(__m512 (&dot)[R][2], const float* xb,
                                                                                int64_t k, int j, __m512 first,
                                                                                __m512 second) {
  for (int r = 0; r < R; ++r) {
    dot[r][0] = _mm512_fmadd_ps(first, _mm512_set1_ps(xb[r * k + j]), dot[r][0]);
    dot[r][1] = _mm512_fmadd_ps(second, _mm512_set1_ps(xb[r * k + 16 + j]), dot[r][1]);
  }
}

// AVX-512, few rows: a tile's 16 outputs are one register. For each block, R activation rows accumulate
// q * x in two registers each (the block's first and second 16 weights, so that consecutive multiply-adds do not
// wait on each other); then acc += d * that + m * sum(x over the block). A 4-bit q becomes a float by a table
// lookup (vpermps reads the low 4 bits of each index: a quad's dword shifted by 8 i for weight 4 g + i, by 8 i + 4
// for its partner 16 on), an 8-bit one by conversion.
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
      if (w.four_bit) {
        for (int g = 0; g < 4; ++g) {
          const __m512i quads = _mm512_loadu_si512(qb + g * 64);
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i)
            add_columns512<R>(dot, xb, io.k, 4 * g + i,
                              _mm512_permutexvar_ps(i ? _mm512_srli_epi32(quads, 8 * i) : quads, integers),
                              _mm512_permutexvar_ps(_mm512_srli_epi32(quads, 8 * i + 4), integers));
        }
      } else {
        for (int j = 0; j < 16; ++j) {
          const __m128i* column = reinterpret_cast<const __m128i*>(qb + j * kLanes);
          add_columns512<R>(dot, xb, io.k, j, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(column))),
                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(column + 16))));
        }
      }
      const __m512 d = _mm512_loadu_ps(w.d_at(tile, b));
      if (w.groups == 2) {
        const __m512 d_second = _mm512_loadu_ps(w.d_at(tile, b, 1));
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(dot[r][1], d_second, _mm512_fmadd_ps(dot[r][0], d, acc[r]));
      } else {
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_add_ps(dot[r][0], dot[r][1]), d, acc[r]);
      }
      if (w.minimums) {
        const __m512 m = _mm512_loadu_ps(w.m_at(tile, b));
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(io.sums[r * w.blocks + b]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(io.out + r * io.n + tile * kLanes, acc[r]);
  }
}

// add_columns512's AVX2 twin for half a tile (8 rows).
template <int R>
__attribute__((target("avx2,fma"))) inline void add_columns256(__m256 (&dot)[R][2], const float* xb, int64_t k, int j,
                                                               __m256 first, __m256 second) {
  for (int r = 0; r < R; ++r) {
    dot[r][0] = _mm256_fmadd_ps(first, _mm256_set1_ps(xb[r * k + j]), dot[r][0]);
    dot[r][1] = _mm256_fmadd_ps(second, _mm256_set1_ps(xb[r * k + 16 + j]), dot[r][1]);
  }
}

// AVX2, few rows: as AVX-512, the tile's 16 outputs as two registers done one after the other, 4-bit q's
// masked and converted (an 8-entry permute cannot hold the 16 values).
template <int R>
__attribute__((target("avx2,fma"))) void tiles_avx2(const Blocks& w, const Rows& io, int64_t tile_begin,
                                                    int64_t tile_end) {
  const __m256i low = _mm256_set1_epi32(0xF);
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    for (int half = 0; half < 2; ++half) {
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* qb = w.q_at(tile, b);
        const float* xb = io.x + b * kBlock;
        __m256 dot[R][2];
        for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_ps();
        if (w.four_bit) {
          for (int g = 0; g < 4; ++g) {
            const __m256i quads = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + g * 64 + half * 32));
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i)
              add_columns256<R>(dot, xb, io.k, 4 * g + i,
                                _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(quads, 8 * i), low)),
                                _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(quads, 8 * i + 4), low)));
          }
        } else {
          for (int j = 0; j < 16; ++j) {
            const uint8_t* column = qb + j * kLanes + half * 8;
            const __m128i* first = reinterpret_cast<const __m128i*>(column);
            const __m128i* second = reinterpret_cast<const __m128i*>(column + 16 * kLanes);
            add_columns256<R>(dot, xb, io.k, j, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(first))),
                              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(second))));
          }
        }
        const __m256 d = _mm256_loadu_ps(w.d_at(tile, b) + half * 8);
        if (w.groups == 2) {
          const __m256 d_second = _mm256_loadu_ps(w.d_at(tile, b, 1) + half * 8);
          for (int r = 0; r < R; ++r)
            acc[r] = _mm256_fmadd_ps(dot[r][1], d_second, _mm256_fmadd_ps(dot[r][0], d, acc[r]));
        } else {
          for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_add_ps(dot[r][0], dot[r][1]), d, acc[r]);
        }
        if (w.minimums) {
          const __m256 m = _mm256_loadu_ps(w.m_at(tile, b) + half * 8);
          for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(io.sums[r * w.blocks + b]), acc[r]);
        }
      }
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(io.out + r * io.n + tile * kLanes + half * 8, acc[r]);
    }
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
// bytes of blocks the passes of a thread's row groups share before the next tiles: they stay in its L2 cache
constexpr int64_t kChunkBytes = 256 * 1024;

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

// Each block's sum of its 32 activations, x[32 i] + x[32 i + 1] + ... + x[32 i + 31] in this one order, for the
// `count` blocks of x (rows of K = 32 * blocks, one after the other).
void block_sums(const float* x, int64_t count, float* sums) {
  for (int64_t i = 0; i < count; ++i) {
    const float* xb = x + i * kBlock;
    float sum = xb[0];
    for (int64_t j = 1; j < kBlock; ++j) sum += xb[j];
    sums[i] = sum;
  }
}

// x (T, K) float32 -> (T, N): x @ W.T for the weight W (N, K) the blocks hold.
at::Tensor blocks_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                         const std::optional<at::Tensor>& m) {
  const Blocks w = triforce_cpu::checked_blocks(q, d, m);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == w.blocks * kBlock,
              "x: float32 (T, K) with K = 32 * blocks");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = w.tiles * kLanes;
  at::Tensor out = at::empty({rows, n}, xc.options());
  // the activations' sums over each block, for the minimums' part of the vector bodies: (T, K/32)
  const at::Tensor sums = at::empty({rows, w.blocks}, xc.options());
  triforce_cpu::blocks_linear_rows(xc.data_ptr<float>(), rows, w, out.data_ptr<float>(), n, sums.data_ptr<float>());
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

namespace triforce_cpu {

// q, d and m (or none): views of one (N/16, K/32, R) uint8 tensor of records (kernels.gguf.PackedBlocks), q
// (N/16, K/32, 256 or 512) uint8, d (N/16, K/32, 16 groups) float32, m (N/16, K/32, 16) float32, each at its place
// in every record.
Blocks checked_blocks(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kByte && q.dim() == 3 && q.stride(2) == 1 &&
                  (q.size(2) == kBlock * kLanes / 2 || q.size(2) == kBlock * kLanes),
              "blocks: q, a CPU uint8 view (N/16, K/32, 256 or 512) of records");
  const bool four_bit = q.size(2) == kBlock * kLanes / 2;
  const int64_t tiles = q.size(0), blocks = q.size(1);
  const int64_t groups = d.dim() == 3 ? d.size(2) / kLanes : 0;
  const int64_t record = q.size(2) + (groups + m.has_value()) * kLanes * int64_t(sizeof(float));  // bytes
  // t (N/16, K/32, width) float32 at `offset` bytes into every record
  const auto at_offset = [&](const at::Tensor& t, int64_t offset, int64_t width) {
    return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 3 && t.size(0) == tiles &&
           t.size(1) == blocks && t.size(2) == width && t.stride(2) == 1 &&
           (blocks == 1 || t.stride(1) * int64_t(sizeof(float)) == record) &&
           (tiles == 1 || t.stride(0) * int64_t(sizeof(float)) == blocks * record) &&
           static_cast<const uint8_t*>(t.data_ptr()) == static_cast<const uint8_t*>(q.data_ptr()) + offset;
  };
  TORCH_CHECK((groups == 1 || groups == 2) && at_offset(d, q.size(2), groups * kLanes),
              "blocks: d, float32 (N/16, K/32, 16 or 32) in the records after q");
  if (m.has_value())
    TORCH_CHECK(groups == 1 && at_offset(*m, q.size(2) + groups * kLanes * int64_t(sizeof(float)), kLanes),
                "blocks: m, float32 (N/16, K/32, 16) in the records after d, with one scale a block");
  TORCH_CHECK(!four_bit || m.has_value(), "4-bit blocks: with minimums");
  TORCH_CHECK((blocks == 1 || q.stride(1) == record) && (tiles == 1 || q.stride(0) == blocks * record),
              "blocks: records of q, d and m back to back");
  TORCH_CHECK(q.storage_offset() + tiles * blocks * record <= int64_t(q.storage().nbytes()),
              "blocks: every record inside q's storage");
  return Blocks{static_cast<const uint8_t*>(q.data_ptr()), record, tiles, blocks, four_bit, m.has_value(), groups};
}

at::Tensor blocks_rows(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m,
                       const at::Tensor& ids) {
  const Blocks w = checked_blocks(q, d, m);
  TORCH_CHECK(ids.device().is_cpu() && ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids: int64 (R,) on the CPU");
  const at::Tensor rows = ids.contiguous();
  const int64_t count = rows.size(0), k = w.blocks * kBlock, n = w.tiles * kLanes;
  const int64_t* row = rows.data_ptr<int64_t>();
  at::Tensor out = at::empty({count, k}, d.options());
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < count; ++r) {
    TORCH_CHECK(row[r] >= 0 && row[r] < n, "ids: rows 0 to ", n - 1, " of the blocks, not ", row[r]);
    const int64_t tile = row[r] / kLanes, lane = row[r] % kLanes;
    for (int64_t b = 0; b < w.blocks; ++b)
      for (int64_t i = 0; i < kBlock; ++i) o[r * k + b * kBlock + i] = weight_at(w, tile, b, i, lane);
  }
  return out;
}

void blocks_linear_rows(const float* x, int64_t rows, const Blocks& w, float* out, int64_t out_stride, float* sums) {
  const int64_t k = w.blocks * kBlock;
  TORCH_CHECK(out_stride >= w.tiles * kLanes, "out: a row holds the product's ", w.tiles * kLanes, " outputs");
  if (w.minimums && chosen_isa() != Isa::scalar) block_sums(x, rows * w.blocks, sums);
  const Rows io{x, sums, out, k, out_stride};
  // Tiles split over the threads; within a thread, chunks of tiles one after the other, and each group of rows
  // passes over a chunk's tiles, whose blocks stay in its caches for the next group.
  const int64_t per_pass = chosen_isa() == Isa::avx2 ? kMaxRowsAvx2 : kMaxRows;
  const int64_t tile_bytes = w.blocks * w.record;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / tile_bytes);
  at::parallel_for(0, w.tiles, 1, [&](int64_t tile_begin, int64_t tile_end) {
    for (int64_t begin = tile_begin; begin < tile_end; begin += chunk)
      for (int64_t t = 0; t < rows; t += per_pass)
        row_group(w, io.from(t), std::min(per_pass, rows - t), begin, std::min(begin + chunk, tile_end));
  });
}

}  // namespace triforce_cpu

TORCH_LIBRARY_FRAGMENT(triforce_cpu, lib) {
  lib.def("blocks_linear(Tensor x, Tensor q, Tensor d, Tensor? m) -> Tensor", &blocks_linear);
  lib.def("blocks_rows(Tensor q, Tensor d, Tensor? m, Tensor ids) -> Tensor", &triforce_cpu::blocks_rows);
  lib.def("isa() -> str", &isa_name);
  lib.def("use_isa(str name) -> ()", &use_isa);
  lib.def("peak_flops(int rounds) -> float", &triforce_cpu::peak_flops);
}

// Products with dense weights (float32, or float16 widened to float32 as they are read) in one order of arithmetic
// per output element, whatever the number of activation rows and the thread count.
//
// The loader (kernels/linear.py) lays a weight W (N, K) out once in tiles of 16 output rows:
//   w (N/16, K, 16) float32 or float16, w[tile][i][lane] = W[16 tile + lane, i] (rows past N are zeros)
// so that one load gives column i for a tile's 16 rows: one AVX-512 register (two AVX2 ones).
//
// Every output element is acc = 0; acc = fma(W[n, i], x[t, i], acc) for i = 0, 1, ..., K - 1; out = acc + bias[n]:
// one chain along k, each step one rounding, the bias added once at the end. Every body computes exactly this, so a
// row's outputs are the same bits whether it comes alone (a decode step), among a few (a verification) or among
// hundreds (a prefill chunk), on one thread or several, and on any of the three bodies (AVX-512, AVX2+FMA+F16C and
// plain C++, picked at run time by what the CPU has: isa.h). What varies with the rows is only how many chains run
// side by side: a panel of R rows x C tiles keeps R * C accumulators in registers, and the weights of its C tiles are
// read once for its R rows. Few rows (decode, verification) take all of them in one panel and as many tiles as the
// registers hold (independent chains hide the multiply-add's latency); many rows (a prefill chunk) take panels of 6
// rows x 4 tiles over kDepth steps of k at a time, whose weights stay in L1 for every group of rows (float16 ones
// widened to float32 there once). A panel that continues a chain reloads its accumulators from the output, where
// they were stored as float32: nothing is rounded in between. Threads split the output tiles only.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "step_kernels.h"

namespace {

using triforce_cpu::chosen_isa;
using triforce_cpu::Isa;

constexpr int64_t kLanes = 16;    // output rows in a tile
constexpr int64_t kDepth = 128;   // steps of k per panel: 4 float32 tiles' weights are 32 KiB
constexpr int kFewRows = 8;       // up to this many rows, one panel holds them all
constexpr int kManyRows = 6;      // rows per panel above kFewRows (AVX-512 and AVX2)
constexpr int kManyTiles = 4;     // tiles per AVX-512 panel above kFewRows

// Tiles a panel of R rows keeps in registers: R * C accumulators, C weights and a broadcast activation within 32
// AVX-512 registers; AVX2 holds each tile in two of its 16 (where R = 1 the weights are multiply-add operands).
constexpr int max_tiles_avx512(int rows) { return rows <= 2 ? 8 : rows == 3 ? 7 : rows == 4 ? 6 : rows == 5 ? 5 : rows == 6 ? 4 : 3; }
constexpr int max_tiles_avx2(int rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }

template <typename W>
struct Tiles {  // the packed weight
  const W* w;
  int64_t tiles, k;

  const W* at(int64_t tile, int64_t i) const { return w + (tile * k + i) * kLanes; }
};

template <typename W>
struct Panel {  // a panel's weights: tile c's column i at base + c * tile_stride + i * kLanes
  const W* base;
  int64_t tile_stride;
};

struct Rows {  // activations x (T, K), the bias (N/16 * 16) or nullptr, outputs (T, N/16 * 16), row-major
  const float* x;
  const float* bias;
  float* out;
  int64_t k, n;
};

// A panel: rows x tiles' accumulators continued over steps [i0, i0 + steps) of k; first: they start at 0, else from
// out; last: out gets them plus the bias.
struct Span {
  int64_t i0, steps;
  bool first, last;
};

#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

TARGET_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TARGET_AVX512 inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
TARGET_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
TARGET_AVX2 inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int R, int C, typename W>
TARGET_AVX512 void panel_avx512(Panel<W> w, const Rows& io, int64_t row, int64_t tile, Span span) {
  float* out = io.out + row * io.n + tile * kLanes;
  const float* x = io.x + row * io.k + span.i0;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = span.first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * io.n + c * kLanes);
  const W* base = w.base;
  const int64_t tile_stride = w.tile_stride;
  for (int64_t i = 0; i < span.steps; ++i) {
    __m512 weights[C];
    for (int c = 0; c < C; ++c) weights[c] = load16(base + c * tile_stride + i * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * io.k + i]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(weights[c], xr, acc[r][c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const __m512 bias = span.last && io.bias ? _mm512_loadu_ps(io.bias + (tile + c) * kLanes) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(out + r * io.n + c * kLanes, span.last && io.bias ? _mm512_add_ps(acc[r][c], bias) : acc[r][c]);
  }
}

template <int R, int C, typename W>
TARGET_AVX2 void panel_avx2(Panel<W> w, const Rows& io, int64_t row, int64_t tile, Span span) {
  float* out = io.out + row * io.n + tile * kLanes;
  const float* x = io.x + row * io.k + span.i0;
  __m256 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h)
        acc[r][c][h] = span.first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + r * io.n + c * kLanes + h * 8);
  const W* base = w.base;
  const int64_t tile_stride = w.tile_stride;
  for (int64_t i = 0; i < span.steps; ++i) {
    __m256 weights[C][2];
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h) weights[c][h] = load8(base + c * tile_stride + i * kLanes + h * 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_set1_ps(x[r * io.k + i]);
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < 2; ++h) acc[r][c][h] = _mm256_fmadd_ps(weights[c][h], xr, acc[r][c][h]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int h = 0; h < 2; ++h) {
      const int64_t column = c * kLanes + h * 8;
      const bool add = span.last && io.bias;
      const __m256 bias = add ? _mm256_loadu_ps(io.bias + tile * kLanes + column) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r)
        _mm256_storeu_ps(out + r * io.n + column, add ? _mm256_add_ps(acc[r][c][h], bias) : acc[r][c][h]);
    }
}

// Plain C++: the same chains one lane at a time, std::fma rounding each step once as the vector units do.
template <typename W>
void panel_scalar(Panel<W> w, const Rows& io, int64_t row, int64_t rows, int64_t tile, int64_t tiles, Span span) {
  for (int64_t t = row; t < row + rows; ++t)
    for (int64_t c = tile; c < tile + tiles; ++c)
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        float* out = io.out + t * io.n + c * kLanes + lane;
        float acc = span.first ? 0.0f : *out;
        const W* column = w.base + (c - tile) * w.tile_stride + lane;
        for (int64_t i = 0; i < span.steps; ++i)
          acc = std::fma(static_cast<float>(column[i * kLanes]), io.x[t * io.k + span.i0 + i], acc);
        *out = span.last && io.bias ? acc + io.bias[c * kLanes + lane] : acc;
      }
}

// The panel of `rows` rows x `tiles` tiles for the chosen body: templates instantiated for every size a plan uses.
template <typename W, int R, int C = 1>
void panel_avx512_sized(Panel<W> w, const Rows& io, int64_t row, int64_t tile, int tiles, Span span) {
  if constexpr (C < max_tiles_avx512(R)) {
    if (tiles > C) return panel_avx512_sized<W, R, C + 1>(w, io, row, tile, tiles, span);
  }
  panel_avx512<R, C>(w, io, row, tile, span);
}

template <typename W, int R, int C = 1>
void panel_avx2_sized(Panel<W> w, const Rows& io, int64_t row, int64_t tile, int tiles, Span span) {
  if constexpr (C < max_tiles_avx2(R)) {
    if (tiles > C) return panel_avx2_sized<W, R, C + 1>(w, io, row, tile, tiles, span);
  }
  panel_avx2<R, C>(w, io, row, tile, span);
}

template <typename W, int R = 1>
void panel(Panel<W> w, const Rows& io, int64_t row, int rows, int64_t tile, int tiles, Span span) {
  if constexpr (R < kFewRows) {
    if (rows > R) return panel<W, R + 1>(w, io, row, rows, tile, tiles, span);
  }
  switch (chosen_isa()) {
    case Isa::avx512: return panel_avx512_sized<W, R>(w, io, row, tile, tiles, span);
    case Isa::avx2:
      if constexpr (R <= kManyRows) return panel_avx2_sized<W, R>(w, io, row, tile, tiles, span);
      break;
    default: break;
  }
  panel_scalar(w, io, row, rows, tile, tiles, span);
}

struct Plan {  // panels of up to `rows` rows x `tiles` tiles
  int rows, tiles;
};

Plan plan_for(int64_t rows) {
  switch (chosen_isa()) {
    case Isa::avx512:
      return rows <= kFewRows ? Plan{int(rows), max_tiles_avx512(int(rows))} : Plan{kManyRows, kManyTiles};
    case Isa::avx2:
      return rows <= kManyRows ? Plan{int(rows), max_tiles_avx2(int(rows))} : Plan{kManyRows, 1};
    default: return Plan{1, 1};
  }
}

TARGET_AVX512 void widen_avx512(const at::Half* from, float* to, int64_t count) {
  for (int64_t j = 0; j < count; j += kLanes) _mm512_storeu_ps(to + j, load16(from + j));
}

TARGET_AVX2 void widen_avx2(const at::Half* from, float* to, int64_t count) {
  for (int64_t j = 0; j < count; j += 8) _mm256_storeu_ps(to + j, load8(from + j));
}

// A float16 panel widened to float32 once for all its rows (exactly: every float16 is a float32), buffer (tiles,
// steps, 16); the panels then read float32 as for float32 weights.
Panel<float> widen(const Tiles<at::Half>& w, int64_t tile, int tiles, Span span, float* buffer) {
  for (int c = 0; c < tiles; ++c) {
    const at::Half* from = w.at(tile + c, span.i0);
    float* to = buffer + c * span.steps * kLanes;
    if (chosen_isa() == Isa::avx512) widen_avx512(from, to, span.steps * kLanes);
    else widen_avx2(from, to, span.steps * kLanes);
  }
  return Panel<float>{buffer, span.steps * kLanes};
}

// Tiles [tile_begin, tile_end) for every row: per group of plan.tiles tiles, per kDepth steps of k, every group of
// plan.rows rows. Float16 weights read by more than one group of rows are widened once per panel.
template <typename W>
void tiles_range(const Tiles<W>& w, const Rows& io, int64_t rows, Plan plan, int64_t tile_begin, int64_t tile_end) {
  std::vector<float> buffer;
  const bool widened = std::is_same_v<W, at::Half> && rows > plan.rows && chosen_isa() != Isa::scalar;
  if (widened) buffer.resize(plan.tiles * kDepth * kLanes);
  for (int64_t tile = tile_begin; tile < tile_end; tile += plan.tiles) {
    const int tiles = int(std::min<int64_t>(plan.tiles, tile_end - tile));
    for (int64_t i0 = 0; i0 < io.k; i0 += kDepth) {
      const Span span{i0, std::min(kDepth, io.k - i0), i0 == 0, i0 + kDepth >= io.k};
      if constexpr (std::is_same_v<W, at::Half>) {
        if (widened) {
          const Panel<float> panel_weights = widen(w, tile, tiles, span, buffer.data());
          for (int64_t row = 0; row < rows; row += plan.rows)
            panel(panel_weights, io, row, int(std::min<int64_t>(plan.rows, rows - row)), tile, tiles, span);
          continue;
        }
      }
      const Panel<W> panel_weights{w.at(tile, i0), w.k * kLanes};
      for (int64_t row = 0; row < rows; row += plan.rows)
        panel(panel_weights, io, row, int(std::min<int64_t>(plan.rows, rows - row)), tile, tiles, span);
    }
  }
}

}  // namespace

namespace triforce_cpu {

DenseTiles checked_tiles(const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && w.dim() == 3 && w.size(2) == kLanes &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kHalf),
              "weight: a contiguous CPU tensor (N/16, K, 16), float32 or float16");
  const int64_t n = w.size(0) * kLanes;
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->dim() == 1 && bias->size(0) == n,
                "bias: float32 (N/16 * 16,)");
    bias_data = bias->data_ptr<float>();
  }
  return DenseTiles{w.data_ptr(), w.scalar_type() == at::kHalf, w.size(0), w.size(1), bias_data};
}

void dense_linear_rows(const float* x, int64_t rows, const DenseTiles& w, float* out, int64_t out_stride) {
  TORCH_CHECK(out_stride >= w.tiles * kLanes, "out: a row holds the product's ", w.tiles * kLanes, " outputs");
  if (rows == 0) return;
  if (w.k == 0) {
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t j = 0; j < w.tiles * kLanes; ++j) out[t * out_stride + j] = w.bias ? w.bias[j] : 0.0f;
    return;
  }
  const Rows io{x, w.bias, out, w.k, out_stride};
  const Plan plan = plan_for(rows);
  at::parallel_for(0, w.tiles, 1, [&](int64_t tile_begin, int64_t tile_end) {
    if (w.half)
      tiles_range(Tiles<at::Half>{static_cast<const at::Half*>(w.w), w.tiles, w.k}, io, rows, plan, tile_begin,
                  tile_end);
    else
      tiles_range(Tiles<float>{static_cast<const float*>(w.w), w.tiles, w.k}, io, rows, plan, tile_begin, tile_end);
  });
}

}  // namespace triforce_cpu

namespace {

// x (T, K) float32 -> (T, N/16 * 16): x @ W.T + bias for the weight W (N, K) the tiles w (N/16, K, 16) hold, float32
// or float16; bias: float32 (N/16 * 16,), or none.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  const triforce_cpu::DenseTiles tiles = triforce_cpu::checked_tiles(w, bias);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == w.size(1),
              "x: float32 (T, K) on the CPU");
  const at::Tensor xc = x.contiguous();
  const int64_t n = tiles.tiles * kLanes;
  at::Tensor out = at::empty({xc.size(0), n}, xc.options());
  triforce_cpu::dense_linear_rows(xc.data_ptr<float>(), xc.size(0), tiles, out.data_ptr<float>(), n);
  return out;
}

at::Tensor dense_linear_meta(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return at::empty({x.size(0), w.size(0) * kLanes}, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triforce_cpu, lib) { lib.def("dense_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(triforce_cpu, CPU, lib) { lib.impl("dense_linear", &dense_linear); }

TORCH_LIBRARY_IMPL(triforce_cpu, Meta, lib) { lib.impl("dense_linear", &dense_linear_meta); }

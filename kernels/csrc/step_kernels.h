// The GGUF and dense products and the cache attention on raw rows, as step_ops.cpp's fused layers call them: no
// dispatcher, no output allocated, outputs written at the caller's strides. Each computes exactly what its op does
// (blocks_linear in gguf_blocks.cpp, dense_linear in dense_linear.cpp, cache_attention in cache_attention.cpp, which
// call these), so both paths give the same bits.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace triforce_cpu {

// GGUF weight blocks as the products read them (gguf_blocks.cpp, top): tiles of 16 output rows, a record of `record`
// bytes per block of 32 inputs, (N/16, K/32) records back to back, each q's then its scales (and minimums).
struct Blocks {
  static constexpr int64_t kWeights = 32, kRows = 16;  // a block's inputs, a tile's output rows
  const uint8_t* records;
  int64_t record;  // bytes a record
  int64_t tiles, blocks;
  bool four_bit, minimums;
  int64_t groups;  // scales a block: 1, or 2 (one per 16 weights)

  int64_t q_bytes() const { return four_bit ? kWeights / 2 * kRows : kWeights * kRows; }
  const uint8_t* q_at(int64_t tile, int64_t b) const { return records + (tile * blocks + b) * record; }
  // the 16 lanes' scale of block b's weights 16 * half..
  const float* d_at(int64_t tile, int64_t b, int64_t half = 0) const {
    return reinterpret_cast<const float*>(q_at(tile, b) + q_bytes()) + (groups == 2 ? half : 0) * kRows;
  }
  const float* m_at(int64_t tile, int64_t b) const {  // minimums only
    return reinterpret_cast<const float*>(q_at(tile, b) + q_bytes()) + groups * kRows;
  }
};

// The records blocks_linear's operands q, d and m (or none) are views of, checked: step_ops.cpp's layers check them
// once, when a stack takes the layer, rather than on every product.
Blocks checked_blocks(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m);

// x (rows, K) row-major float32 -> out (rows, N) at out_stride floats a row: x @ W.T for the blocks w (N = 16 *
// w.tiles). sums: rows * K / 32 floats of scratch.
void blocks_linear_rows(const float* x, int64_t rows, const Blocks& w, float* out, int64_t out_stride, float* sums);

// Rows ids (R,) of the weight W (N, K) the blocks q, d, m hold, rebuilt (gguf_blocks.cpp's weight_at) -> (R, K)
// float32: a token embedding kept as blocks, looked up without a torch op per step of the rebuilding (the op
// blocks_rows, and step_ops.cpp's one-call step).
at::Tensor blocks_rows(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m,
                       const at::Tensor& ids);

// Dense weight tiles as dense_linear reads them (dense_linear.cpp, top): W (N, K) as (N/16, K, 16) float32 or
// float16, and a float32 bias (N/16 * 16) or none.
struct DenseTiles {
  const void* w;
  bool half;
  int64_t tiles, k;
  const float* bias;
};

// The tiles w (N/16, K, 16) and bias of a dense_linear's operands, checked as dense_linear takes them: step_ops.cpp's
// layers check them once, when a stack takes the layer.
DenseTiles checked_tiles(const at::Tensor& w, const std::optional<at::Tensor>& bias);

// x (rows, K) row-major float32 -> out (rows, N) at out_stride floats a row: x @ W.T + bias for the tiles w (N = 16 *
// w.tiles), the bits dense_linear gives.
void dense_linear_rows(const float* x, int64_t rows, const DenseTiles& w, float* out, int64_t out_stride);

// A float16 cache view (Hkv, L, D) of keys and values, each row's D contiguous: pointers and strides in elements,
// taken from the cache's storage without making tensors of its views (a decode step takes one a layer).
struct CacheView {
  const at::Half *k, *v;
  int64_t kv_heads, keys, dim;
  int64_t k_head, k_row, v_head, v_row;
};

// The view of the float16 tensors k, v (Hkv, L, D), checked as cache_attention takes them.
CacheView cache_view(const at::Tensor& k, const at::Tensor& v);

// cache_attention over the float16 view (Hkv, L, D) of queries already scaled by scale * log2(e) and laid out
// (Hkv, T, G, D) contiguous (scaled; row t G + g of KV head h is query head h G + g at query t), T = queries, the
// keys in segments of `segment` -> query head h G + g of query t written at out + h * head_stride +
// t * time_stride + g * D.
void cache_attention_rows(const float* scaled, int64_t q_heads, int64_t queries, const CacheView& view,
                          int64_t origin, int64_t window, int64_t segment, float* out, int64_t head_stride,
                          int64_t time_stride);

}  // namespace triforce_cpu

// The GGUF product and the cache attention on raw rows, as step_ops.cpp's fused layers call them: no dispatcher, no
// output allocated, outputs written at the caller's strides. Each computes exactly what its op does (blocks_linear in
// gguf_blocks.cpp, cache_attention in cache_attention.cpp, which call these), so both paths give the same bits.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace triforce_cpu {

// x (rows, K) row-major float32 -> out (rows, N) at out_stride floats a row: x @ W.T for the GGUF blocks q, d, m
// (blocks_linear's operands; N = 16 * q.size(0)). sums: rows * K / 32 floats of scratch.
void blocks_linear_rows(const float* x, int64_t rows, const at::Tensor& q, const at::Tensor& d,
                        const std::optional<at::Tensor>& m, float* out, int64_t out_stride, float* sums);

// cache_attention over the float16 views k, v (Hkv, L, D) of queries already scaled by scale * log2(e) and laid out
// (Hkv, T, G, D) contiguous (scaled; row t G + g of KV head h is query head h G + g at query t), T = queries, the
// keys in segments of `segment` -> query head h G + g of query t written at out + h * head_stride +
// t * time_stride + g * D.
void cache_attention_rows(const float* scaled, int64_t q_heads, int64_t queries, const at::Tensor& k,
                          const at::Tensor& v, int64_t origin, int64_t window, int64_t segment, float* out,
                          int64_t head_stride, int64_t time_stride);

}  // namespace triforce_cpu

// The small ops of a decoder layer on float32 activations (RMSNorm, RoPE, SiLU(gate) * up, the residual adds), and
// two ops that run a layer's halves around the cache write in one call each, so that a decode step makes a handful
// of calls per layer instead of dozens of torch ops (kernels/step.py, runtime/model.py's DecoderLayer):
//   attention_input: RMSNorm, the fused q/k/v projection, (Qwen3: an RMSNorm over each query and key head) and RoPE
//     -> q (Hq, T, D), k, v (Hkv, T, D) float32, for the cache's update;
//   layer_output: the attention output's projection and residual add, RMSNorm, the fused gate/up projection,
//     SiLU(gate) * up, the down projection and residual add -> the layer's output (T, C);
//   cached_layer: a whole layer over a float16 KV cache's storage in one call: attention_input, the new keys and
//     values written into the layer's slots (rounded to float16 by copy_, as an indexed write into the cache rounds
//     them), cache_attention over the layer's view, layer_output -> the layer's output and its queries;
//   cached_layers: every layer of a model in turn, as cached_layer, in one call, its operands held by a LayerStack
//     built once per model (a decode step then crosses from Python into the extension once, not once a layer); a
//     layer whose projections are all GGUF blocks or weight tiles runs on rows allocated once a step (layer_rows),
//     the products and the attention writing straight into them, with no torch op between its kernels;
//   output_logits: the final RMSNorm, the output projection and, for an output computing some tokens only (a
//     drafter's), the logits spread over the vocabulary, -inf elsewhere, in one call over an OutputHead read once;
//   cached_step: an eager step from token ids to logits in one call: the embedding's rows (embedding_rows),
//     cached_layers, output_logits.
// The projections run the extension's own products (blocks_linear, dense_linear: gguf_blocks.cpp, dense_linear.cpp)
// through the dispatcher; a projection given in parts (GGUF blocks of different kinds) runs each and puts their
// outputs side by side.
//
// Every op computes each row in one order of arithmetic whatever the number of rows T and the number of threads (the
// threads split rows, or rows x heads, and never a row's reduction), so that a position gets the same bits in a
// decode step, a verification and a prefill chunk:
// - RMSNorm: the sum of squares of a row (AVX-512: 16 lanes, AVX2: 8 lanes, each an FMA chain over the row, the tail
//   read masked into the same lanes, then the lanes summed in a fixed order; plain: one sum in order), then
//   r = 1 / sqrt(sum / n + eps) and out = (x * r) * w, one rounding each;
// - RoPE (Llama's half-split layout, as runtime/model.py's rotate): out_i = x_0 * R[i][0] + x_1 * R[i][1] for the
//   rotation R = [[cos, -sin], [sin, cos]], two rounded products and their sum;
// - SiLU(g) * u = (g / (1 + exp(-g))) * u, exp that of vector_exp.h (the plain body: its steps in scalar code);
// - the residual adds: one rounding each.
// Each ISA body (isa.h) has its order; elementwise steps give the same bits in every body, the sums of squares and
// exp may differ between bodies (never within one).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

#include "isa.h"
#include "step_kernels.h"
#include "vector_exp.h"

namespace {

using triforce_cpu::chosen_isa;
using triforce_cpu::Isa;
using triforce_cpu::kExpHigh;
using triforce_cpu::kExpLow;
using triforce_cpu::kExpPoly;
using triforce_cpu::kLn2High;
using triforce_cpu::kLn2Low;
using triforce_cpu::kLog2e;

constexpr int64_t kParallelElements = 32768;  // elements a thread takes at least: a decode step's rows stay on one

int64_t grain_for(int64_t elements_per_unit) {
  return std::max<int64_t>(1, kParallelElements / std::max<int64_t>(1, elements_per_unit));
}

// ---- sums of squares, one order per body

float squares_plain(const float* x, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

__attribute__((target("avx512f"))) float squares_avx512(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  // lanes summed pairwise in a fixed order: 8 + 8, 4 + 4, 2 + 2, 1 + 1
  const __m256 eight = _mm256_add_ps(_mm512_castps512_ps256(acc),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(four, _mm_shuffle_ps(four, four, 1)));
}

__attribute__((target("avx2,fma"))) __m256i tail_mask8(int64_t count) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(count, 8))), lanes);
}

__attribute__((target("avx2,fma"))) float squares_avx2(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = n - i >= 8 ? _mm256_loadu_ps(x + i) : _mm256_maskload_ps(x + i, tail_mask8(n - i));
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(four, _mm_shuffle_ps(four, four, 1)));
}

float squares(const float* x, int64_t n) {
  switch (chosen_isa()) {
    case Isa::avx512: return squares_avx512(x, n);
    case Isa::avx2: return squares_avx2(x, n);
    default: return squares_plain(x, n);
  }
}

// out (n) = RMSNorm of the row x (n) scaled by w (n); out may be x.
void rms_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  const float scale = 1.0f / std::sqrt(squares(x, n) / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * scale) * w[i];
}

// ---- SiLU(gate) * up, one body per ISA

// exp's steps of vector_exp.h in scalar code
float exp_plain(float x) {
  const float clamped = std::max(std::min(x, kExpHigh), kExpLow);
  const float n = std::nearbyint(clamped * kLog2e);
  const float r = std::fma(-n, kLn2Low, std::fma(-n, kLn2High, clamped));
  float p = std::fma(kExpPoly[0], r, kExpPoly[1]);
  p = std::fma(p, r, kExpPoly[2]);
  p = std::fma(p, r, kExpPoly[3]);
  p = std::fma(p, r, kExpPoly[4]);
  p = std::fma(p, r, kExpPoly[5]);
  p = std::fma(p, r * r, r + 1.0f);
  return x < kExpLow ? 0.0f : std::ldexp(p, int(n));
}

void silu_mul_plain(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = (gate[i] / (1.0f + exp_plain(-gate[i]))) * up[i];
}

__attribute__((target("avx512f"))) void silu_mul_avx512(const float* gate, const float* up, int64_t n, float* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(mask, gate + i);
    const __m512 e = triforce_cpu::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(out + i, mask, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(mask, up + i)));
  }
}

__attribute__((target("avx2,fma"))) void silu_mul_avx2(const float* gate, const float* up, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i mask = tail_mask8(n - i);
    const __m256 g = _mm256_maskload_ps(gate + i, mask);
    const __m256 e = triforce_cpu::exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_maskstore_ps(out + i, mask, _mm256_mul_ps(silu, _mm256_maskload_ps(up + i, mask)));
  }
}

void silu_mul_row(const float* gate, const float* up, int64_t n, float* out) {
  switch (chosen_isa()) {
    case Isa::avx512: return silu_mul_avx512(gate, up, n, out);
    case Isa::avx2: return silu_mul_avx2(gate, up, n, out);
    default: return silu_mul_plain(gate, up, n, out);
  }
}

// ---- rows: the loops the ops on whole tensors and cached_layers' rows share

// out (T, n) = each row's RMSNorm of x (T, n) scaled by w (n)
void rms_rows(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* out) {
  at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_row(x + t * n, w, eps, n, out + t * n);
  });
}

// gate_up (T, 2I), each row [gate | up] -> out (T, I): SiLU(gate) * up
void silu_rows(const float* gate_up, int64_t rows, int64_t n, float* out) {
  at::parallel_for(0, rows, grain_for(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_mul_row(gate_up + t * 2 * n, gate_up + t * 2 * n + n, n, out + t * n);
  });
}

// a (n) = b + a elementwise, one rounding each
void add_rows(float* a, const float* b, int64_t n) {
  at::parallel_for(0, n, kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a[i] = b[i] + a[i];
  });
}

// y (D) = the rotation r (2, 2, D/2) of one head x (D): [R00 | R01 | R10 | R11], D/2 each, half = D/2
void rotate_row(const float* x, const float* r, int64_t half, float* y) {
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = x[i], x1 = x[half + i];
    y[i] = x0 * r[i] + x1 * r[half + i];
    y[half + i] = x0 * r[2 * half + i] + x1 * r[3 * half + i];
  }
}

// ---- checks and the ops on whole tensors

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat, name,
              ": a float32 CPU tensor (rows, features)");
}

void check_weight(const at::Tensor& w, int64_t n, const char* name) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 1 && w.size(0) == n && w.scalar_type() == at::kFloat &&
                  w.is_contiguous(),
              name, ": a contiguous float32 CPU tensor of ", n, " values");
}

// x (T, C) -> (T, C): each row's RMSNorm scaled by weight (C,).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_weight(weight, x.size(1), "weight");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  at::Tensor out = at::empty_like(xc);
  const float *in = xc.data_ptr<float>(), *w = weight.data_ptr<float>();
  rms_rows(in, w, float(eps), rows, n, out.data_ptr<float>());
  return out;
}

// gate_up (T, 2I), each row [gate | up] -> (T, I): SiLU(gate) * up.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: an even number of columns, gate then up");
  const at::Tensor gu = gate_up.contiguous();
  const int64_t rows = gu.size(0), n = gu.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gu.options());
  silu_rows(gu.data_ptr<float>(), rows, n, out.data_ptr<float>());
  return out;
}

// qkv (T, H * D), each row's heads [q heads | k heads | v heads] -> (H, T, D): the first `rotated` heads rotated by
// rotation (T, 2, 2, D/2), the rest copied; with q_norm (D,) and k_norm (D,), the first q_heads heads normalised by
// q_norm and the next rotated - q_heads by k_norm before their rotation.
at::Tensor rotary_heads(const at::Tensor& qkv, const at::Tensor& rotation, int64_t heads, int64_t rotated,
                        int64_t q_heads, const std::optional<at::Tensor>& q_norm,
                        const std::optional<at::Tensor>& k_norm, double eps) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(heads >= 1 && qkv.size(1) % heads == 0 && 0 <= q_heads && q_heads <= rotated && rotated <= heads,
              "qkv: heads of one width, q_heads <= rotated <= heads");
  const int64_t rows = qkv.size(0), dim = qkv.size(1) / heads, half = dim / 2;
  TORCH_CHECK(dim % 2 == 0, "qkv: an even head dim");
  TORCH_CHECK(rotation.device().is_cpu() && rotation.scalar_type() == at::kFloat && rotation.dim() == 4 &&
                  rotation.size(0) == rows && rotation.size(1) == 2 && rotation.size(2) == 2 &&
                  rotation.size(3) == half,
              "rotation: float32 (T, 2, 2, D/2)");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm, k_norm: both or neither");
  if (q_norm.has_value()) {
    check_weight(*q_norm, dim, "q_norm");
    check_weight(*k_norm, dim, "k_norm");
  }
  const at::Tensor xc = qkv.contiguous(), rc = rotation.contiguous();
  at::Tensor out = at::empty({heads, rows, dim}, xc.options());
  const float *in = xc.data_ptr<float>(), *rot = rc.data_ptr<float>();
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const float epsilon = float(eps);
  at::parallel_for(0, rows * heads, grain_for(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> normed(qn ? dim : 0);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t t = unit / heads, h = unit % heads;
      const float* x = in + (t * heads + h) * dim;
      float* y = o + (h * rows + t) * dim;
      if (h >= rotated) {
        std::copy(x, x + dim, y);
        continue;
      }
      if (qn) {
        rms_row(x, h < q_heads ? qn : kn, epsilon, dim, normed.data());
        x = normed.data();
      }
      rotate_row(x, rot + t * 2 * dim, half, y);
    }
  });
  return out;
}

// a (T, C) += b (T, C), a contiguous: a = b + a elementwise, one rounding each.
void add_into(at::Tensor& a, const at::Tensor& b) {
  const at::Tensor bc = b.contiguous();
  add_rows(a.data_ptr<float>(), bc.data_ptr<float>(), a.numel());
}

// ---- projections through the extension's products

using BlocksSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const std::optional<at::Tensor>&);
using DenseSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);

const c10::TypedOperatorHandle<BlocksSignature>& blocks_linear_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("triforce_cpu::blocks_linear", "").typed<BlocksSignature>();
  return op;
}

const c10::TypedOperatorHandle<DenseSignature>& dense_linear_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("triforce_cpu::dense_linear", "").typed<DenseSignature>();
  return op;
}

// x (T, K) -> (T, sum of features): the projection given as parts, three operands each (kernels/step.py's
// linear_operands): GGUF blocks (q, d, m or None) or tiles (tiles, None, bias or None), each part's first
// features[p] outputs side by side. Contiguous, and a tensor of its own.
at::Tensor project(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& parts, at::IntArrayRef features) {
  TORCH_CHECK(!features.empty() && parts.size() == 3 * features.size(),
              "a projection: three operands for each of its parts");
  std::vector<at::Tensor> outs;
  for (size_t p = 0; p < features.size(); ++p) {
    const std::optional<at::Tensor> first = parts.get(3 * p), second = parts.get(3 * p + 1),
                                    third = parts.get(3 * p + 2);
    TORCH_CHECK(first.has_value(), "a projection's part: its weight first");
    at::Tensor out;
    TORCH_CHECK(first->scalar_type() != at::kByte || second.has_value(), "GGUF blocks: q, d and m or None");
    if (second.has_value()) {  // GGUF blocks
      out = blocks_linear_op().call(x, *first, *second, third);
    } else {
      out = dense_linear_op().call(x, *first, third);
    }
    TORCH_CHECK(features[p] <= out.size(1), "a projection's part: at most its padded outputs");
    outs.push_back(out.size(1) == features[p] ? out : out.narrow(1, 0, features[p]));
  }
  if (outs.size() == 1) return outs[0].is_contiguous() ? outs[0] : outs[0].contiguous();
  return at::cat(outs, 1);
}

using AttentionSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                                      int64_t, int64_t);

const c10::TypedOperatorHandle<AttentionSignature>& cache_attention_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("triforce_cpu::cache_attention", "")
                             .typed<AttentionSignature>();
  return op;
}

// The first half of a decoder layer: x (T, C) -> q (Hq, T, D), k, v (Hkv, T, D) float32, see the top of the file.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_input(
    const at::Tensor& x, const at::Tensor& norm_weight, double eps, const c10::List<std::optional<at::Tensor>>& qkv,
    at::IntArrayRef qkv_features, const at::Tensor& rotation, int64_t q_heads, int64_t kv_heads,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm) {
  at::Tensor projected = project(rms_norm(x, norm_weight, eps), qkv, qkv_features);  // (T, (Hq + 2 Hkv) D)
  const int64_t heads = q_heads + 2 * kv_heads;
  const at::Tensor out = rotary_heads(projected, rotation, heads, q_heads + kv_heads, q_heads, q_norm, k_norm, eps);
  projected.reset();
  return {out.narrow(0, 0, q_heads), out.narrow(0, q_heads, kv_heads), out.narrow(0, q_heads + kv_heads, kv_heads)};
}

// The second half: x (T, C) and the attention output attended (Hq, T, D) -> the layer's output (T, C).
at::Tensor layer_output(const at::Tensor& x, const at::Tensor& attended,
                        const c10::List<std::optional<at::Tensor>>& o_proj, at::IntArrayRef o_features,
                        const at::Tensor& norm_weight, double eps, const c10::List<std::optional<at::Tensor>>& gate_up,
                        at::IntArrayRef gate_up_features, const c10::List<std::optional<at::Tensor>>& down,
                        at::IntArrayRef down_features) {
  check_rows(x, "x");
  TORCH_CHECK(attended.dim() == 3 && attended.size(1) == x.size(0), "attended: (Hq, T, D) for x's T rows");
  // each intermediate is released as soon as the next is made, so that at most two of them are held at once
  // (what the prefill's memory plan counts, and what the op's fake implementation in kernels/step.py allocates)
  at::Tensor heads = attended.transpose(0, 1).reshape({x.size(0), -1});  // (T, Hq D)
  at::Tensor mixed = project(heads, o_proj, o_features);                 // (T, C)
  heads.reset();
  TORCH_CHECK(mixed.sizes() == x.sizes(), "o_proj: x's width");
  add_into(mixed, x);
  at::Tensor normed = rms_norm(mixed, norm_weight, eps);
  at::Tensor gates = project(normed, gate_up, gate_up_features);  // (T, 2 I)
  normed.reset();
  at::Tensor activated = silu_mul(gates);  // (T, I)
  gates.reset();
  at::Tensor out = project(activated, down, down_features);
  activated.reset();
  TORCH_CHECK(out.sizes() == x.sizes(), "down: x's width");
  add_into(out, mixed);
  return out;
}

// A whole decoder layer over a float16 cache's storage keys, values (layers, Hkv, S, D): attention_input of x (T, C),
// its keys and values written to layer's slots [write_slot, write_slot + T), its queries' attention over the slots
// [view_start, write_slot + T) (cache_attention: view index 0 at position origin, window W or 0 for none, segments
// of `segment` keys), layer_output. Returns the layer's output (T, C) and the queries (Hq, T, D).
std::tuple<at::Tensor, at::Tensor> cached_layer(
    const at::Tensor& x, const at::Tensor& norm_weight, double eps, const c10::List<std::optional<at::Tensor>>& qkv,
    at::IntArrayRef qkv_features, const at::Tensor& rotation, int64_t q_heads, int64_t kv_heads,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, at::Tensor& keys,
    at::Tensor& values, int64_t layer, int64_t write_slot, int64_t view_start, double scale, int64_t origin,
    int64_t window, int64_t segment, const c10::List<std::optional<at::Tensor>>& o_proj, at::IntArrayRef o_features,
    const at::Tensor& post_norm, double post_eps, const c10::List<std::optional<at::Tensor>>& gate_up,
    at::IntArrayRef gate_up_features, const c10::List<std::optional<at::Tensor>>& down,
    at::IntArrayRef down_features) {
  check_rows(x, "x");
  const int64_t rows = x.size(0);
  TORCH_CHECK(keys.device().is_cpu() && keys.scalar_type() == at::kHalf && keys.dim() == 4 &&
                  values.sizes() == keys.sizes() && values.scalar_type() == at::kHalf && values.device().is_cpu(),
              "keys, values: float16 CPU tensors (layers, Hkv, S, D) of one shape");
  TORCH_CHECK(0 <= layer && layer < keys.size(0) && keys.size(1) == kv_heads, "keys: layer ", layer, " of ",
              keys.size(0), " with ", kv_heads, " KV heads");
  TORCH_CHECK(0 <= view_start && view_start <= write_slot && write_slot + rows <= keys.size(2),
              "slots: view_start <= write_slot and write_slot + T <= S");
  auto [q, k, v] = attention_input(x, norm_weight, eps, qkv, qkv_features, rotation, q_heads, kv_heads, q_norm, k_norm);
  TORCH_CHECK(k.size(2) == keys.size(3), "keys: the projection's head dim");
  at::Tensor layer_keys = keys.select(0, layer), layer_values = values.select(0, layer);  // (Hkv, S, D)
  layer_keys.narrow(1, write_slot, rows).copy_(k);
  layer_values.narrow(1, write_slot, rows).copy_(v);
  const int64_t stop = write_slot + rows;
  at::Tensor attended = cache_attention_op().call(q, layer_keys.narrow(1, view_start, stop - view_start),
                                                  layer_values.narrow(1, view_start, stop - view_start), scale,
                                                  origin, window, segment);  // (Hq, T, D)
  at::Tensor out = layer_output(x, attended, o_proj, o_features, post_norm, post_eps, gate_up, gate_up_features, down,
                                down_features);
  return {out, q};
}

// ---- a layer on rows allocated once a step (cached_layers' path where every projection is GGUF blocks or tiles)
//
// The same arithmetic as cached_layer, element for element: the products and the attention run the ops' own raw
// entries (step_kernels.h) straight into rows allocated once for every layer, the queries are scaled and laid out
// as cache_attention lays them out, the attention's output lands in the (T, Hq D) rows the output projection reads,
// the new keys and values are rotated and rounded to float16 (to nearest even, as copy_ rounds them) straight into
// the cache. What goes is the torch ops between the kernels: a few dozen a layer (allocations, views, copies,
// transposes), each a dispatch and a pass over memory while the other threads wait.

// float32 x (n) -> float16 out (n), rounded to nearest even (F16C where the CPU has it; c10's rounding otherwise,
// the same bits)
__attribute__((target("avx512f"))) void to_half_avx512(const float* x, int64_t n, at::Half* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) out[i] = at::Half(x[i]);
}

__attribute__((target("avx2,f16c"))) void to_half_avx2(const float* x, int64_t n, at::Half* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) out[i] = at::Half(x[i]);
}

void to_half(const float* x, int64_t n, at::Half* out) {
  switch (chosen_isa()) {
    case Isa::avx512: return to_half_avx512(x, n, out);
    case Isa::avx2: return to_half_avx2(x, n, out);
    default:
      for (int64_t i = 0; i < n; ++i) out[i] = at::Half(x[i]);
  }
}

// A projection's outputs: its parts' features side by side
int64_t outputs(const std::vector<int64_t>& features) {
  return std::accumulate(features.begin(), features.end(), int64_t(0));
}

// One part of a projection run on rows: GGUF blocks or dense tiles (float32 or float16), checked once
struct Product {
  bool dense;
  triforce_cpu::Blocks blocks;
  triforce_cpu::DenseTiles tiles;
};

// Whether a projection's parts are all GGUF blocks or dense tiles taking `inputs` inputs whose padded outputs are
// their features (so that each writes straight into its columns of the rows).
bool direct_projection(const c10::List<std::optional<at::Tensor>>& parts, const std::vector<int64_t>& features,
                       int64_t inputs) {
  if (features.empty() || parts.size() != 3 * features.size()) return false;
  for (size_t p = 0; p < features.size(); ++p) {
    const std::optional<at::Tensor> first = parts.get(3 * p), second = parts.get(3 * p + 1);
    if (!first.has_value() || first->dim() != 3 || first->size(0) * 16 != features[p]) return false;
    const bool fits = second.has_value() ? first->size(1) * 32 == inputs  // GGUF blocks: (N/16, K/32, record)
                                         : first->size(1) == inputs && first->size(2) == 16 &&  // tiles (N/16, K, 16)
                                               first->is_contiguous() &&
                                               (first->scalar_type() == at::kFloat || first->scalar_type() == at::kHalf);
    if (!fits) return false;
  }
  return true;
}

template <typename Layer>
bool direct_layer(const Layer& l) {
  const int64_t hidden = l.norm_weight.numel(), heads = l.q_heads + 2 * l.kv_heads;
  const int64_t qkv = outputs(l.qkv_features), gates = outputs(l.gate_up_features);
  if (!direct_projection(l.qkv, l.qkv_features, hidden) || heads < 1 || qkv % heads || (qkv / heads) % 2)
    return false;
  const int64_t dim = qkv / heads;
  return direct_projection(l.o_proj, l.o_features, l.q_heads * dim) && outputs(l.o_features) == hidden &&
         direct_projection(l.gate_up, l.gate_up_features, hidden) && gates % 2 == 0 &&
         direct_projection(l.down, l.down_features, gates / 2) && outputs(l.down_features) == hidden &&
         l.post_norm.numel() == hidden;
}

// x (T, K) -> out (T, sum of features) at out_stride floats a row: each part's outputs in its columns, as project()
void project_rows(const float* x, int64_t rows, const std::vector<Product>& parts,
                  const std::vector<int64_t>& features, float* out, int64_t out_stride, float* sums) {
  int64_t column = 0;
  for (size_t p = 0; p < features.size(); ++p) {
    if (parts[p].dense)
      triforce_cpu::dense_linear_rows(x, rows, parts[p].tiles, out + column, out_stride);
    else
      triforce_cpu::blocks_linear_rows(x, rows, parts[p].blocks, out + column, out_stride, sums);
    column += features[p];
  }
}

// A direct projection's parts, checked (triforce_cpu::checked_blocks, triforce_cpu::checked_tiles)
std::vector<Product> checked_parts(const c10::List<std::optional<at::Tensor>>& parts) {
  std::vector<Product> products;
  for (size_t p = 0; p + 2 < parts.size(); p += 3) {
    const std::optional<at::Tensor> second = parts.get(p + 1);
    if (second.has_value())
      products.push_back(Product{false, triforce_cpu::checked_blocks(*parts.get(p), *second, parts.get(p + 2)), {}});
    else
      products.push_back(Product{true, {}, triforce_cpu::checked_tiles(*parts.get(p), parts.get(p + 2))});
  }
  return products;
}

struct LayerRows {  // cached_layers' rows for T = rows, shared by every layer of a step, sized for the widest
  int64_t rows, hidden;
  at::Tensor normed, qkv, queries, scaled, attended, mixed, gated, activated, sums;

  LayerRows(int64_t rows, int64_t hidden, int64_t heads_width, int64_t q_width, int64_t gates, int64_t widest)
      : rows(rows), hidden(hidden) {
    const auto f = at::TensorOptions().dtype(at::kFloat);
    normed = at::empty({rows, hidden}, f);
    qkv = at::empty({rows, heads_width}, f);
    queries = at::empty({rows, q_width}, f);  // (Hq, T, D)
    scaled = at::empty({rows, q_width}, f);   // (Hkv, T, G, D)
    attended = at::empty({rows, q_width}, f);  // (T, Hq D)
    mixed = at::empty({rows, hidden}, f);
    gated = at::empty({rows, gates}, f);
    activated = at::empty({rows, gates / 2}, f);
    sums = at::empty({rows, (widest + 31) / 32}, f);
  }
};

// cached_layer of layer l on rows: x (T, C) -> out (T, C); the queries (Hq, T, D) into kept where given (else the
// rows' own). rotation (T, 2, 2, D/2) contiguous; keys, values the cache's float16 storage (layers, Hkv, S, D).
template <typename Layer>
void layer_rows(const Layer& l, LayerRows& b, const float* x, float* out, const float* rotation, at::Tensor& keys,
                at::Tensor& values, int64_t write_slot, int64_t view_start, int64_t origin, int64_t window,
                int64_t segment, float* kept) {
  const int64_t rows = b.rows, hidden = b.hidden, heads = l.q_heads + 2 * l.kv_heads;
  const int64_t width = outputs(l.qkv_features), gates = outputs(l.gate_up_features);
  const int64_t dim = width / heads, half = dim / 2, group = l.q_heads / l.kv_heads;
  TORCH_CHECK(l.kv_heads == keys.size(1) && dim == keys.size(3) && l.q_heads % l.kv_heads == 0,
              "keys: the layer's KV heads and head dim");
  float *normed = b.normed.data_ptr<float>(), *qkv = b.qkv.data_ptr<float>(), *sums = b.sums.data_ptr<float>();
  float* q = kept ? kept : b.queries.data_ptr<float>();

  // attention_input: RMSNorm, the q/k/v projection, then per (row, head): (Qwen3) the head's RMSNorm, RoPE; the
  // queries to q (Hq, T, D), the keys and values rounded into the layer's slots
  rms_rows(x, l.norm_weight.template data_ptr<float>(), float(l.eps), rows, hidden, normed);
  project_rows(normed, rows, l.qkv_products, l.qkv_features, qkv, width, sums);
  const float* qn = l.q_norm.has_value() ? l.q_norm->template data_ptr<float>() : nullptr;
  const float* kn = l.k_norm.has_value() ? l.k_norm->template data_ptr<float>() : nullptr;
  at::Half *k_cache = keys.data_ptr<at::Half>(), *v_cache = values.data_ptr<at::Half>();
  const int64_t k_head = keys.stride(1), k_row = keys.stride(2), v_head = values.stride(1), v_row = values.stride(2);
  k_cache += l.index * keys.stride(0) + write_slot * k_row;
  v_cache += l.index * values.stride(0) + write_slot * v_row;
  const int64_t rotated = l.q_heads + l.kv_heads;
  const float epsilon = float(l.eps);
  at::parallel_for(0, rows * heads, grain_for(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> normed_head(qn ? dim : 0), key(dim);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t t = unit / heads, h = unit % heads;
      const float* xh = qkv + (t * heads + h) * dim;
      if (h >= rotated) {
        to_half(xh, dim, v_cache + (h - rotated) * v_head + t * v_row);
        continue;
      }
      if (qn) {
        rms_row(xh, h < l.q_heads ? qn : kn, epsilon, dim, normed_head.data());
        xh = normed_head.data();
      }
      float* y = h < l.q_heads ? q + (h * rows + t) * dim : key.data();
      rotate_row(xh, rotation + t * 2 * dim, half, y);
      if (h >= l.q_heads) to_half(y, dim, k_cache + (h - l.q_heads) * k_head + t * k_row);
    }
  });

  // cache_attention over the layer's view, into (T, Hq D)
  const float multiplier = float(l.scale * 1.4426950408889634);
  float* scaled = b.scaled.data_ptr<float>();
  at::parallel_for(0, l.q_heads * rows, grain_for(dim), [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {  // query head h G + g, query t -> row (h, t G + g)
      const int64_t head = unit / rows, t = unit % rows, h = head / group, g = head % group;
      const float* from = q + (head * rows + t) * dim;
      float* to = scaled + ((h * rows + t) * group + g) * dim;
      for (int64_t i = 0; i < dim; ++i) to[i] = from[i] * multiplier;
    }
  });
  // the layer's view [view_start, write_slot + T) of the storage, by its strides (cached_layers checked them)
  const int64_t k_layer = l.index * keys.stride(0) + view_start * k_row;
  const int64_t v_layer = l.index * values.stride(0) + view_start * v_row;
  const triforce_cpu::CacheView view{keys.data_ptr<at::Half>() + k_layer, values.data_ptr<at::Half>() + v_layer,
                                     l.kv_heads, write_slot + rows - view_start, dim, k_head, k_row, v_head, v_row};
  float* attended = b.attended.data_ptr<float>();
  triforce_cpu::cache_attention_rows(scaled, l.q_heads, rows, view, origin, window, segment, attended, group * dim,
                                     l.q_heads * dim);

  // layer_output: the output projection and residual add, RMSNorm, gate/up, SiLU(gate) * up, down and residual add
  float* mixed = b.mixed.data_ptr<float>();
  project_rows(attended, rows, l.o_products, l.o_features, mixed, hidden, sums);
  add_rows(mixed, x, rows * hidden);
  rms_rows(mixed, l.post_norm.template data_ptr<float>(), float(l.post_eps), rows, hidden, normed);
  float *gated = b.gated.data_ptr<float>(), *activated = b.activated.data_ptr<float>();
  project_rows(normed, rows, l.gate_up_products, l.gate_up_features, gated, gates, sums);
  silu_rows(gated, rows, gates / 2, activated);
  project_rows(activated, rows, l.down_products, l.down_features, out, hidden, sums);
  add_rows(out, mixed, rows * hidden);
}

// A model's decoder layers as cached_layers runs them: each layer's operands as cached_layer takes them, read once
// (runtime/model.py keeps a stack while its layers' operands stay the same).
struct LayerStack : torch::CustomClassHolder {
  struct Layer {
    at::Tensor norm_weight;
    double eps;
    c10::List<std::optional<at::Tensor>> qkv;
    std::vector<int64_t> qkv_features;
    int64_t q_heads, kv_heads;
    std::optional<at::Tensor> q_norm, k_norm;
    int64_t index;  // the layer's index in the cache's storage
    double scale;
    int64_t window;  // 0: none
    c10::List<std::optional<at::Tensor>> o_proj;
    std::vector<int64_t> o_features;
    at::Tensor post_norm;
    double post_eps;
    c10::List<std::optional<at::Tensor>> gate_up;
    std::vector<int64_t> gate_up_features;
    c10::List<std::optional<at::Tensor>> down;
    std::vector<int64_t> down_features;
    bool direct;  // runs on cached_layers' rows (direct_layer)
    std::vector<Product> qkv_products, o_products, gate_up_products, down_products;  // a direct layer's
  };
  std::vector<Layer> layers;

  // The next layer: cached_layer's operands but for the step's own (x, rotation, the cache and its slots)
  void add(at::Tensor norm_weight, double eps, c10::List<std::optional<at::Tensor>> qkv,
           std::vector<int64_t> qkv_features, int64_t q_heads, int64_t kv_heads, std::optional<at::Tensor> q_norm,
           std::optional<at::Tensor> k_norm, int64_t index, double scale, int64_t window,
           c10::List<std::optional<at::Tensor>> o_proj, std::vector<int64_t> o_features, at::Tensor post_norm,
           double post_eps, c10::List<std::optional<at::Tensor>> gate_up, std::vector<int64_t> gate_up_features,
           c10::List<std::optional<at::Tensor>> down, std::vector<int64_t> down_features) {
    layers.push_back(Layer{std::move(norm_weight), eps, std::move(qkv), std::move(qkv_features), q_heads, kv_heads,
                           std::move(q_norm), std::move(k_norm), index, scale, window, std::move(o_proj),
                           std::move(o_features), std::move(post_norm), post_eps, std::move(gate_up),
                           std::move(gate_up_features), std::move(down), std::move(down_features), false});
    Layer& l = layers.back();
    l.direct = direct_layer(l);
    if (l.direct) {
      l.qkv_products = checked_parts(l.qkv);
      l.o_products = checked_parts(l.o_proj);
      l.gate_up_products = checked_parts(l.gate_up);
      l.down_products = checked_parts(l.down);
    }
  }

  // How many layers run on cached_layers' rows (the others through cached_layer)
  int64_t direct_layers() const {
    return std::count_if(layers.begin(), layers.end(), [](const Layer& l) { return l.direct; });
  }
};

// Every layer of stack in turn over x (T, C), as cached_layer, a layer's view from slot view_starts[its index] (its
// window where `windowed`: views of consecutive positions); the last layer's output (T, C) and, with
// keep_queries, every layer's queries (Hq, T, D) (none without).
std::tuple<at::Tensor, std::vector<at::Tensor>> cached_layers(const c10::intrusive_ptr<LayerStack>& stack,
                                                              const at::Tensor& x, const at::Tensor& rotation,
                                                              at::Tensor& keys, at::Tensor& values,
                                                              int64_t write_slot, at::IntArrayRef view_starts,
                                                              int64_t origin, bool windowed, int64_t segment,
                                                              bool keep_queries) {
  check_rows(x, "x");
  std::vector<at::Tensor> queries;
  const int64_t rows = x.size(0), hidden = x.size(1);
  // the rows every direct layer shares, sized for the widest of them
  int64_t heads_width = 0, q_width = 0, gates = 0, widest = hidden;
  for (const LayerStack::Layer& l : stack->layers) {
    if (!l.direct) continue;
    const int64_t width = outputs(l.qkv_features), gate_width = outputs(l.gate_up_features);
    const int64_t dim = width / (l.q_heads + 2 * l.kv_heads);
    heads_width = std::max(heads_width, width);
    q_width = std::max(q_width, l.q_heads * dim);
    gates = std::max(gates, gate_width);
    widest = std::max({widest, l.q_heads * dim, gate_width / 2});
  }
  std::optional<LayerRows> shared;
  std::optional<at::Tensor> rc;
  if (heads_width > 0) {
    TORCH_CHECK(keys.device().is_cpu() && keys.scalar_type() == at::kHalf && keys.dim() == 4 &&
                    values.sizes() == keys.sizes() && values.scalar_type() == at::kHalf && values.device().is_cpu(),
                "keys, values: float16 CPU tensors (layers, Hkv, S, D) of one shape");
    TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "keys, values: each row's head dim contiguous");
    TORCH_CHECK(write_slot >= 0 && write_slot + rows <= keys.size(2), "slots: write_slot + T <= S");
    TORCH_CHECK(rotation.device().is_cpu() && rotation.scalar_type() == at::kFloat && rotation.dim() == 4 &&
                    rotation.size(0) == rows && rotation.size(1) == 2 && rotation.size(2) == 2,
                "rotation: float32 (T, 2, 2, D/2)");
    shared.emplace(rows, hidden, heads_width, q_width, gates, widest);
    rc = rotation.contiguous();
  }
  at::Tensor h = x.contiguous();
  at::Tensor outputs[2];
  for (const LayerStack::Layer& l : stack->layers) {
    TORCH_CHECK(l.index < int64_t(view_starts.size()), "view_starts: one for each layer of the storage");
    const int64_t view_start = view_starts[l.index], window = windowed ? l.window : 0;
    if (!l.direct || l.norm_weight.numel() != hidden) {
      auto [out, q] = cached_layer(h, l.norm_weight, l.eps, l.qkv, l.qkv_features, rotation, l.q_heads, l.kv_heads,
                                   l.q_norm, l.k_norm, keys, values, l.index, write_slot, view_start, l.scale,
                                   origin, window, segment, l.o_proj, l.o_features, l.post_norm, l.post_eps,
                                   l.gate_up, l.gate_up_features, l.down, l.down_features);
      h = std::move(out);
      if (keep_queries) queries.push_back(std::move(q));
      continue;
    }
    TORCH_CHECK(0 <= l.index && l.index < keys.size(0), "keys: layer ", l.index, " of ", keys.size(0));
    TORCH_CHECK(0 <= view_start && view_start <= write_slot, "slots: view_start <= write_slot");
    const int64_t dim = keys.size(3);
    TORCH_CHECK(rc->size(3) * 2 == dim, "rotation: (T, 2, 2, D/2) for the cache's head dim");
    at::Tensor kept = keep_queries ? at::empty({l.q_heads, rows, dim}, x.options()) : at::Tensor();
    // the direct layers take turns between two outputs, each the next one's input
    at::Tensor& out = outputs[0].is_same(h) ? outputs[1] : outputs[0];
    if (!out.defined()) out = at::empty({rows, hidden}, x.options());
    layer_rows(l, *shared, h.data_ptr<float>(), out.data_ptr<float>(), rc->data_ptr<float>(), keys, values,
               write_slot, view_start, origin, window, segment, keep_queries ? kept.data_ptr<float>() : nullptr);
    h = out;
    if (keep_queries) queries.push_back(std::move(kept));
  }
  return {h, queries};
}

// A model's output layer as output_logits runs it: the final RMSNorm (norm_weight, eps), the output projection
// (parts, three operands each, as cached_layer's projections) and, where the projection computes the logits of some
// tokens only (restrict_output), their ids (V',) int64 and the vocabulary's size V. Read once by runtime/model.py.
struct OutputHead : torch::CustomClassHolder {
  at::Tensor norm_weight;
  double eps;
  c10::List<std::optional<at::Tensor>> parts;
  std::vector<int64_t> features;
  std::optional<at::Tensor> output_ids;
  int64_t vocab;
  bool direct;  // the parts run on raw rows (direct_projection)
  std::vector<Product> products;

  OutputHead(at::Tensor norm_weight, double eps, c10::List<std::optional<at::Tensor>> parts,
             std::vector<int64_t> features, std::optional<at::Tensor> output_ids, int64_t vocab)
      : norm_weight(std::move(norm_weight)), eps(eps), parts(std::move(parts)), features(std::move(features)),
        output_ids(std::move(output_ids)), vocab(vocab) {
    TORCH_CHECK(this->norm_weight.dim() == 1, "norm_weight: (C,)");
    check_weight(this->norm_weight, this->norm_weight.size(0), "norm_weight");
    const int64_t computed = outputs(this->features);
    if (this->output_ids.has_value()) {
      const at::Tensor& ids = *this->output_ids;
      TORCH_CHECK(ids.device().is_cpu() && ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous() &&
                      ids.size(0) == computed,
                  "output_ids: int64 (V',) on the CPU, one for each output");
      TORCH_CHECK(ids.numel() == 0 || (ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < vocab),
                  "output_ids: tokens of the vocabulary of ", vocab);
    } else {
      TORCH_CHECK(computed == vocab, "the output layer: one output for each token of the vocabulary");
    }
    direct = direct_projection(this->parts, this->features, this->norm_weight.size(0));
    if (direct) products = checked_parts(this->parts);
  }
};

// The logits (T, V) float32 of the last hidden states x (T, C): head's RMSNorm, then its projection, whose outputs
// go to their tokens' columns, -inf in every other column where it computes some tokens only. The same bits as
// rms_norm, the projection's op and an index_copy_ into a tensor of -inf.
at::Tensor output_logits(const c10::intrusive_ptr<OutputHead>& head, const at::Tensor& x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(head->norm_weight.size(0) == hidden, "x: (T, C) for the head's C = ", head->norm_weight.size(0));
  const at::Tensor xc = x.contiguous();
  at::Tensor normed = at::empty_like(xc);
  rms_rows(xc.data_ptr<float>(), head->norm_weight.data_ptr<float>(), float(head->eps), rows, hidden,
           normed.data_ptr<float>());
  at::Tensor computed;
  if (head->direct) {
    const int64_t n = outputs(head->features);
    computed = at::empty({rows, n}, xc.options());
    at::Tensor sums = at::empty({rows, (hidden + 31) / 32}, xc.options());
    project_rows(normed.data_ptr<float>(), rows, head->products, head->features, computed.data_ptr<float>(), n,
                 sums.data_ptr<float>());
  } else {
    computed = project(normed, head->parts, head->features);
  }
  if (!head->output_ids.has_value()) return computed;
  at::Tensor out = at::empty({rows, head->vocab}, xc.options());
  const int64_t n = computed.size(1), vocab = head->vocab;
  const int64_t* ids = head->output_ids->data_ptr<int64_t>();
  const float* from = computed.data_ptr<float>();
  float* to = out.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t) {
    std::fill(to + t * vocab, to + (t + 1) * vocab, -std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; ++j) to[t * vocab + ids[j]] = from[t * n + j];
  }
  return out;
}

// Rows ids (T,) of a token embedding's table, float32 (T, C): the table given as three operands, GGUF blocks (q, d,
// m or None: blocks_rows'), tiles (N/16, C, 16) float32 or float16 with None, None (a tied
// output layer's, as runtime/tiled_weights.py's TiledEmbedding reads them) or a float32 table (V, C) with None, None.
// Each is the module's lookup, the same bits.
at::Tensor embedding_rows(const c10::List<std::optional<at::Tensor>>& table, const at::Tensor& ids) {
  TORCH_CHECK(table.size() == 3 && table.get(0).has_value(), "embedding: three operands, the table's first");
  TORCH_CHECK(ids.device().is_cpu() && ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids: int64 (T,) on the CPU");
  const at::Tensor first = *table.get(0);
  const std::optional<at::Tensor> second = table.get(1);
  if (second.has_value()) return triforce_cpu::blocks_rows(first, *second, table.get(2), ids);  // GGUF blocks
  TORCH_CHECK(first.device().is_cpu() && first.is_contiguous() && (first.dim() == 2 || first.dim() == 3),
              "embedding: a contiguous CPU table (V, C) or tiles (N/16, C, 16)");
  const bool tiles = first.dim() == 3, half = first.scalar_type() == at::kHalf;
  TORCH_CHECK(tiles ? first.size(2) == 16 && (first.scalar_type() == at::kFloat || half)
                    : first.scalar_type() == at::kFloat,
              "embedding: float32 or float16 tiles (N/16, C, 16), or a float32 table (V, C)");
  const at::Tensor rows = ids.contiguous();
  const int64_t count = rows.size(0), k = first.size(1), n = tiles ? first.size(0) * 16 : first.size(0);
  const int64_t* id = rows.data_ptr<int64_t>();
  at::Tensor out = at::empty({count, k}, first.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < count; ++r) {
    TORCH_CHECK(id[r] >= 0 && id[r] < n, "ids: rows 0 to ", n - 1, " of the embedding, not ", id[r]);
    if (!tiles) {
      std::copy_n(first.data_ptr<float>() + id[r] * k, k, o + r * k);
      continue;
    }
    const int64_t start = id[r] / 16 * k * 16 + id[r] % 16;  // tile id / 16, lane id % 16, column i at 16 i
    if (half) {
      const at::Half* from = first.data_ptr<at::Half>() + start;
      for (int64_t i = 0; i < k; ++i) o[r * k + i] = float(from[16 * i]);
    } else {
      const float* from = first.data_ptr<float>() + start;
      for (int64_t i = 0; i < k; ++i) o[r * k + i] = from[16 * i];
    }
  }
  return out;
}

// A whole eager step in one call: embedding_rows of ids, cached_layers over them, and output_logits of the last
// num_logits rows -> the logits (num_logits, V) and, with keep_queries, every layer's queries (cached_layers').
std::tuple<at::Tensor, std::vector<at::Tensor>> cached_step(
    const c10::intrusive_ptr<LayerStack>& stack, const c10::List<std::optional<at::Tensor>>& embedding,
    const c10::intrusive_ptr<OutputHead>& head, const at::Tensor& ids, const at::Tensor& rotation, at::Tensor& keys,
    at::Tensor& values, int64_t write_slot, at::IntArrayRef view_starts, int64_t origin, bool windowed,
    int64_t segment, bool keep_queries, int64_t num_logits) {
  auto [h, queries] = cached_layers(stack, embedding_rows(embedding, ids), rotation, keys, values, write_slot,
                                    view_starts, origin, windowed, segment, keep_queries);
  TORCH_CHECK(0 < num_logits && num_logits <= h.size(0), "num_logits: 1 to the step's ", h.size(0), " rows");
  return {output_logits(head, h.narrow(0, h.size(0) - num_logits, num_logits)), std::move(queries)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triforce_cpu, lib) {
  lib.class_<LayerStack>("LayerStack")
      .def(torch::init<>())
      .def("add", &LayerStack::add)
      .def("direct_layers", &LayerStack::direct_layers);
  lib.class_<OutputHead>("OutputHead")
      .def(torch::init<at::Tensor, double, c10::List<std::optional<at::Tensor>>, std::vector<int64_t>,
                       std::optional<at::Tensor>, int64_t>())
      .def("direct", [](const c10::intrusive_ptr<OutputHead>& head) { return head->direct; });
  lib.def("output_logits(__torch__.torch.classes.triforce_cpu.OutputHead head, Tensor x) -> Tensor");
  lib.def("embedding_rows(Tensor?[] table, Tensor ids) -> Tensor");
  lib.def(
      "cached_step(__torch__.torch.classes.triforce_cpu.LayerStack stack, Tensor?[] embedding, "
      "__torch__.torch.classes.triforce_cpu.OutputHead head, Tensor ids, Tensor rotation, Tensor(a!) keys, "
      "Tensor(b!) values, int write_slot, int[] view_starts, int origin, bool windowed, int segment, "
      "bool keep_queries, int num_logits) -> (Tensor, Tensor[])");
  lib.def(
      "cached_layers(__torch__.torch.classes.triforce_cpu.LayerStack stack, Tensor x, Tensor rotation, "
      "Tensor(a!) keys, Tensor(b!) values, int write_slot, int[] view_starts, int origin, bool windowed, "
      "int segment, bool keep_queries) -> (Tensor, Tensor[])");
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  lib.def("silu_mul(Tensor gate_up) -> Tensor");
  lib.def(
      "rotary_heads(Tensor qkv, Tensor rotation, int heads, int rotated, int q_heads, Tensor? q_norm, "
      "Tensor? k_norm, float eps) -> Tensor");
  lib.def(
      "attention_input(Tensor x, Tensor norm_weight, float eps, Tensor?[] qkv, int[] qkv_features, "
      "Tensor rotation, int q_heads, int kv_heads, Tensor? q_norm, Tensor? k_norm) -> (Tensor, Tensor, Tensor)");
  lib.def(
      "layer_output(Tensor x, Tensor attended, Tensor?[] o_proj, int[] o_features, Tensor norm_weight, float eps, "
      "Tensor?[] gate_up, int[] gate_up_features, Tensor?[] down, int[] down_features) -> Tensor");
  lib.def(
      "cached_layer(Tensor x, Tensor norm_weight, float eps, Tensor?[] qkv, int[] qkv_features, Tensor rotation, "
      "int q_heads, int kv_heads, Tensor? q_norm, Tensor? k_norm, Tensor(a!) keys, Tensor(b!) values, int layer, "
      "int write_slot, int view_start, float scale, int origin, int window, int segment, Tensor?[] o_proj, "
      "int[] o_features, Tensor post_norm, float post_eps, Tensor?[] gate_up, int[] gate_up_features, "
      "Tensor?[] down, int[] down_features) -> (Tensor, Tensor)");
}

// CPU kernels, so that each op is one dispatch whatever it calls inside
TORCH_LIBRARY_IMPL(triforce_cpu, CPU, lib) {
  lib.impl("rms_norm", &rms_norm);
  lib.impl("silu_mul", &silu_mul);
  lib.impl("rotary_heads", &rotary_heads);
  lib.impl("attention_input", &attention_input);
  lib.impl("layer_output", &layer_output);
  lib.impl("cached_layer", &cached_layer);
  lib.impl("cached_layers", &cached_layers);
  lib.impl("output_logits", &output_logits);
  lib.impl("embedding_rows", &embedding_rows);
  lib.impl("cached_step", &cached_step);
}

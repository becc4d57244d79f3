// A decode step's sampling distribution and its draw, one row at a time, in place of the dozen vocabulary-wide torch
// ops that decoding.sampling's probabilities and sample run (about 0.5 ms a row at 49,152 tokens, against a few tens
// of microseconds here).
//
// sampling_probabilities(logits (N, V), temperature, top_k, min_p, top_p) -> probs (N, V): what
// decoding.sampling.probabilities computes for temperature > 0, in these steps for each row alone:
//   1. y = logits / temperature; with 0 < top_k < V, every y below the top_k-th largest becomes -inf;
//   2. the softmax: e = exp(y - max y) (vector_exp.h's exp), p = e / (the sum of e);
//   3. with min_p > 0, every p below min_p * max p becomes 0, and the rest are divided by their sum;
//   4. with top_p < 1, the nucleus: ranked by p (descending, ties by token id), a token stays while the mass ranked
//      above it (the running sum of the ranked p, minus its own) is below top_p, the first always; the others
//      become 0 and the kept ones are divided by their sum. Only the tokens of p >= tau are ranked, tau the largest
//      of max p * 2^-8, 2^-16, ... (or 0) whose tokens hold top_p of the mass: no token below tau can be reached.
// Sums run in 16 lanes (element i into lane i mod 16), then lane by lane in order, so that a row's result is the
// same bits whatever rows go with it. The AVX-512 and AVX2 bodies take the same exp steps (vector_exp.h) and give
// the same bits; the plain C++ body calls std::exp, whose bits differ. Differences from the torch ops are float32
// roundings of the same quantities.
//
// sample_rows(probs (N, V), uniform (N,) float64 in [0, 1)) -> (N,) int64: for each row the first token whose
// running float64 sum of probs exceeds uniform * (the row's float64 sum), as decoding.sampling.sample's cumsum and
// searchsorted find it (the last token where rounding leaves none). Zero probabilities add nothing, so only the
// nonzero ones are summed, in token order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "isa.h"
#include "vector_exp.h"

namespace {

using triforce_cpu::chosen_isa;
using triforce_cpu::Isa;

constexpr int64_t kLanes = 16;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
constexpr float kNucleusStep = 1.0f / 256;  // tau shrinks by this factor until its tokens hold top_p of the mass

// The lanes' sum, lane 0 first.
__attribute__((always_inline)) inline float lanes_sum(const float (&lanes)[kLanes]) {
  float total = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// The loops below keep 16 lanes explicitly (element i in lane i mod 16), so that each body's compiler vectorizes
// them without reordering a sum; a row of n % 16 != 0 takes its tail in the same lanes.
__attribute__((always_inline)) inline float row_sum(const float* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += x[i + l];
  for (int64_t l = 0; i + l < n; ++l) lanes[l] += x[i + l];
  return lanes_sum(lanes);
}

__attribute__((always_inline)) inline float row_max(const float* x, int64_t n) {
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, kMinusInf);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = lanes[l] < x[i + l] ? x[i + l] : lanes[l];
  for (int64_t l = 0; i + l < n; ++l) lanes[l] = std::max(lanes[l], x[i + l]);
  return *std::max_element(lanes, lanes + kLanes);
}

// The mass of the x >= tau, in lanes.
__attribute__((always_inline)) inline float mass_from(const float* x, int64_t n, float tau) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += x[i + l] >= tau ? x[i + l] : 0.f;
  for (int64_t l = 0; i + l < n; ++l) lanes[l] += x[i + l] >= tau ? x[i + l] : 0.f;
  return lanes_sum(lanes);
}

__attribute__((always_inline)) inline void divide_row(float* x, int64_t n, float divisor) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] / divisor;
}

// take(i) for each i < n, in order, where keep(x[i]); 16 elements are looked at together first, so that a run of
// 16 none of which is kept costs one pass of compares (most of a nucleus-cut row's tokens are 0).
template <typename Keep, typename Take>
__attribute__((always_inline)) inline void each_kept(const float* x, int64_t n, Keep keep, Take take) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t end = std::min(n, i + kLanes);
    bool any = false;
    for (int64_t j = i; j < end; ++j) any |= keep(x[j]);
    if (!any) continue;
    for (int64_t j = i; j < end; ++j)
      if (keep(x[j])) take(j);
  }
}

__attribute__((target("avx512f"))) void exp_shifted_avx512(float* x, int64_t n, float shift) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    _mm512_storeu_ps(x + i, triforce_cpu::exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(shift))));
  if (i < n) {
    const __mmask16 tail = __mmask16((1u << (n - i)) - 1);
    const __m512 y = _mm512_mask_loadu_ps(_mm512_set1_ps(kMinusInf), tail, x + i);
    _mm512_mask_storeu_ps(x + i, tail, triforce_cpu::exp512(_mm512_sub_ps(y, _mm512_set1_ps(shift))));
  }
}

__attribute__((target("avx2,fma"))) void exp_shifted_avx2(float* x, int64_t n, float shift) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, triforce_cpu::exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(shift))));
  if (i < n) {
    float tail[8];
    std::fill(tail, tail + 8, kMinusInf);
    std::copy(x + i, x + n, tail);
    _mm256_storeu_ps(tail, triforce_cpu::exp256(_mm256_sub_ps(_mm256_loadu_ps(tail), _mm256_set1_ps(shift))));
    std::copy(tail, tail + (n - i), x + i);
  }
}

// x = exp(x - shift), in place (-inf gives 0).
inline void exp_shifted(Isa isa, float* x, int64_t n, float shift) {
  switch (isa) {
    case Isa::avx512: return exp_shifted_avx512(x, n, shift);
    case Isa::avx2: return exp_shifted_avx2(x, n, shift);
    default:
      for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - shift);
  }
}

// The nucleus of the normalised row p (n), as step 4 of the top of this file.
__attribute__((always_inline)) inline void keep_nucleus(float* p, int64_t n, float top_p) {
  float tau = row_max(p, n) * kNucleusStep;
  while (tau > 0.f && mass_from(p, n, tau) < top_p)
    tau = tau * kNucleusStep;  // reaches 0 after a few steps at most (float32's least normal is 2^-126)
  std::vector<std::pair<float, int64_t>> ranked;
  each_kept(
      p, n, [tau](float x) { return x >= tau && x > 0.f; }, [&](int64_t j) { ranked.emplace_back(p[j], j); });
  std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::fill(p, p + n, 0.f);
  float running = 0.f, kept = 0.f;
  size_t count = 0;
  for (size_t j = 0; j < ranked.size(); ++j) {
    running += ranked[j].first;
    if (j > 0 && running - ranked[j].first >= top_p) continue;  // as torch's cumsum - ranked: its own mass before
    ranked[count++] = ranked[j];
    kept += ranked[j].first;
  }
  for (size_t j = 0; j < count; ++j) p[ranked[j].second] = ranked[j].first / kept;
}

__attribute__((always_inline)) inline void probabilities_row(Isa isa, const float* logits, int64_t n,
                                                             double temperature, int64_t top_k, double min_p,
                                                             double top_p, float* p) {
  const float t = float(temperature);
  for (int64_t i = 0; i < n; ++i) p[i] = logits[i] / t;
  if (top_k > 0 && top_k < n) {
    std::vector<float> sorted(p, p + n);
    std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<float>());
    const float kth = sorted[top_k - 1];
    for (int64_t i = 0; i < n; ++i) p[i] = p[i] < kth ? kMinusInf : p[i];
  }
  exp_shifted(isa, p, n, row_max(p, n));
  divide_row(p, n, row_sum(p, n));
  if (min_p > 0) {
    const float floor = float(min_p) * row_max(p, n);
    for (int64_t i = 0; i < n; ++i) p[i] = p[i] < floor ? 0.f : p[i];
    divide_row(p, n, row_sum(p, n));
  }
  if (top_p < 1.0) keep_nucleus(p, n, float(top_p));
}

// One body for each instruction set, the same arithmetic vectorized for it.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void rows_avx512(const float* in, int64_t begin, int64_t end,
                                                                      int64_t n, double temperature, int64_t top_k,
                                                                      double min_p, double top_p, float* out) {
  for (int64_t r = begin; r < end; ++r)
    probabilities_row(Isa::avx512, in + r * n, n, temperature, top_k, min_p, top_p, out + r * n);
}

__attribute__((target("avx2,fma"))) void rows_avx2(const float* in, int64_t begin, int64_t end, int64_t n,
                                                   double temperature, int64_t top_k, double min_p, double top_p,
                                                   float* out) {
  for (int64_t r = begin; r < end; ++r)
    probabilities_row(Isa::avx2, in + r * n, n, temperature, top_k, min_p, top_p, out + r * n);
}

void rows_plain(const float* in, int64_t begin, int64_t end, int64_t n, double temperature, int64_t top_k,
                double min_p, double top_p, float* out) {
  for (int64_t r = begin; r < end; ++r)
    probabilities_row(Isa::scalar, in + r * n, n, temperature, top_k, min_p, top_p, out + r * n);
}

at::Tensor sampling_probabilities(const at::Tensor& logits, double temperature, int64_t top_k, double min_p,
                                  double top_p) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "logits: float32 (N, V) on the CPU");
  TORCH_CHECK(temperature > 0, "temperature: above 0 (greedy rows are one-hot, decoding.sampling)");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    switch (chosen_isa()) {
      case Isa::avx512: return rows_avx512(in, begin, end, n, temperature, top_k, min_p, top_p, o);
      case Isa::avx2: return rows_avx2(in, begin, end, n, temperature, top_k, min_p, top_p, o);
      default: return rows_plain(in, begin, end, n, temperature, top_k, min_p, top_p, o);
    }
  });
  return out;
}

at::Tensor sample_rows(const at::Tensor& probs, const at::Tensor& uniform) {
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == at::kFloat && probs.dim() == 2,
              "probs: float32 (N, V) on the CPU");
  TORCH_CHECK(uniform.device().is_cpu() && uniform.scalar_type() == at::kDouble && uniform.numel() == probs.size(0),
              "uniform: float64, one for each row of probs");
  const at::Tensor p = probs.contiguous(), u = uniform.contiguous();
  const int64_t rows = p.size(0), n = p.size(1);
  at::Tensor out = at::empty({rows}, p.options().dtype(at::kLong));
  const float* pp = p.data_ptr<float>();
  const double* uu = u.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = pp + r * n;
    std::vector<int64_t> nonzero;
    double total = 0.0;
    each_kept(
        row, n, [](float x) { return x != 0.f; },
        [&](int64_t j) {
          nonzero.push_back(j);
          total += double(row[j]);
        });
    const double target = uu[r] * total;
    int64_t token = n - 1;
    double running = 0.0;
    for (const int64_t i : nonzero) {
      running += double(row[i]);
      if (running > target) {
        token = i;
        break;
      }
    }
    o[r] = token;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triforce_cpu, lib) {
  lib.def("sampling_probabilities(Tensor logits, float temperature, int top_k, float min_p, float top_p) -> Tensor",
          &sampling_probabilities);
  lib.def("sample_rows(Tensor probs, Tensor uniform) -> Tensor", &sample_rows);
}

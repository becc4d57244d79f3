// The most float32 multiply-adds this CPU's vector units do a second: independent FMA chains on every thread torch
// runs, no memory read. The physical ceiling of arithmetic beside which `triforce bench --forward-costs` sets a
// forward's arithmetic floor (plan.measure.peak_flops): a matrix product reaches less (it loads and stores), and
// no kernel of the forward can reach more.
//
// kChains accumulators a thread keep both FMA pipes busy through an FMA's latency (Zen 4 and recent Intel cores:
// 2 pipes, 4 cycles: 8 chains in flight at least); the widest body the CPU runs (isa.h), as the kernels do.
// A header, registered as an op by gguf_blocks.cpp beside isa(): a source of its own would parse torch's headers
// once more in every first build (about 10 s of a 2-core machine's).

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "isa.h"

namespace triforce_cpu::peak {

constexpr int kChains = 12;

// rounds x kChains FMAs of 16 lanes; returns a value that depends on every chain, so none is left out
__attribute__((target("avx512f"))) inline float chains_avx512(int64_t rounds) {
  const __m512 scale = _mm512_set1_ps(0.999999f), shift = _mm512_set1_ps(1e-6f);
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(float(i));
  for (int64_t n = 0; n < rounds; ++n)
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], scale, shift);
  float kept = 0.f;
  for (int i = 0; i < kChains; ++i) kept += _mm512_reduce_add_ps(acc[i]);
  return kept;
}

// the same with 8 lanes
__attribute__((target("avx2,fma"))) inline float chains_avx2(int64_t rounds) {
  const __m256 scale = _mm256_set1_ps(0.999999f), shift = _mm256_set1_ps(1e-6f);
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(float(i));
  for (int64_t n = 0; n < rounds; ++n)
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], scale, shift);
  float lanes[8], kept = 0.f;
  for (int i = 0; i < kChains; ++i) {
    _mm256_storeu_ps(lanes, acc[i]);
    for (float lane : lanes) kept += lane;
  }
  return kept;
}

// plain C++: one lane, a multiply and an add (a CPU without AVX2 may have no FMA; the same 2 FLOP)
inline float chains_scalar(int64_t rounds) {
  float acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = float(i);
  for (int64_t n = 0; n < rounds; ++n)
    for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * 0.999999f + 1e-6f;
  float kept = 0.f;
  for (float a : acc) kept += a;
  return kept;
}

inline int64_t lanes() {
  switch (chosen_isa()) {
    case Isa::avx512: return 16;
    case Isa::avx2: return 8;
    default: return 1;
  }
}

inline float chains(int64_t rounds) {
  switch (chosen_isa()) {
    case Isa::avx512: return chains_avx512(rounds);
    case Isa::avx2: return chains_avx2(rounds);
    default: return chains_scalar(rounds);
  }
}

}  // namespace triforce_cpu::peak

namespace triforce_cpu {

// FLOP/s of `rounds` rounds of kChains FMA chains on each of torch's threads, from the first thread's start to the
// last one's end (2 FLOP a lane an FMA).
inline double peak_flops(int64_t rounds) {
  TORCH_CHECK(rounds > 0, "peak_flops: rounds > 0");
  const int64_t threads = at::get_num_threads();
  std::vector<float> kept(threads);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) kept[t] = peak::chains(rounds);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float sink = 0.f;
  for (float k : kept) sink += k;
  TORCH_CHECK(sink == sink, "peak_flops: chains gave NaN");  // reads every chain's result
  return 2.0 * double(threads) * double(rounds) * peak::kChains * double(peak::lanes()) / seconds;
}

}  // namespace triforce_cpu

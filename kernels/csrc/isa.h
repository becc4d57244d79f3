// The instruction set the CPU kernels run, shared by every source of the extension so that one choice
// (torch.ops.triforce_cpu.use_isa) switches all of them.
//
// AVX2 is taken with FMA and F16C, which every AVX2 CPU has: the attention kernels widen float16 with vcvtph2ps.

#pragma once

namespace triforce_cpu {

enum class Isa { scalar, avx2, avx512 };

inline Isa best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::avx2;
  return Isa::scalar;
}

// The body every kernel runs from now on; inline, so that the library holds a single one.
inline Isa& chosen_isa() {
  static Isa isa = best_isa();
  return isa;
}

}  // namespace triforce_cpu

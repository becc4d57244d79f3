// exp and 2^x over float32 vectors, each in one fixed sequence of operations, so a lane's result depends on its
// input alone.
//
// exp (step_ops.cpp's SiLU): exp(x) = 2^n p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 polynomial (within 2 ulp
// of float32's exp). Inputs below -88 (and -inf) give 0; above 88.376, the value at 88.376. The AVX2 version takes
// the same steps; its 2^n is two exact factors 2^(n/2) 2^(n - n/2), as an exponent field holds neither 2^-127 nor
// 2^128.
//
// 2^x (the attention kernel's softmax, which takes its scores in base 2: the queries are scaled by log2(e)
// beforehand): 2^x = 2^n p(f), n = round(x), f = x - n (exact, |f| <= 1/2), p a degree-6 polynomial (within 1 ulp
// of float32's 2^f; p(0) = 1 exactly, so 2^0 is 1). Inputs are clamped below at -150, where 2^n p rounds to 0, so
// -inf (a hidden key) gives 0; the kernel's inputs are never above 0. The AVX2 version takes the same steps; its 2^n
// is two exact factors 2^(n/2) 2^(n - n/2), as an exponent field holds neither 2^-150 nor its halves' product, and
// one rounding of the exact product as AVX-512's scalef.

#pragma once

#include <immintrin.h>

namespace triforce_cpu {

// Both widths take the same steps with the same constants: clamp to [kExpLow, kExpHigh], n = round(x log2(e)),
// r = x - n ln2 in two parts (kLn2High + kLn2Low), then p(r) = 1 + r + r^2 (kExpPoly[0] r^5 + ... + kExpPoly[5]).
constexpr float kExpHigh = 88.3762626647949f;
constexpr float kExpLow = -88.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f;
constexpr float kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// Declares r and p(r) from n and the clamped x, in the intrinsics of one width: PS is their prefix (_mm512,
// _mm256), V the vector type. Written once so that both widths compute the same polynomial the same way; the
// steps are written out, so every constant is known where it is broadcast.
#define TRIFORCE_EXP_POLYNOMIAL(PS, V, n, clamped)                                                               \
  const V r = PS##_fnmadd_ps(n, PS##_set1_ps(kLn2Low), PS##_fnmadd_ps(n, PS##_set1_ps(kLn2High), clamped));      \
  V p = PS##_fmadd_ps(PS##_set1_ps(kExpPoly[0]), r, PS##_set1_ps(kExpPoly[1]));                                \
  p = PS##_fmadd_ps(p, r, PS##_set1_ps(kExpPoly[2]));                                                            \
  p = PS##_fmadd_ps(p, r, PS##_set1_ps(kExpPoly[3]));                                                            \
  p = PS##_fmadd_ps(p, r, PS##_set1_ps(kExpPoly[4]));                                                            \
  p = PS##_fmadd_ps(p, r, PS##_set1_ps(kExpPoly[5]));                                                            \
  p = PS##_fmadd_ps(p, PS##_mul_ps(r, r), PS##_add_ps(r, PS##_set1_ps(1.0f)))

__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {
  const __m512 clamped = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kExpHigh)), _mm512_set1_ps(kExpLow));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  TRIFORCE_EXP_POLYNOMIAL(_mm512, __m512, n, clamped);
  const __m512 result = _mm512_scalef_ps(p, n);
  const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(zero, result, _mm512_setzero_ps());
}

__attribute__((target("avx2,fma"))) inline __m256 exp256(__m256 x) {
  const __m256 clamped = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kExpHigh)), _mm256_set1_ps(kExpLow));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  TRIFORCE_EXP_POLYNOMIAL(_mm256, __m256, n, clamped);
  const __m256i whole = _mm256_cvtps_epi32(n);  // -127..127
  const __m256i half = _mm256_srai_epi32(whole, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(whole, half), bias), 23));
  const __m256 result = _mm256_mul_ps(_mm256_mul_ps(p, first), second);
  const __m256 zero = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_LT_OQ);
  return _mm256_blendv_ps(result, _mm256_setzero_ps(), zero);
}

#undef TRIFORCE_EXP_POLYNOMIAL



// Both widths take the same steps with the same constants: clamp to >= kExp2Low, n = round(x), f = x - n, then
// p(f) = kExp2Poly[6] f^6 + ... + kExp2Poly[0] by Horner's rule, one FMA a degree.
constexpr float kExp2Low = -150.0f;
constexpr float kExp2Poly[] = {1.0f,           6.9314718246e-01f, 2.4022646248e-01f, 5.5503286421e-02f,
                               9.6184890717e-03f, 1.3399930904e-03f, 1.5345812426e-04f};

// Declares n, f and p(f) from x, in the intrinsics of one width: PS is their prefix (_mm512, _mm256), V the vector
// type, ROUND the rounding to the nearest integer. Written once so that both widths compute the same polynomial the
// same way; the steps are written out, so every constant is known where it is broadcast.
#define TRIFORCE_EXP2_POLYNOMIAL(PS, V, ROUND, x)                                                                \
  const V clamped = PS##_max_ps(x, PS##_set1_ps(kExp2Low));                                                      \
  const V n = ROUND(clamped);                                                                                    \
  const V f = PS##_sub_ps(clamped, n);                                                                           \
  V p = PS##_fmadd_ps(PS##_set1_ps(kExp2Poly[6]), f, PS##_set1_ps(kExp2Poly[5]));                                \
  p = PS##_fmadd_ps(p, f, PS##_set1_ps(kExp2Poly[4]));                                                           \
  p = PS##_fmadd_ps(p, f, PS##_set1_ps(kExp2Poly[3]));                                                           \
  p = PS##_fmadd_ps(p, f, PS##_set1_ps(kExp2Poly[2]));                                                           \
  p = PS##_fmadd_ps(p, f, PS##_set1_ps(kExp2Poly[1]));                                                           \
  p = PS##_fmadd_ps(p, f, PS##_set1_ps(kExp2Poly[0]))

#define TRIFORCE_ROUND512(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define TRIFORCE_ROUND256(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

__attribute__((target("avx512f"))) inline __m512 exp2_512(__m512 x) {
  TRIFORCE_EXP2_POLYNOMIAL(_mm512, __m512, TRIFORCE_ROUND512, x);
  return _mm512_scalef_ps(p, n);
}

__attribute__((target("avx2,fma"))) inline __m256 exp2_256(__m256 x) {
  TRIFORCE_EXP2_POLYNOMIAL(_mm256, __m256, TRIFORCE_ROUND256, x);
  const __m256i whole = _mm256_cvtps_epi32(n);  // -150..127
  const __m256i half = _mm256_srai_epi32(whole, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(whole, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, first), second);
}

#undef TRIFORCE_EXP2_POLYNOMIAL
#undef TRIFORCE_ROUND512
#undef TRIFORCE_ROUND256

}  // namespace triforce_cpu
